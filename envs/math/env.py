"""`math/arith-v0`: arithmetic word and expression problems with a calculator tool (RLVR).

Two reward components, reported separately:
- `outcome`: 1 if the final `<answer>` is exactly the gold integer (strict format: digits, optional
  leading minus, nothing else), else 0;
- `process`: the fraction of equations `lhs = rhs` written in the assistant's turns that are true
  (0 when none are written). It rewards showing correct work, independent of the final answer.
The env's scalar reward is `outcome_weight * outcome + process_weight * process`.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from agentrl.env.api import Score, ToolEnv
from agentrl.envs.math.arithmetic import ExpressionError, evaluate, format_number
from agentrl.envs.math.tasks import make_tasks
from agentrl.tools import PARSERS, ParsedAction, ToolSet, tool
from agentrl.types import Message, Task, ToolCall

ANSWER_FORMAT = re.compile(r"-?\d+")
EQUATION_RHS = re.compile(r"=\s*(-?\d+(?:\.\d+)?)")
LHS_CHARS = frozenset("0123456789 .+-*/()\t")

SYSTEM_PROMPT = (
    "You solve arithmetic problems. Use the calculator tool for any computation, show each step as an "
    "equation like `3 * 4 = 12`, and finish with the answer as a plain integer: {example}\n{fmt}"
)


@tool(timeout=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / ** and parentheses, e.g. "3 * (4 + 5)".
    """
    try:
        return format_number(evaluate(expression))
    except ExpressionError as e:  # the model's mistake: an observation, not a tool failure
        return f"error: {e}"


def outcome_reward(answer: str, gold: str) -> float:
    """1.0 if `answer` (stripped) is an integer in the strict format and equals `gold`, else 0.0."""
    answer = answer.strip()
    return float(ANSWER_FORMAT.fullmatch(answer) is not None and answer == gold)


def equations(text: str) -> list[tuple[str, str]]:
    """(lhs, rhs) of each `arithmetic = number` in the text. The left side is the run of arithmetic
    characters before '=' (scanned backwards, so the cost stays linear on adversarial text) and must
    hold a digit and an operator."""
    found = []
    for m in EQUATION_RHS.finditer(text):
        start = m.start()
        while start > 0 and text[start - 1] in LHS_CHARS:
            start -= 1
        lhs = text[start:m.start()].strip()
        while lhs.startswith("(") and lhs.count("(") > lhs.count(")"):  # "so (3 + 4 = 7)"
            lhs = lhs[1:].lstrip()
        if any(c.isdigit() for c in lhs) and any(c in "+-*/" for c in lhs.lstrip("-")):
            found.append((lhs, m.group(1)))
    return found


def _equation_verdicts(text: str) -> list[bool]:
    verdicts = []
    for lhs, rhs in equations(text):
        try:
            verdicts.append(evaluate(lhs) == evaluate(rhs))
        except ExpressionError:
            verdicts.append(False)
    return verdicts


def process_reward(texts: Sequence[str]) -> float:
    """Fraction of written equations whose left side evaluates to their right side."""
    verdicts = [v for text in texts for v in _equation_verdicts(text)]
    return sum(verdicts) / len(verdicts) if verdicts else 0.0


def step_is_correct(text: str) -> bool | None:
    """The process checker's verdict on one step (an assistant turn): whether every equation it writes is
    true; None when it writes none (nothing to check)."""
    verdicts = _equation_verdicts(text)
    return all(verdicts) if verdicts else None


class ArithmeticEnv(ToolEnv):
    """Arithmetic problems with a calculator tool (`math/arith-v0`), scored by outcome and optionally by process.

    `parser` is `hermes` or `react` (another raises ValueError); `extra_tools` join the calculator.
    """

    def __init__(self, split: str = "train", n_tasks: int | None = None, seed: int = 0, parser: str = "hermes",
                 max_turns: int = 6, max_invalid: int = 3, outcome_weight: float = 1.0,
                 process_weight: float = 0.0, kinds: Sequence[str] = ("expression", "word"), max_ops: int = 3,
                 extra_tools: Sequence = ()):
        if parser not in ("hermes", "react"):
            raise ValueError(f"parser must be 'hermes' or 'react' for the math env, got {parser!r}")
        self.n_tasks = n_tasks or (2000 if split == "train" else 200)
        self.task_seed, self.kinds, self.max_ops = seed, tuple(kinds), max_ops
        parser_obj = PARSERS[parser](default_args={"calculator": "expression"}) if parser == "react" \
            else PARSERS[parser]()
        super().__init__(ToolSet([calculator, *extra_tools]), parser_obj, split=split, max_turns=max_turns,
                         max_invalid=max_invalid,
                         reward_weights={"outcome": outcome_weight, "process": process_weight})

    def load_tasks(self, split: str) -> Sequence[Task]:
        """`n_tasks` distinct problems of `split` ("train" or "heldout") for the env's seed, kinds and `max_ops`."""
        return make_tasks(split, self.n_tasks, self.task_seed, self.kinds, self.max_ops)

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The system prompt (with an example answer in the parser's format) and the question."""
        prompt = SYSTEM_PROMPT.format(example=self.parser.format_answer("12"), fmt=self.parser.instructions)
        return (Message("system", prompt),
                Message("user", task.data["question"]))

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        outcome = outcome_reward(answer, task.data["answer"])
        process = process_reward([p.content for p in transcript])
        return Score({"outcome": outcome, "process": process}, detail=f"gold={task.data['answer']}")

    def check_step(self, text: str) -> bool | None:
        return step_is_correct(text)

    def difficulty(self, task: Task) -> dict[str, object]:
        return {"operators": task.data["difficulty"], "kind": task.data["kind"]}

    def gold_actions(self, task: Task) -> list[str]:
        solution, answer = task.data["solution"], task.data["answer"]
        call = self.parser.format_call(ToolCall("calculator", {"expression": solution}))
        return [call, f"{solution} = {answer}\n{self.parser.format_answer(answer)}"]

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        """The gold solution; with probability `error_rate`, a mental-arithmetic slip instead: no calculator,
        a wrong equation and a wrong answer (what RL should learn to avoid)."""
        if rng.random() >= error_rate:
            return self.gold_actions(task)
        wrong = str(int(task.data["answer"]) + rng.choice([-10, -2, -1, 1, 2, 10]))
        return [f"{task.data['solution']} = {wrong}\n{self.parser.format_answer(wrong)}"]
