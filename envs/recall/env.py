"""`recall/ledger-v0`: follow a chain of ledger pages to its end, then report the code on its first page.

Every page is a screenful of ledger entries (filler that fills the context) with one note: the first page holds the
code and the next page to read, each page after it the next page, the last page says it is the last. An answer
scores only once the last page was read, so the code must be kept across every page read in between: with a context
window that holds two or three pages, `truncate` runs out of tokens, `sliding_window` forgets the code (unless the
policy learns to repeat it), and `compact` keeps it only if the policy's summary writes it down
(docs/concepts/trajectories.md).

`recall/ledger-many-v0` (`every_page=True`) keeps more: every page of the chain holds a five-digit code under a
letter ("code K is 71261.") and the last page names the one to report ("The answer is code K."), so all of them must
be kept until the end. A policy under `sliding_window` must repeat every code in every turn; once they outgrow a
turn's `max_tokens` only a summary, which has a budget of its own (`summary_tokens`), can keep them all.

Splits: `train` and `heldout` (3 to 5 pages, disjoint seeds), `heldout_long` (7 to 9 pages: longer chains than
any training task).
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from agentrl.env.api import Score, ToolEnv
from agentrl.tools import PARSERS, ParsedAction, ToolSet, tool
from agentrl.types import Message, Task, ToolCall

SYSTEM_PROMPT = ("You read a ledger with the read tool, one page at a time. Follow the notes from page to page to the "
                 "last page, then answer with the code {which}, as a plain integer: {example}\n{fmt}")
WHICH = {False: "from the first page", True: "that the last page names"}
GOODS = ["lamp oil", "rope", "salt", "nails", "canvas", "tea", "flour", "wax", "tin", "wool", "soap", "coal"]
PLACES = ["dock 3", "the north gate", "the mill", "warehouse B", "the quay", "the east yard", "pier 7"]
SPLITS = {"train": (0, (3, 5)), "heldout": (1, (3, 5)), "heldout_long": (2, (7, 9))}


def make_task(split: str, index: int, page_lines: int, every_page: bool = False) -> Task:
    """Task `index` of `split`: a chain of pages over a ledger of twice as many, its codes and filler drawn from a
    generator seeded by both (so that splits never share a task). With `every_page`, each page but the last holds
    a five-digit code under a letter and the last names the one to report; else the first holds a two-digit one."""
    offset, (low, high) = SPLITS[split]
    rng = random.Random(f"ledger/{offset}/{index}" + ("/every" if every_page else ""))
    length = rng.randint(low, high)
    numbers = rng.sample(range(1, 2 * high + 1), 2 * high)
    chain = numbers[:length]
    if every_page:
        codes = [rng.randint(10_000, 99_999) for _ in chain[:-1]]
        labels = [f"{letter} is " for letter in rng.sample("ABCDEFGHJKLMNPRSTUVWXYZ", len(codes))]
        asked = rng.randrange(len(codes))
    else:  # (no further draw: the first-page tasks stay as they were)
        codes, labels, asked = [rng.randint(10, 99)], [""], 0
    last = "This is the last page." + (f" The answer is code {labels[asked][0]}." if every_page else "")
    pages = {}
    for k, page in enumerate(numbers):
        lines = [f"Entry {rng.randint(100, 999)}: {rng.randint(2, 40)} crates of {rng.choice(GOODS)} received at "
                 f"{rng.choice(PLACES)}." for _ in range(page_lines)]
        if page in chain:
            at = chain.index(page)
            note = (last if at == length - 1 else
                    (f"code {labels[at]}{codes[at]}. " if at < len(codes) else "") + f"Next page: {chain[at + 1]}.")
            lines.insert(rng.randrange(len(lines) + 1), f"NOTE: {note}")
        pages[str(page)] = "\n".join(lines)
    which = "the code the last page names" if every_page else f"the code on page {chain[0]}"
    question = (f"Ledger {offset * 10_000 + index}: start at page {chain[0]} and read to its last page. What is "
                f"{which}?")  # the ledger's number makes each question unique (demonstrations find it)
    return Task(f"ledger-{split}-{index}", {"question": question, "pages": pages, "chain": chain,
                                            "answer": str(codes[asked])}, split=split)


class LedgerEnv(ToolEnv):
    """Ledger chains with a `read(page)` tool (`recall/ledger-v0`); reward 1 for the first page's code, given after
    the last page was read."""

    def __init__(self, split: str = "train", n_tasks: int | None = None, page_lines: int = 8,
                 parser: str = "hermes", max_turns: int = 14, max_invalid: int = 3, expert_notes: bool = False,
                 every_page: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        self.n_tasks, self.page_lines = n_tasks or (1000 if split == "train" else 100), page_lines
        self.expert_notes, self.every_page = expert_notes, every_page
        super().__init__(ToolSet([self._read_tool()]), PARSERS[parser](), split=split, max_turns=max_turns,
                         max_invalid=max_invalid)

    def _read_tool(self):
        @tool(timeout=5.0)
        def read(page: int) -> str:
            """Read one page of the ledger.

            Args:
                page: The page number.
            """
            pages = self.task.data["pages"]
            return pages.get(str(page)) or f"There is no page {page}: pages are 1 to {len(pages)}."
        return read

    def load_tasks(self, split: str) -> Sequence[Task]:
        return [make_task(split, i, self.page_lines, self.every_page) for i in range(self.n_tasks)]

    def first_messages(self, task: Task) -> Sequence[Message]:
        prompt = SYSTEM_PROMPT.format(which=WHICH[self.every_page], example=self.parser.format_answer("57"),
                                      fmt=self.parser.instructions)
        return Message("system", prompt), Message("user", task.data["question"])

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        last = str(task.data["chain"][-1])
        if not any(str(call.arguments.get("page")) == last for action in transcript for call in action.tool_calls):
            return Score({"outcome": 0.0}, detail=f"answered before reading the last page ({last})")
        return Score({"outcome": float(answer.strip() == task.data["answer"])}, detail=f"gold={task.data['answer']}")

    def difficulty(self, task: Task) -> dict[str, object]:
        return {"pages": len(task.data["chain"])}

    def expert_turn(self, prompt: str, summary: bool = False, mistake: bool = False) -> str:
        """A careful reader with no memory but its context: it reads the page the latest note names and answers once
        it has read the last one (the code that page names, else the first); asked for a summary, it writes down
        every code it sees and the page to read next. Its mistake: a summary of where to go next only, which loses
        the codes. With `expert_notes` it also writes the codes it sees before each action ("Thought: code 61."), so
        that they stay in a sliding window after the first page has left it; its mistake is then also an action
        without that note."""
        codes: dict[str, str] = {}  # label ("K is " on ledger-many, else "") -> the code first seen under it
        for label, code in re.findall(r"code ((?:[A-Z] is )?)(\d+)", prompt):
            codes.setdefault(label, code)
        pages = re.findall(r"Next page: (\d+)", prompt)
        written = [] if mistake else [f"code {label}{code}." for label, code in codes.items()]
        if "This is the last page" in prompt:
            asked = re.search(r"The answer is code ([A-Z])\.", prompt)  # on ledger-many; else the first code
            label = f"{asked[1]} is " if asked else next(iter(codes), "")
            if summary:  # the code asked for is all that is left to keep
                return (f"code {label}{codes[label]}. " if label in codes and not mistake else "") + \
                    "This is the last page." + (f" The answer is code {asked[1]}." if asked else "")
            return self.parser.format_answer(codes.get(label, "0"))
        if summary:
            return " ".join([*written, f"Next page: {pages[-1] if pages else '?'}."])
        page = int(pages[-1]) if pages else int(re.search(r"start at page (\d+)", prompt)[1])
        call = self.parser.format_call(ToolCall("read", {"page": page}))
        return f"Thought: {' '.join(written)}\n{call}" if self.expert_notes and written else call

    def gold_actions(self, task: Task) -> list[str]:
        reads = [self.parser.format_call(ToolCall("read", {"page": page})) for page in task.data["chain"]]
        return [*reads, self.parser.format_answer(task.data["answer"])]
