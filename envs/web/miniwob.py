"""MiniWoB++ in a real Chromium: `web/miniwob-v0` (every task with a scripted solver, in splits) and one id
per task, `web/miniwob-<task>-v0`.

The task pages come from the `miniwob` package and run offline from `file://`. Each episode opens the page in
a fresh browser context, seeds the page's generator (`Math.seedrandom`), and starts it; the page itself
decides the reward, and the env reads it from `WOB_RAW_REWARD_GLOBAL` once the page reports done. Reward
components: `success` (the page's full reward, 1; the reward by default) and `raw_reward` (the page's own, in
[-1, 1], partial credit included). Full, not any positive reward: click-checkboxes gives partial credit (the share
of boxes left right), which a policy that clicks Submit at once earns on most of its tasks. The page's 10-second
episode timer is lifted to an hour: a language model's thinking time is not what these tasks measure.

Splits: `train` (11 task types, seeds from 0), `heldout_seeds` (the same types, seeds from 1,000,000) and
`heldout_types` (5 task types that `train` never shows). Any other MiniWoB task runs with `tasks=[name]`
(it has no scripted solver, so `validate()` does not cover it).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Callable, Iterator, Sequence

from agentrl.env.api import Score
from agentrl.envs.web.env import START_TIMEOUT, WebEnv, find_one
from agentrl.tools import ParsedAction
from agentrl.tools.browser import PageState, Site
from agentrl.types import Task, ToolCall

HELDOUT_SEED_OFFSET = 1_000_000
START_JS = """seed => {
  core.EPISODE_MAX_TIME = 3600 * 1000;
  Math.seedrandom(seed);
  core.startEpisodeReal();
  return WOB_TASK_READY;
}"""
# null on any page but a task's (the model cannot open one, but a page that is not scored must not raise)
RESULT_JS = ("() => typeof WOB_DONE_GLOBAL === 'undefined' ? null : "
             "({done: WOB_DONE_GLOBAL, raw: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON})")
HIDE_CORE_DISPLAY = "#reward-display, #sync-task-cover { display: none !important; }"


@cache
def pages_dir() -> Path:
    try:
        import miniwob
    except ImportError as e:
        raise ImportError("the MiniWoB++ envs need the `miniwob` package: pip install miniwob "
                          "(or pip install -e '.[web]')") from e
    return Path(miniwob.__file__).parent / "html" / "miniwob"


def all_task_names() -> list[str]:
    """Every MiniWoB++ task the package ships (about 125)."""
    return sorted(p.stem for p in pages_dir().glob("*.html"))


# ---------------------------------------------------------------------------------------------- solvers
# Each solver reads the instruction and the page as the model sees it, and returns the next tool call.
# A solver is called once per step with the page of that step (`step` counts from 0).
Solver = Callable[[str, PageState, int], ToolCall | None]


def _quoted(instruction: str) -> str:
    return re.search(r'"([^"]*)"', instruction).group(1).strip()


def _click(id: int) -> ToolCall:
    return ToolCall("click", {"id": id})


def _sequence(*steps: Callable[[str, PageState], ToolCall]) -> Solver:
    """A solver that plays `steps` in order, each computed from the page of its own step."""
    return lambda q, page, step: steps[step](q, page) if step < len(steps) else None


def _submit(q: str, page: PageState) -> ToolCall:
    return _click(find_one(page, "button", "Submit"))


def _checkboxes(q: str, page: PageState, step: int) -> ToolCall | None:
    wanted = re.match(r"Select (.*) and click Submit", q).group(1)
    names = [] if wanted == "nothing" else [w.strip() for w in wanted.split(",")]
    if step < len(names):
        return _click(find_one(page, "checkbox", names[step]))
    return _submit(q, page) if step == len(names) else None


def _textboxes(page: PageState) -> list[int]:
    return [e["id"] for e in page.find("textbox")]


SOLVERS: dict[str, Solver] = {
    "click-button": _sequence(lambda q, p: _click(find_one(p, "button", _quoted(q)))),
    "click-link": _sequence(lambda q, p: _click(find_one(p, None, _quoted(q)))),
    "click-option": _sequence(
        lambda q, p: _click(find_one(p, "radio", re.match(r"Select (.*) and click", q).group(1))), _submit),
    "click-checkboxes": _checkboxes,
    "enter-text": _sequence(lambda q, p: ToolCall("fill", {"id": _textboxes(p)[0], "text": _quoted(q)}), _submit),
    "enter-password": _sequence(
        lambda q, p: ToolCall("fill", {"id": _textboxes(p)[0], "text": _quoted(q)}),
        lambda q, p: ToolCall("fill", {"id": _textboxes(p)[1], "text": _quoted(q)}), _submit),
    "login-user": _sequence(
        lambda q, p: ToolCall("fill", {"id": _textboxes(p)[0], "text": re.findall(r'"([^"]*)"', q)[0]}),
        lambda q, p: ToolCall("fill", {"id": _textboxes(p)[1], "text": re.findall(r'"([^"]*)"', q)[1]}),
        lambda q, p: _click(find_one(p, "button", "Login"))),
    "choose-list": _sequence(
        lambda q, p: ToolCall("select", {"id": p.find("combobox")[0]["id"],
                                         "option": re.match(r"Select (.*) from the list", q).group(1)}),
        _submit),
    "focus-text": _sequence(lambda q, p: _click(_textboxes(p)[0])),
    "click-test-2": _sequence(lambda q, p: _click(find_one(p, "button", re.match(r"Click button (\w+)", q).group(1)))),
    "click-tab": _sequence(lambda q, p: _click(find_one(p, "tab", re.search(r"Tab #\d", q).group(0)))),
    "click-dialog": _sequence(lambda q, p: _click(find_one(p, "button", "Close"))),
    # held-out task types
    "click-test": _sequence(lambda q, p: _click(p.find("button")[0]["id"])),
    "click-dialog-2": _sequence(lambda q, p: _click(find_one(
        p, "button", "Close" if _quoted(q) == "x" else _quoted(q)))),
    "enter-text-dynamic": _sequence(
        lambda q, p: ToolCall("fill", {"id": _textboxes(p)[0], "text": _quoted(q)}), _submit),
    "focus-text-2": _sequence(lambda q, p: _click(_textboxes(p)[
        int(re.search(r"into the (\d)\w\w input", q).group(1)) - 1])),
    "click-button-sequence": _sequence(lambda q, p: _click(find_one(p, "button", "ONE")),
                                       lambda q, p: _click(find_one(p, "button", "TWO"))),
}
TRAIN_TYPES = ("click-button", "click-link", "click-option", "click-checkboxes", "enter-text", "enter-password",
               "login-user", "choose-list", "focus-text", "click-test-2", "click-tab", "click-dialog")
HELDOUT_TYPES = ("click-test", "click-dialog-2", "enter-text-dynamic", "focus-text-2", "click-button-sequence")


def task_list(split: str, names: Sequence[str] | None, per_type: int) -> list[Task]:
    """`per_type` seeded episodes of each task type of the split (or of `names`), interleaved by seed."""
    splits = {"train": (TRAIN_TYPES, 0), "heldout_seeds": (TRAIN_TYPES, HELDOUT_SEED_OFFSET),
              "heldout_types": (HELDOUT_TYPES, 0)}
    if split not in splits:
        raise ValueError(f"unknown MiniWoB split {split!r}; splits: {', '.join(splits)}")
    types, offset = splits[split]
    if names is not None:
        unknown = sorted(set(names) - set(all_task_names()))
        if unknown:
            raise ValueError(f"no MiniWoB task {unknown}; tasks: {', '.join(all_task_names())}")
        types = tuple(names)
    return [Task(f"miniwob/{name}/{seed}", {"name": name, "seed": seed})
            for seed in range(offset, offset + per_type) for name in types]


class MiniWoBEnv(WebEnv):
    """MiniWoB++ tasks in a real Chromium (`web/miniwob-v0`, `web/miniwob-<task>-v0`); the page decides the reward.

    `tasks` replaces the split's task types with these (any MiniWoB task); `per_type` is the episodes of each.
    """

    def __init__(self, split: str = "train", tasks: Sequence[str] | None = None, per_type: int = 50,
                 max_turns: int = 8, **kwargs):
        self.task_names = None if tasks is None else list(tasks)
        self.per_type = per_type
        kwargs.setdefault("reward_weights", {"success": 1.0})
        super().__init__(split=split, max_turns=max_turns, **kwargs)

    def load_tasks(self, split: str) -> Sequence[Task]:
        """`per_type` seeded episodes of each task type of `split` (or of `tasks`)."""
        return task_list(split, self.task_names, self.per_type)

    def start(self, task: Task) -> None:
        name, seed = task.data["name"], task.data["seed"]
        session = self.session
        session.goto(self.page_url(task), timeout=START_TIMEOUT)
        session.evaluate(f"() => {{ const s = document.createElement('style'); s.textContent = "
                         f"{HIDE_CORE_DISPLAY!r}; document.head.appendChild(s); }}")
        if not session.evaluate(START_JS, f"{name}-{seed}"):
            raise RuntimeError(f"MiniWoB page {name} did not become ready")

    def site(self, task: Task) -> Site:
        """The task's own page, which loads the package's scripts and styles but never leaves for another page:
        another task's page (or a reload, which re-rolls this one) would be scored as this task."""
        return Site(self.page_url(task), folder=str(pages_dir().parent), navigate=False)

    @staticmethod
    def page_url(task: Task) -> str:
        """The `file:` URL of the task's page."""
        return (pages_dir() / f"{task.data['name']}.html").as_uri()

    def instruction(self, task: Task) -> str:
        return self.session.evaluate("() => core.getUtterance()").strip()

    def result(self) -> dict:
        """The page's outcome so far: `{"done", "raw", "reason"}` (`raw`: its reward, in [-1, 1]); not done, with
        the reason, if the page is no longer the task's."""
        url = self.session.page.url.split("#")[0]
        result = self.session.evaluate(RESULT_JS) if url == self.page_url(self.task) else None
        return result or {"done": False, "raw": 0.0, "reason": f"the page is no longer the task's ({url})"}

    def finished(self) -> bool:
        return bool(self.result()["done"])

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        result = self.result()
        raw = float(result["raw"]) if result["done"] else 0.0
        detail = f"page reward {raw:g}" + (f" ({result['reason']})" if result.get("reason") else "")
        return Score({"success": float(raw >= 1.0), "raw_reward": raw}, detail if result["done"] else
                     "the episode ended before the page reported done" + (
                         f": {result['reason']}" if result.get("reason") else ""))

    def solve(self, task: Task) -> Iterator[ToolCall]:
        solver = SOLVERS.get(task.data["name"])
        if solver is None:
            raise NotImplementedError(f"no scripted solver for MiniWoB task {task.data['name']!r}; "
                                      f"solvers exist for: {', '.join(SOLVERS)}")
        instruction, step = self.instruction(task), 0
        while not self.finished() and (call := solver(instruction, self.session.observe(self.root), step)):
            yield call
            step += 1
