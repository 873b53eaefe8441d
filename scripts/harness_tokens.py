"""What a harness does to tokens: agent programs run through the gateway, a model behind it, and per harness how
many calls and segments an episode takes, how often a call does not continue its history append-only (a new segment:
a sub-agent, an edited or compacted history), and what share of the sampled tokens ends up trained.

    python scripts/harness_tokens.py --episodes 4   # SmolLM2-135M-Instruct (`agentrl model fetch`)

Prints a Markdown table (docs/concepts/gateway.md keeps the measured one) and, as its last line, the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from agentrl.env.registry import make
from agentrl.gateway.agents import AgentConfig, AgentEngine, load_program
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig
from agentrl.types import Status

HARNESSES = {  # name: (program, env id, env kwargs, tool parser)
    "openai SDK": ("examples.agents.calculator_openai:solve", "math/arith-v0",
                   {"parser": "react", "kinds": ["expression"], "max_ops": 2}, "react"),
    "OpenAI Agents SDK": ("examples.agents.calculator_agents_sdk:solve", "math/arith-v0",
                          {"parser": "react", "kinds": ["expression"], "max_ops": 2}, "react"),
    "mini-swe-agent": ("examples.agents.swe_mini:solve", "swe/generated-v0", {}, "hermes"),
    "Codex CLI": ("examples.agents.swe_codex:solve", "swe/generated-v0", {}, "hermes"),  # --max-total-tokens 8192
    "Claude Code": ("examples.agents.swe_claude:solve", "swe/generated-v0", {}, "hermes"),
}


class Counting:
    """The policy, counting the tokens it samples."""

    def __init__(self, policy):
        self.policy, self.sampled = policy, 0
        self.weight_version = policy.weight_version

    async def generate(self, prompt_ids, sampling):
        samples = await self.policy.generate(prompt_ids, sampling)
        self.sampled += sum(len(s.token_ids) for s in samples)
        return samples


def measure(name: str, model: str, chat_template: str | None, episodes: int, max_total_tokens: int,
            max_tokens: int) -> dict:
    program, env_id, kwargs, parser = HARNESSES[name]
    tokenizer = load_tokenizer(model, chat_template)
    policy = Counting(HFPolicy.load(model))
    rollout = RolloutConfig(group_size=1, concurrency=2, max_total_tokens=max_total_tokens,  # 2 cores
                            sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0))
    engine = AgentEngine(load_program(program), policy, Renderer(tokenizer), rollout,
                         AgentConfig(program, tool_parser=parser, timeout=600))
    tasks = list(make(env_id, **kwargs).tasks)[:episodes]
    trajectories = [t for g in asyncio.run(engine.run(tasks)) for t in g.trajectories]
    sessions = {t.session: t for t in trajectories}
    calls = sum(t.info.get("calls", 0) for t in sessions.values())
    segments = sum(t.info.get("segments", 1) for t in sessions.values())
    trained = sum(t.num_sampled for t in trajectories if t.status is not Status.ERROR)
    return {"harness": name, "episodes": len(sessions), "calls_per_episode": calls / len(sessions),
            "segments_per_episode": segments / len(sessions),
            "not_append_only": (segments - len(sessions)) / max(calls - len(sessions), 1),
            "trained_share": trained / max(policy.sampled, 1),
            "errors": sum(t.status is Status.ERROR for t in sessions.values()),
            "error_reasons": sorted({t.reason[:200] for t in sessions.values() if t.status is Status.ERROR})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="~/.cache/agentrl/models/smollm2-135m-instruct")
    parser.add_argument("--chat-template", default="chatml-tools", help="SmolLM2's own shows no tools")
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--harness", action="append", choices=sorted(HARNESSES), help="default: all")
    args = parser.parse_args()
    rows = [measure(name, str(Path(args.model).expanduser()), args.chat_template, args.episodes, args.max_total_tokens,
                    args.max_tokens) for name in args.harness or HARNESSES]
    print("| harness | episodes | calls / episode | segments / episode | calls not append-only | sampled tokens "
          "trained | errors |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['harness']} | {r['episodes']} | {r['calls_per_episode']:.1f} | {r['segments_per_episode']:.2f} | "
              f"{r['not_append_only']:.0%} | {r['trained_share']:.0%} | {r['errors']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
