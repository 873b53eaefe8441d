"""Asynchronous training (#31): the buffer's staleness bound, the version gate, a trajectory sampled across a
weight update, and a run killed at random points that trains every group exactly once."""

import asyncio
import copy
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.cli.jobs import RolloutJob
from agentrl.config import ConfigError, load_config
from agentrl.env.api import TextEnv
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.protocol import Sample, SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.buffer import GroupBuffer, RolloutSourceError
from agentrl.rollout.engine import EnvEngines, RolloutConfig, RolloutEngine
from agentrl.rollout.source import RolloutSource, VersionGate
from agentrl.rollout.timeline import Busy, idle_fractions
from agentrl.trainers.batch import make_batch
from agentrl.trainers.checkpoint import latest_checkpoint
from agentrl.trainers.losses import tis_weights
from agentrl.trainers.job.recipe import TrainJob
from agentrl.types import Group, Message, Status, Task, Trajectory, Turn


def test_settings_asynchronous_training_cannot_run_with_fail_at_start_up():
    base = {"env": "math/arith-v0", "model": "m", "grpo": {"max_staleness": 1}}
    with pytest.raises(ConfigError, match=r"\[tango\] runs synchronously"):
        load_config(TrainJob, {**base, "tango": {}})
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        load_config(TrainJob, {**base, "grpo": {"max_staleness": -1}})
    assert load_config(TrainJob, base).grpo.max_staleness == 1
    # rollout sources in Ray actors: asynchronous, over HTTP, an equal share of each step's tasks each
    vllm = {**base, "engine": {"kind": "vllm"}}
    with pytest.raises(ConfigError, match="reach the engine over HTTP: set engine.kind = 'vllm'"):
        load_config(TrainJob, {**base, "ray": {"sources": 2}})
    with pytest.raises(ConfigError, match=r"ray.sources = 3 must divide grpo.tasks_per_step \(8\)"):
        load_config(TrainJob, {**vllm, "ray": {"sources": 3}})
    with pytest.raises(ConfigError, match=r"set grpo.max_staleness \(e.g. 1\)"):
        load_config(TrainJob, {**vllm, "grpo": {}, "ray": {"sources": 2}})
    assert load_config(TrainJob, {**vllm, "ray": {"sources": 2}}).ray.sources == 2
    with pytest.raises(ConfigError, match="agentrl rollout plays its episodes from this process: remove it"):
        load_config(RolloutJob, {"env": "math/arith-v0", "model": "m", "ray": {"sources": 1}})


def group(position: int, versions: tuple[int, ...], rewards: tuple[float, ...] = (0.0, 1.0)) -> Group:
    """A finished group of task `position` whose trajectories' oldest tokens are of `versions`."""
    def trajectory(version: int, reward: float) -> Trajectory:
        return Trajectory(task_id=f"t{position}", token_ids=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -1.0),
                          prompt_len=1, turns=(Turn(1, 2, 2, reward, weight_version=version),), reward=reward,
                          group=position, weight_version=version)
    return Group(Task(f"t{position}"), tuple(trajectory(v, r) for v, r in zip(versions, rewards)))


def positions(groups: list[Group]) -> list[int]:
    return [g.trajectories[0].group for g in groups]


varies = lambda g: len({t.reward for t in g.valid}) > 1  # noqa: E731 -- dynamic sampling's keep rule


def test_take_gives_the_oldest_groups_and_drops_those_beyond_the_staleness_bound():
    buffer = GroupBuffer(varies, max_staleness=1)
    for p, v in [(0, 3), (1, 1), (2, 2), (3, 2)]:
        buffer.put(group(p, (v, v)))
    buffer.put(group(4, (2, 2), rewards=(1.0, 1.0)))  # refused: no learning signal
    taken = buffer.take(2, version=3)
    assert positions(taken.kept) == [2, 3]  # version 2 before 3; version 1 is 2 behind version 3: dropped
    assert positions(taken.stale) == [1]
    assert sorted(taken.done) == [1, 2, 3, 4] and positions(taken.collected) == [2, 3, 4, 1]
    assert buffer.ready() == 1 and buffer.taken == 2 and buffer.discarded == [2]  # one refused, one stale
    # a group is as old as its oldest token: one trajectory started under version 1 makes it stale at 3
    buffer.put(group(5, (1, 3)))
    taken = buffer.take(1, version=3)
    assert positions(taken.kept) == [0] and positions(taken.stale) == [5]


def test_take_waits_for_enough_groups_and_gives_up_like_a_synchronous_step():
    buffer = GroupBuffer(varies, max_staleness=0)
    threading.Timer(0.2, lambda: buffer.put(group(0, (0, 0)))).start()
    started = time.perf_counter()
    assert positions(buffer.take(1, version=0).kept) == [0]
    assert time.perf_counter() - started >= 0.15  # it waited for the group
    buffer.put(group(1, (0, 0)))
    buffer.put(group(2, (0, 0), rewards=(0.0, 0.0)))
    taken = buffer.take(2, version=0, give_up_after=2)  # 2 came in, 1 kept: as far as a step without refills goes
    assert positions(taken.kept) == [1] and sorted(taken.done) == [1, 2]
    # stale groups do not count towards giving up: the source plays others in their place
    buffer.put(group(3, (0, 0)))
    buffer.put(group(4, (1, 1)))
    threading.Timer(0.2, lambda: buffer.put(group(5, (1, 1)))).start()
    taken = buffer.take(2, version=1, give_up_after=2)
    assert positions(taken.kept) == [4, 5] and positions(taken.stale) == [3]


def test_a_failed_source_fails_the_trainers_take_with_its_cause():
    buffer = GroupBuffer(varies, max_staleness=1)
    threading.Timer(0.1, lambda: buffer.fail(OSError("env pool gone"))).start()
    with pytest.raises(RolloutSourceError, match="env pool gone") as raised:
        buffer.take(1, version=0)
    assert isinstance(raised.value.__cause__, OSError)


def test_a_source_that_fails_names_its_cause_at_the_next_take_and_sync():
    def task_at(position):
        raise IndexError(f"no task at {position}")

    buffer = GroupBuffer(varies, max_staleness=1)
    source = RolloutSource(EnvEngines(lambda: None), SlowPolicy(0.0), None, RolloutConfig(), task_at, buffer,
                           tasks_per_step=1, seed=0)
    source.start()
    try:
        with pytest.raises(RolloutSourceError, match="no task at 0"):
            buffer.take(1, version=0)
        with pytest.raises(RolloutSourceError, match="no task at 0"):
            source.sync(None, 1)
    finally:
        source.close()


class SlowPolicy:
    """Each generate takes `seconds`; sync_weights records when it ran."""

    def __init__(self, seconds: float):
        self.seconds, self.weight_version, self.events = seconds, 0, []

    async def generate(self, prompt_ids, sampling):
        self.events.append(("start", self.weight_version))
        await asyncio.sleep(self.seconds)
        self.events.append(("end", self.weight_version))
        return [Sample((5,), (-0.5,), "stop")]

    async def sync_weights(self, model, version):
        self.events.append(("sync", version))
        await asyncio.sleep(0.01)
        self.weight_version = version

    async def close(self):
        pass


def test_version_gate_syncs_between_generate_calls_and_stamps_each_sample():
    inner = SlowPolicy(0.05)
    gate = VersionGate(inner)

    async def scenario():
        first = asyncio.create_task(gate.generate([1], SamplingParams()))
        await asyncio.sleep(0.01)  # the first request is in flight
        sync = asyncio.create_task(gate.sync_weights(None, 1))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(gate.generate([1], SamplingParams()))  # arrives during the sync: waits
        return await first, await second, await sync

    first, second, _ = asyncio.run(scenario())
    # the sync waited for the request in flight; the one that came meanwhile ran on the new weights
    assert inner.events == [("start", 0), ("end", 0), ("sync", 1), ("start", 1), ("end", 1)]
    assert first[0].weight_version == 0 and second[0].weight_version == 1


def test_busy_counts_overlapping_uses_as_one_stretch_and_idle_fractions_add_up():
    busy = Busy(time.perf_counter())
    with busy:
        with busy:
            time.sleep(0.02)
        time.sleep(0.02)
    spans = busy.cut()
    assert len(spans) == 1 and spans[0][1] - spans[0][0] >= 0.035
    assert idle_fractions({"engine": [[1.0, 2.0], [3.0, 3.5]]}, 0.0, 4.0) == {"engine": 0.625}
    assert idle_fractions({"env": [[-1.0, 1.0]]}, 0.0, 2.0) == {"env": 0.5}  # clipped to the window


class TwoTurns(TextEnv):
    """Two assistant turns; the first step calls `between()` before it answers (the test syncs weights there)."""

    def __init__(self, between):
        super().__init__(max_turns=2)
        self.between = between

    def load_tasks(self, split):
        return [Task("count", {"question": "Count to three."})]

    def first_messages(self, task):
        return [Message("user", task.data["question"])]

    def act(self, action):
        if self.turn == 1:
            self.between()
            return [Message("user", "Go on.")], 0.0, False, {}
        return [], 1.0, True, {}

    def gold_actions(self, task):
        return ["1 2", "3"]


def test_a_trajectory_sampled_across_a_weight_update_carries_both_versions(tiny_model_dir):
    """Turn 1 is sampled by version 0, turn 2 (after a sync mid-episode) by version 1: each turn's logprobs are its
    own version's, the batch trains on exactly those, and the importance weight against the new policy is 1 on the
    new turn only."""
    tokenizer = load_tokenizer(tiny_model_dir)
    v0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    v1 = copy.deepcopy(v0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    gate, first_turn_done, synced = VersionGate(HFPolicy(copy.deepcopy(v0), tokenizer)), threading.Event(), \
        threading.Event()

    def between():
        first_turn_done.set()
        assert synced.wait(60)

    # the tiny model's weights are random: half its vocabulary ends a turn, so that turns end before max_tokens
    sampling = SamplingParams(max_tokens=12, stop_token_ids=tuple(range(0, len(tokenizer), 2)))
    engine = RolloutEngine(lambda: TwoTurns(between), gate, Renderer(tokenizer),
                           RolloutConfig(max_turns=2, max_total_tokens=512, sampling=sampling))

    async def play():
        episode = asyncio.create_task(engine.run_episode(Task("count", {"question": "Count to three."}), 1, 2))
        while not first_turn_done.is_set():
            assert not episode.done(), episode.result()
            await asyncio.sleep(0.01)
        await gate.sync_weights(v1, 1)  # while the episode's env takes its first step
        synced.set()
        return await episode

    traj = asyncio.run(play())
    engine.close()
    assert traj.status == Status.OK and [t.weight_version for t in traj.turns] == [0, 1]
    assert traj.weight_version == 0  # the oldest token's

    batch = make_batch([traj], [1.0])
    assert torch.equal(batch.old_logp_BT[0], torch.tensor(traj.logprobs))  # the behaviour logprobs, verbatim
    logp = {name: token_logprobs(m, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)[0][0]
            for name, m in (("v0", v0), ("v1", v1))}
    sampled = torch.tensor(traj.logprobs)
    for turn, own, other in ((traj.turns[0], "v0", "v1"), (traj.turns[1], "v1", "v0")):
        span = slice(turn.start, turn.end)
        assert (logp[own][span] - sampled[span]).abs().max() < 1e-4
        assert (logp[other][span] - sampled[span]).abs().max() > 1e-2  # the versions differ here
    weights, _ = tis_weights(logp["v1"][None], batch.old_logp_BT, batch.mask_BT, cap=100.0, level="token")
    first, second = traj.turns
    assert (weights[0, second.start:second.end] - 1).abs().max() < 1e-3
    assert (weights[0, first.start:first.end] - 1).abs().max() > 1e-2


@pytest.mark.parametrize("restart", [False, True])
def test_at_a_sync_the_source_continues_episodes_in_flight_or_restarts_them(tiny_model_dir, restart):
    """The source plays two-turn episodes; the trainer syncs while their envs take the first step. Partial rollouts
    continue them with the new weights (turn versions 0, 1); with `restart` they are aborted and played again from
    the start (1, 1)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    first_turn_done, synced = threading.Event(), threading.Event()

    def between():
        first_turn_done.set()
        assert synced.wait(60)

    sampling = SamplingParams(max_tokens=12, stop_token_ids=tuple(range(0, len(tokenizer), 2)))  # as above
    buffer = GroupBuffer(lambda g: True, max_staleness=1)
    env = lambda: TwoTurns(between)  # noqa: E731
    source = RolloutSource(EnvEngines(env), HFPolicy(copy.deepcopy(model), tokenizer), Renderer(tokenizer),
                           RolloutConfig(max_turns=2, max_total_tokens=512, sampling=sampling),
                           lambda p: env().tasks[0], buffer, tasks_per_step=1, seed=0, restart=restart)
    source.start()
    try:
        assert first_turn_done.wait(60)
        source.sync(model, 1)
        synced.set()
        # positions 0 and 1 were in flight (one step ahead); the sync let position 2 start
        groups = {g.trajectories[0].group: g.trajectories[0] for g in buffer.take(3, version=1).kept}
    finally:
        source.close()
    assert sorted(groups) == [0, 1, 2] and all(t.status == Status.OK for t in groups.values())
    for position in (0, 1):
        assert [t.weight_version for t in groups[position].turns] == ([1, 1] if restart else [0, 1])
    assert [t.weight_version for t in groups[2].turns] == [1, 1]
    assert source.restarted == (2 if restart else 0)


TRAIN = textwrap.dedent("""
    import copy, sys
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    from agentrl.envs.math import ArithmeticEnv
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.hf import HFPolicy
    from agentrl.policy.protocol import SamplingParams
    from agentrl.rollout.engine import RolloutConfig
    from agentrl.rollout.ray_pool import init_ray
    from agentrl.trainers.methods.grpo import GRPOConfig, train

    class FrozenCopies(HFPolicy):
        # Ray sources sample from their own copies of the weights, which syncs only renumber: what is checked here is
        # the bookkeeping of task positions across kills, which needs no learning (and no vLLM server).
        def sampling_copy(self):
            copy_ = FrozenCopies(copy.deepcopy(self.model), self.tokenizer)
            copy_.weight_version = self.weight_version
            return copy_

        async def sync_weights(self, model, version):
            self.weight_version = version

    model_dir, out, sources = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = GRPOConfig(steps=10, tasks_per_step=2, lr=1e-3, minibatch_size=4, checkpoint_every=1, max_staleness=1,
                     group_size=2, rollout=RolloutConfig(max_total_tokens=1024, sampling=SamplingParams(max_tokens=12)))
    env = lambda: ArithmeticEnv(n_tasks=5)
    if sources:
        init_ray(sys.argv[4])  # the test's cluster: a killed run's actors die with it, as on a real cluster
    policy = (FrozenCopies if sources else HFPolicy)(copy.deepcopy(model), tokenizer)
    train(cfg, model, tokenizer, policy, env, list(env().tasks), out, sources=sources)
""")


@pytest.mark.slow
@pytest.mark.parametrize("sources", [0, 2], ids=["source-in-a-thread", "two-ray-source-actors"])
def test_killed_at_random_points_the_run_trains_every_group_exactly_once(tiny_model_dir, tmp_path, sources,
                                                                         ray_cluster):
    """SIGKILL twice, each at a random moment after a random checkpoint, then run to the end: across the steps in
    metrics.jsonl (the lines after the last checkpoint are redone), every task position is trained or dropped exactly
    once, and the positions done are exactly those below the final data position and the ones the checkpoint lists
    above. The kills follow checkpoints, not the clock: a step takes 0.4 s on an idle machine, seconds on a busy one.
    With Ray source actors (`[ray] sources`), on a local cluster of this process that outlives the killed runs."""
    script, out, log, rng = tmp_path / "train.py", tmp_path / "run", tmp_path / "stderr.log", random.Random(0)
    script.write_text(TRAIN)
    command = [sys.executable, str(script), str(tiny_model_dir), str(out), str(sources)]
    if sources:
        command.append(ray_cluster)

    def step() -> int:  # of the latest checkpoint; 0 before the first
        checkpoint = latest_checkpoint(out) if out.exists() else None
        return int(checkpoint.name.split("-")[1]) if checkpoint else 0

    for _ in range(2):
        target = step() + rng.randint(1, 3)  # kill after this checkpoint, at a random moment of the next step
        with log.open("a") as stderr:  # a file, not a pipe: a full pipe would block the run
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 240
        while process.poll() is None and step() < target:
            assert time.monotonic() < deadline, f"no checkpoint {target} in 240 s: " + log.read_text()[-3000:]
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        assert process.poll() is None, "the run ended before the kill: " + log.read_text()[-3000:]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert 0 < step() < 10
    finished = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert finished.returncode == 0, finished.stderr[-3000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["groups_trained"] == 2 and set(r["staleness"]) <= {"0", "1"} for r in rows), \
        [(r["groups_trained"], r["staleness"], r["positions"]) for r in rows]
    done = [p for r in rows for key in ("trained", "dropped") for p in r["positions"][key]]
    assert len(done) == len(set(done)), [r["positions"] for r in rows]  # nothing trained (or dropped) twice
    state = torch.load(latest_checkpoint(out) / "trainer_state.pt", weights_only=False)["state"]
    assert sorted(done) == list(range(state["data_position"])) + state["done_positions"], state  # nothing lost
