"""Deterministic arithmetic tasks: expression problems and word problems with exact integer answers.

Each task carries its gold solution as an expression. The split of a problem is decided by a stable
hash of its question text, so train and held-out never share a question, whatever the counts asked for.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache

from agentrl.envs.math.arithmetic import evaluate, format_number
from agentrl.types import Task

HELDOUT_FRACTION = 0.2
NAMES = ["Ada", "Ben", "Chloe", "Dev", "Eva", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kemi", "Lena"]
ITEMS = ["apple", "book", "coin", "marble", "pencil", "stamp", "sticker", "ticket", "shell", "card"]


def _expression(rng: random.Random, n_ops: int) -> str:
    """A random expression with `n_ops` operators over 1..20, parenthesized where it matters."""
    expr = str(rng.randint(1, 20))
    for _ in range(n_ops):
        op, operand = rng.choice("+-*"), str(rng.randint(1, 20))
        if op == "*" and any(c in expr for c in "+-") and rng.random() < 0.5:
            expr = f"({expr})"
        if op == "-" or rng.random() < 0.7:
            expr = f"{expr} {op} {operand}"
        else:
            expr = f"{operand} {op} {expr}"
    return expr


def _word_problem(rng: random.Random) -> tuple[str, str]:
    """(question, solution expression)."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"{name} has {a} {item}s and buys {b} packs with {c} {item}s in each. "
                f"How many {item}s does {name} have now?", f"{a} + {b} * {c}")
    if kind == 1:
        total = a + b * c
        return (f"{name} had {total} {item}s and gave {b} {item}s to each of {c} friends. "
                f"How many {item}s are left?", f"{total} - {b} * {c}")
    if kind == 2:
        paid = (b * c // 10 + 1) * 10 + 10
        return (f"A {item} costs {c} dollars. {name} buys {b} of them and pays with {paid} dollars. "
                f"How much change does {name} get?", f"{paid} - {b} * {c}")
    return (f"{name} and {friend} share {b * c} {item}s equally among {b} people. "
            f"How many {item}s does each person get?", f"{b * c} / {b}")


def _split_of(question: str) -> str:
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return "heldout" if h % 1000 < HELDOUT_FRACTION * 1000 else "train"


@lru_cache(maxsize=8)
def make_tasks(split: str, n: int, seed: int = 0, kinds: tuple[str, ...] = ("expression", "word"),
               max_ops: int = 3) -> tuple[Task, ...]:
    """The first `n` distinct problems of `split` ("train" or "heldout") for this seed: expression
    problems with 1..`max_ops` operators and/or two-step word problems."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not kinds or set(kinds) - {"expression", "word"}:
        raise ValueError(f"kinds must be a non-empty subset of ('expression', 'word'), got {kinds!r}")
    rng, seen, tasks = random.Random(seed), set(), []
    for _ in range(200 * n):  # enough draws for any n the space allows; a small space is an error
        if len(tasks) == n:
            return tuple(tasks)
        if kinds == ("word",) or ("word" in kinds and rng.random() < 0.5):
            (question, solution), kind, n_ops = _word_problem(rng), "word", 2
        else:
            n_ops = rng.randint(1, max_ops)
            solution = _expression(rng, n_ops)
            question, kind = f"Compute {solution}.", "expression"
        if question in seen or _split_of(question) != split:
            continue
        seen.add(question)
        answer = format_number(evaluate(solution))
        tasks.append(Task(id=f"math-{split}-{len(tasks):05d}", split=split, data={
            "question": question, "answer": answer, "solution": solution, "kind": kind, "difficulty": n_ops}))
    if len(tasks) < n:
        raise ValueError(f"Only {len(tasks)} distinct {split} problems exist for kinds={kinds}, max_ops={max_ops}; "
                         f"ask for fewer tasks or allow more kinds / operators.")
    return tuple(tasks)
