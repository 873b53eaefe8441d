"""A trajectory viewer: one self-contained HTML page of episodes, turn by turn and token by token.

Each episode shows its messages (system / user / assistant with tool calls / tool observations) grouped
by turn with the turn's reward, the reward components, status and reason, and its token sequence coloured
by loss mask: prompt, sampled by the policy (trained on), written by the environment (not trained on).
With a tokenizer the tokens are shown as text (each id decoded on its own), else as ids.

The page filters episodes by entry, status and success with a few lines of inline JS and loads nothing
from the network. Everything shown is untrusted model output: the template autoescapes it, token strings
travel as JSON (`tojson` escapes `<`, `>`, `&`) and are put into the page with `textContent`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentrl.eval.report import render
from agentrl.rollout.jsonl import read_jsonl
from agentrl.types import Message, Trajectory, Turn


def write_viewer(run_dir: str | Path, tokenizer: Any = None, out: str | Path | None = None,
                 limit: int | None = None) -> Path:
    """Writes the viewer of an eval run directory (its trajectories.jsonl; default out RUN_DIR/viewer.html)
    or of any JSONL file of trajectories, e.g. a training run's (default out: beside it, `.html`).

    `tokenizer`: a tokenizer object, or a model directory / hub name to load one from; None shows token
    ids. `limit`: only the first `limit` episodes of the file (in file order)."""
    source = Path(run_dir)
    if source.is_dir():
        path, default_out = source / "trajectories.jsonl", source / "viewer.html"
        run = json.loads((source / "run.json").read_text()) if (source / "run.json").exists() else None
    else:
        path, default_out, run = source, source.with_suffix(".html"), None
    if not path.exists():
        raise FileNotFoundError(f"no trajectories at {path}: pass an eval run directory or a .jsonl of trajectories")
    if isinstance(tokenizer, (str, Path)):
        from agentrl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    trajectories = read_jsonl(path)[:limit]
    trajectories.sort(key=lambda t: (str(t.logs.get("entry", "")), t.task_id, t.logs.get("sample", t.group)))
    out = Path(out) if out is not None else default_out
    decode = tokenizer.decode if tokenizer is not None else None
    episodes = [episode_view(i, t, decode) for i, t in enumerate(trajectories)]
    tokens = {"vocab": _vocab(tokenizer, trajectories),
              "episodes": [{"ids": t.token_ids, "mask": t.loss_mask, "prompt_len": t.prompt_len,
                            "logprobs": [round(lp, 3) for lp in t.logprobs]} for t in trajectories]}
    report = out.parent / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(
        "viewer.html.jinja", title=str(run["suite"]) if run else path.name, run=run, source=str(path),
        episodes=episodes, tokens=tokens, total=len(episodes),
        entries=sorted({e["entry"] for e in episodes}), statuses=sorted({e["status"] for e in episodes}),
        report=os.path.relpath(report, out.parent) if source.is_dir() and report.exists() else None,
        token_text=tokenizer is not None))
    return out


def episode_view(index: int, t: Trajectory, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    """What the template shows of one episode (plain data; the template escapes all of it)."""
    logs, success = t.logs, t.metrics.get("success")
    return {
        "index": index, "task_id": t.task_id, "entry": str(logs.get("entry", "")),
        "sample": logs.get("sample", t.group), "status": t.status.value, "reason": t.reason,
        "success": "unknown" if success is None else "yes" if success else "no",
        "reward": t.reward, "components": t.reward_components, "answer": t.answer,
        "tool_calls": t.metrics.get("tool_calls", sum(len(m.tool_calls) for m in t.messages)),
        "seconds": t.metrics.get("seconds"), "difficulty": logs.get("difficulty") or {},
        "turns": len(t.turns), "tokens": len(t.token_ids), "sampled": t.num_sampled, "weight_version": t.weight_version,
        "blocks": turn_blocks(t, decode),
        "screenshots": {turn: path for turn, path in logs.get("screenshots", [])},  # web envs: the page after a turn
    }


def turn_blocks(t: Trajectory, decode: Callable[[list[int]], str] | None = None) -> list[dict[str, Any]]:
    """The conversation split by turn: the prompt (messages before the first assistant message), then one
    block per assistant message with the observations that answered it, and that turn's `Turn` record.

    A turn with no message (cut off mid-turn: the rollout records no message for it) gets a block of its
    own holding its sampled text, decoded when `decode` is given."""
    blocks: list[dict[str, Any]] = [{"turn": None, "index": None, "messages": [], "unparsed": None}]
    for m in t.messages:
        if m.role == "assistant":
            j = len(blocks) - 1
            blocks.append({"index": j, "messages": [], "unparsed": None,
                           "turn": _turn_view(t.turns[j]) if j < len(t.turns) else None})
        blocks[-1]["messages"].append(_message_view(m))
    for j in range(len(blocks) - 1, len(t.turns)):
        ids = list(t.token_ids[t.turns[j].start:t.turns[j].end])
        blocks.append({"index": j, "messages": [], "turn": _turn_view(t.turns[j]),
                       "unparsed": decode(ids) if decode else " ".join(map(str, ids))})
    return blocks


def _turn_view(turn: Turn) -> dict[str, Any]:
    return {"reward": turn.reward, "finish_reason": turn.finish_reason, "sampled": turn.end - turn.start,
            "observation": turn.obs_end - turn.end}


def _message_view(m: Message) -> dict[str, Any]:
    return {"role": m.role, "content": m.content, "name": m.name,
            "tool_calls": [{"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False, indent=1)}
                           for c in m.tool_calls]}


def _vocab(tokenizer: Any, trajectories: Sequence[Trajectory]) -> dict[int, str] | None:
    """Each id used, decoded on its own (readable text; a character split over tokens shows as �)."""
    if tokenizer is None:
        return None
    ids = sorted({i for t in trajectories for i in t.token_ids})
    return {i: tokenizer.decode([i]) for i in ids}
