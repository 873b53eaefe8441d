"""The arithmetic env's questions as other libraries' envs, for the adapters' registered ids (`envs/__init__.py`).

`ArithmeticSkyRLEnv`: SkyRL's env classes over the arithmetic questions as SkyRL rows (`skyrl/gsm8k-v0`).

Two verifiers environments written as a verifiers user writes them (this module's `load_environment`), so
that the adapter is tested on a `ToolEnv` and on a custom `MultiTurnEnv` without the network (hub envs are
installed from Prime's registry). Their datasets carry `info["gold"]`, the assistant turns that solve a row.

- `kind="arith_tools"`: a `vf.ToolEnv` with a calculator tool over the arithmetic env's questions; the
  rubric gives 1 when the final message's `<answer>` is the exact result.
- `kind="guess"`: a `vf.MultiTurnEnv` game: guess a number from 1 to 100, the env answers higher or lower
  (`env_response`) and stops on the right guess (a `@vf.stop` condition); reward 1 for finding it.
"""

from __future__ import annotations

import json
import random
import re

from agentrl.env.adapters.skyrl_env import SkyRLEnv
from agentrl.envs.math.arithmetic import evaluate, format_number
from agentrl.envs.math.env import ArithmeticEnv

SKYRL_INSTRUCTION = "Solve the problem. End your answer with '#### ' followed by the number."
SYSTEM = "Use the calculator tool for the computation, then give the result as <answer>N</answer>."


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / ** and parentheses, e.g. "3 * (4 + 5)".
    """
    return format_number(evaluate(expression))


def load_environment(kind: str = "arith_tools", n: int = 200, seed: int = 0):
    """The verifiers env `kind` ("arith_tools" or "guess") over `n` rows for training and `n` for evaluation."""
    import verifiers as vf
    from datasets import Dataset
    if kind == "arith_tools":
        rows = {split: [_arith_row(t) for t in _arith_tasks(split, n)] for split in ("train", "heldout")}
        rubric = vf.Rubric(funcs=[exact_answer])
        return vf.ToolEnv(dataset=Dataset.from_list(rows["train"]), eval_dataset=Dataset.from_list(rows["heldout"]),
                          system_prompt=SYSTEM, tools=[calculator], rubric=rubric, max_turns=4)
    if kind == "guess":
        rng = random.Random(seed)
        rows = {split: [_guess_row(rng.randint(1, 100)) for _ in range(n)] for split in ("train", "heldout")}
        return _guess_env_class()(dataset=Dataset.from_list(rows["train"]),
                                  eval_dataset=Dataset.from_list(rows["heldout"]), rubric=vf.Rubric(funcs=[found]),
                                  max_turns=8)
    raise ValueError(f"kind must be 'arith_tools' or 'guess', got {kind!r}")


def exact_answer(completion, answer) -> float:
    """1.0 when the last message's `<answer>` equals the dataset's answer."""
    m = re.search(r"<answer>\s*(.*?)\s*</answer>", completion[-1].get("content") or "")
    return float(bool(m) and m.group(1) == answer)


def found(state) -> float:
    """1.0 when the game ended on the right guess."""
    return float(state.get("found", False))


def _arith_tasks(split: str, n: int):
    return ArithmeticEnv(split=split, n_tasks=n).tasks


def _arith_row(task) -> dict:
    call = json.dumps({"name": "calculator", "arguments": {"expression": task.data["solution"]}})
    return {"question": task.data["question"], "answer": task.data["answer"],
            "info": {"gold": [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{task.data['answer']}</answer>"]}}


def _guess_row(secret: int) -> dict:
    low, high, gold = 1, 100, []
    while True:  # binary search: what the game's hints lead to
        guess = (low + high) // 2
        gold.append(str(guess))
        if guess == secret:
            break
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return {"question": "I picked a number from 1 to 100. Guess it: reply with just a number.",
            "answer": str(secret), "info": {"gold": gold}}


def _guess_env_class():
    import verifiers as vf

    class GuessEnv(vf.MultiTurnEnv):
        """Higher or lower until the right guess."""

        async def setup_state(self, state):
            state["found"] = False
            return state

        @vf.stop
        async def guessed(self, state) -> bool:
            return state["found"]

        async def env_response(self, messages, state, **kwargs):
            text = (messages[-1].get("content") or "").strip()
            if not text.lstrip("-").isdigit():
                return [{"role": "user", "content": "Reply with just a number."}]
            guess, secret = int(text), int(state["answer"])
            state["found"] = guess == secret
            if state["found"]:
                state["final_env_response"] = [{"role": "user", "content": "Correct!"}]
                return state["final_env_response"]
            return [{"role": "user", "content": "Higher." if guess < secret else "Lower."}]

    return GuessEnv



class ArithmeticSkyRLEnv(SkyRLEnv):
    """A SkyRL env class over the arithmetic env's questions (any `data=PATH` still replaces them)."""

    def default_rows(self, split: str) -> list[dict]:
        """The arithmetic env's first 200 `split` questions as SkyRL rows, their exact answers as ground truth."""
        return [{"prompt": [{"role": "user", "content": f"{t.data['question']}\n{SKYRL_INSTRUCTION}"}],
                 "env_class": self.env_class,
                 "reward_spec": {"method": "rule", "ground_truth": str(t.data["answer"])}, "extras": {"max_turns": 4}}
                for t in _arith_tasks(split, 200)]
