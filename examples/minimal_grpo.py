"""GRPO in one screen: env -> rollouts -> group advantages -> clipped loss -> optimizer step.

    python examples/minimal_grpo.py [--model DIR] [--steps N] [--env ID]

The library's own pieces in one visible loop, read top to bottom. `agentrl train` (trainers/methods/grpo.py) runs the
same four steps and adds what a real run needs around them: micro-batches, KL to a reference, dynamic
sampling, held-out evaluation, checkpoints and resume, vLLM engines with weight sync and parity checks, FSDP.
Here the policy samples in-process from the very model being trained, so a weight sync is a version number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import replace

import torch

import agentrl
from agentrl.models.tiny import build_tiny_model
from agentrl.policy.hf import HFPolicy
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.protocol import SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.trainers.advantages import grpo_advantages
from agentrl.trainers.batch import make_batch
from agentrl.trainers.losses import PolicyLossConfig, ppo_clip_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model dir or hub name (default: the tiny model, built on first use)")
    parser.add_argument("--env", default="math/arith-v0", help="any registered env id")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8, help="episodes per task, compared with each other")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    policy = HFPolicy.load(args.model or build_tiny_model("~/.cache/agentrl/models/tiny", quiet=True))
    model, renderer = policy.model, Renderer(policy.tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tasks = list(agentrl.make(args.env).tasks)  # the training split
    rollout = RolloutConfig(group_size=args.group_size, max_total_tokens=512,
                            sampling=SamplingParams(max_tokens=48, temperature=1.0))
    order = random.Random(args.seed)

    for step in range(args.steps):
        # 1. Rollouts: G episodes of each task (same env seed, different sampling seeds). Each trajectory keeps
        #    the sampled token ids verbatim, their logprobs, and a loss mask that is 1 exactly on them.
        with RolloutEngine(lambda: agentrl.make(args.env), policy, renderer, replace(rollout, seed=step)) as engine:
            groups = asyncio.run(engine.run(order.sample(tasks, args.tasks_per_step)))

        # 2. Group advantages: each episode's reward against the other episodes of its task. Episodes that ended
        #    in `error` (a crashed tool, a timeout) are data, not zero rewards: they stay out of the baseline.
        trajectories, advantages, beat_B = [], [], []
        for group in groups:
            if len(group.valid) >= 2:
                rewards_G = torch.tensor([t.reward for t in group.valid])
                trajectories += group.valid
                advantages += grpo_advantages(rewards_G).tolist()
                beat_B += (rewards_G - rewards_G.mean()).tolist()  # how much each beat its group, for step 5
        if not trajectories:
            print(json.dumps({"step": step + 1, "skipped": "no group with two valid episodes"}))
            continue
        batch = make_batch(trajectories, advantages)  # right-padded [B, T] tensors; advantages on sampled tokens
        assert batch.mask_BT.sum() == sum(t.num_sampled for t in trajectories)  # trained tokens = sampled tokens

        # 3. Loss: PPO's clipped surrogate on the sampled tokens, the trainer's logprobs against the sampler's.
        model.train()
        logp_BT, _ = token_logprobs(model, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
        loss, metrics = ppo_clip_loss(logp_BT, batch.old_logp_BT, batch.adv_BT, batch.mask_BT, PolicyLossConfig())

        # 4. Step, then hand the new weights to the sampler (in-process: the same model, a new version).
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.eval()
        asyncio.run(policy.sync_weights(model, version=step + 1))

        # 5. Did the step move towards the better episodes? Each episode's change in logprob, weighted by how much its
        #    reward beat its group's mean (the rewards, not the advantages: this also checks their sign). > 0 when the
        #    episodes that did better became more likely.
        with torch.no_grad():
            new_logp_BT, _ = token_logprobs(model, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
        dlogp_B = ((new_logp_BT - logp_BT.detach()) * batch.mask_BT).sum(-1)
        toward_better = (torch.tensor(beat_B) * dlogp_B).sum().item()

        rewards = [t.reward for g in groups for t in g.valid]
        print(json.dumps({"step": step + 1, "episodes": sum(len(g.trajectories) for g in groups),
                          "trained": len(trajectories), "reward": round(sum(rewards) / max(len(rewards), 1), 4),
                          "loss": round(loss.item(), 6), "grad_norm": round(grad_norm.item(), 6),
                          "clip_frac": round(metrics["clip_frac"], 4), "toward_better": float(f"{toward_better:.4g}"),
                          "sampled_tokens": int(batch.mask_BT.sum())}))
    asyncio.run(policy.close())


if __name__ == "__main__":
    main()
