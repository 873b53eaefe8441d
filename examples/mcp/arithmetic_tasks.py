"""`math/arith-v0`'s problems as an `mcp/tools-v0` task file, solved with `calculator_server.py`'s `calculator`.

    python examples/mcp/arithmetic_tasks.py OUT.jsonl [--train 2000] [--heldout 200] [--kinds expression word]
                                                      [--max-ops 3]

The same problems, seeds and gold solutions as the math env's, so that training through the MCP server can be set
beside training with the env's in-process tool (recipes/cpu_mcp_calculator_train.toml).
"""

import argparse
import json
from pathlib import Path

from agentrl.envs.math.tasks import make_tasks


def records(split: str, n: int, kinds: list[str], max_ops: int, seed: int = 0):
    for task in make_tasks(split, n, seed, tuple(kinds), max_ops):
        d = task.data
        yield {"id": task.id, "split": split, "question": d["question"], "answer": d["answer"],
               "solution": [{"name": "calculator", "arguments": {"expression": d["solution"]}}],
               "reasoning": f"{d['solution']} = {d['answer']}",
               # the math env's imperfect expert: a mental-arithmetic slip, no calculator (its offsets, its order)
               "mistakes": [{"reasoning": f"{d['solution']} = {wrong}", "answer": str(wrong)}
                            for wrong in (int(d["answer"]) + slip for slip in (-10, -2, -1, 1, 2, 10))],
               "difficulty": {"operators": d["difficulty"], "kind": d["kind"]}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--kinds", nargs="+", default=["expression", "word"])
    parser.add_argument("--max-ops", type=int, default=3)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    splits = (("train", args.train), ("heldout", args.heldout))
    lines = [json.dumps(r) for split, n in splits for r in records(split, n, args.kinds, args.max_ops)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} tasks -> {args.out}")
