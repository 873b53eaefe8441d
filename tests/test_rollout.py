"""The rollout engine with scripted policies: exact tokens, masks, statuses, failures as data."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from agentrl.envs.math import ArithmeticEnv
from agentrl.policy import scripted
from agentrl.policy.protocol import PolicyError, Sample, SamplingParams
from agentrl.renderer import Renderer, RendererError
from agentrl.rollout import seeds
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.rollout.jsonl import read_jsonl, write_jsonl
from agentrl.eval.metrics import summarize
from agentrl.tools import tool
from agentrl.types import Status, StopReason, ToolCall


@tool(timeout=5.0)
def explode(reason: str) -> str:
    """A tool whose backend is broken.

    Args:
        reason: Anything.
    """
    raise ConnectionError(f"backend unreachable ({reason})")


@tool(timeout=0.3)
def hang(reason: str) -> str:
    """A tool whose backend never answers.

    Args:
        reason: Anything.
    """
    time.sleep(30)
    return "never"


@tool(timeout=30.0)
def flood(reason: str) -> str:
    """A tool that returns 21 MB of text.

    Args:
        reason: Anything.
    """
    return "flood " * 3_500_000


class ScriptedPolicy(scripted.ScriptedPolicy):
    """The library's scripted policy on gold scripts, recording (prompt ids, sampled ids) of each call, with
    logprobs -0.5 (so that a test tells sampled positions from the rest) and, with `finish_reason="length"`, a
    turn that fills max_tokens reported as cut."""

    def __init__(self, renderer: Renderer, scripts: dict[str, list[str]], finish_reason: str = "stop"):
        super().__init__(renderer, scripted.playing(scripts), renderer.generation_prompt)
        self.r, self.finish_reason = renderer, finish_reason
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        ids = (await super().generate(prompt_ids, sampling))[0].token_ids
        self.calls.append((tuple(prompt_ids), ids))
        finish = "length" if len(ids) == sampling.max_tokens and self.finish_reason == "length" else "stop"
        return [Sample(ids, tuple(-0.5 for _ in ids), finish)]


def gold_scripts(env: ArithmeticEnv) -> dict[str, list[str]]:
    return {t.data["question"]: env.gold_actions(t) for t in env.tasks}


def run(engine: RolloutEngine, tasks):
    with engine:
        return asyncio.run(engine.run(tasks))


def test_gold_policy_gives_exact_trajectories(renderer):
    env = ArithmeticEnv(n_tasks=16)
    policy = ScriptedPolicy(renderer, gold_scripts(env))
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=16), policy, renderer, RolloutConfig(group_size=2))
    groups = run(engine, list(env.tasks))
    sampled = {prompt: ids for prompt, ids in policy.calls}
    assert len(groups) == 16 and all(len(g.trajectories) == 2 for g in groups)
    for group in groups:
        for t in group.trajectories:
            assert t.status is Status.OK and t.reward == 1.0 and len(t.turns) == 2, t.reason
            assert t.stop is StopReason.TERMINATED
            assert t.reward_components == {"outcome": 1.0, "process": 1.0}
            # prompt ids are the rendering of the first messages
            assert list(t.token_ids[:t.prompt_len]) == renderer.prompt_ids(t.messages[:2], env.tool_schemas)
            # each turn's sampled ids are verbatim what the policy returned for exactly the ids before it
            for turn in t.turns:
                assert t.token_ids[turn.start:turn.end] == sampled[t.token_ids[:turn.start]]
            # the mask is 1 exactly on sampled tokens, and logprobs live only there
            spans = {i for turn in t.turns for i in range(turn.start, turn.end)}
            assert [i for i, m in enumerate(t.loss_mask) if m] == sorted(spans)
            assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(t.logprobs, t.loss_mask))
            # observation ids are the renderer's delta for the tool message
            first = t.turns[0]
            delta = renderer.observation_ids(t.messages[:2], t.messages[2], t.messages[3:4],
                                             t.token_ids[first.start:first.end], env.tool_schemas)
            assert list(t.token_ids[first.end:first.obs_end]) == delta
            assert t.turns[-1].obs_end == len(t.token_ids)


def test_failing_and_hanging_tools_become_error_trajectories(renderer):
    """64 episodes: a quarter call a tool that raises, a quarter one that hangs; the rest complete."""
    make = lambda: ArithmeticEnv(n_tasks=64, extra_tools=[explode, hang])  # noqa: E731
    env = make()
    scripts = gold_scripts(env)
    for i, task in enumerate(env.tasks):
        bad = {0: "explode", 1: "hang"}.get(i % 4)
        if bad:
            scripts[task.data["question"]][0] = env.parser.format_call(
                ToolCall(bad, {"reason": f"task {i}"}))
    engine = RolloutEngine(make, ScriptedPolicy(renderer, scripts), renderer, RolloutConfig(concurrency=64))
    trajectories = [g.trajectories[0] for g in run(engine, list(env.tasks))]
    for i, t in enumerate(trajectories):
        if i % 4 == 0:
            assert t.status is Status.ERROR and "ToolError" in t.reason and "backend unreachable" in t.reason
            assert t.stop is StopReason.ENV_ERROR
        elif i % 4 == 1:
            assert t.status is Status.ERROR and "ToolTimeout" in t.reason and t.stop is StopReason.ENV_ERROR
        else:
            assert t.status is Status.OK and t.reward == 1.0
    summary = summarize(trajectories)
    assert summary["status"] == {"error": 32, "ok": 32} and summary["mean_reward"] == 1.0
    assert summary["stops"] == {"env_error": 32, "terminated": 32}


def test_tool_calls_and_corrected_actions_are_counted_per_episode(renderer):
    """What the learning-dynamics plot draws: tool calls and sampled tokens per episode, and the share of turns whose
    action the env took. Task 0 first writes an action the env corrects, then the gold calculator call and answer."""
    env = ArithmeticEnv(n_tasks=2)
    scripts = gold_scripts(env)
    first = env.tasks[0].data["question"]
    scripts[first] = ["no action here", *scripts[first]]
    groups = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), ScriptedPolicy(renderer, scripts), renderer),
                 list(env.tasks))
    corrected, plain = (g.trajectories[0] for g in groups)
    assert [len(t.turns) for t in (corrected, plain)] == [len(scripts[first]), len(scripts[first]) - 1]
    assert corrected.metrics["invalid_actions"] == 1 and plain.metrics["invalid_actions"] == 0
    calls = [t.metrics["tool_calls"] for t in (corrected, plain)]
    assert calls[0] == calls[1] >= 1 and corrected.reward == plain.reward == 1.0
    summary = summarize([corrected, plain])
    turns = len(corrected.turns) + len(plain.turns)
    assert summary["valid_action_rate"] == pytest.approx(1 - 1 / turns)
    assert summary["mean_tool_calls"] == calls[0]
    assert summary["mean_sampled_tokens"] == (corrected.num_sampled + plain.num_sampled) / 2


def test_limits_end_as_truncated_with_reasons(renderer):
    env = ArithmeticEnv(n_tasks=2)
    tasks = list(env.tasks)
    policy = ScriptedPolicy(renderer, gold_scripts(env))
    one_turn = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), policy, renderer, RolloutConfig(max_turns=1)), tasks)
    t = one_turn[0].trajectories[0]
    assert t.status is Status.TRUNCATED and t.reason == "max_turns=1" and len(t.turns) == 1
    assert t.stop is StopReason.MAX_TURNS
    assert t.token_ids[-1] == renderer.stop_token_ids[0]  # no dangling observation after the last turn

    env_limit = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=2, max_turns=1), policy, renderer), tasks)
    assert env_limit[0].trajectories[0].status is Status.TRUNCATED
    assert env_limit[0].trajectories[0].reason == "max_turns=1"
    assert env_limit[0].trajectories[0].stop is StopReason.ENV_TRUNCATED  # the env's own limit, not the rollout's

    prompt_len = len(renderer.prompt_ids(env.first_messages(tasks[0]), env.tool_schemas))
    short = RolloutConfig(max_total_tokens=prompt_len + 5)
    cut = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), ScriptedPolicy(renderer, gold_scripts(env), "length"),
                            renderer, short), tasks[:1])[0].trajectories[0]
    assert cut.status is Status.TRUNCATED and cut.reason == "max_total_tokens reached mid-turn"
    assert cut.stop is StopReason.MAX_TOTAL_TOKENS
    assert len(cut.token_ids) == prompt_len + 5 and cut.turns[0].finish_reason == "length"

    per_turn = RolloutConfig(sampling=SamplingParams(max_tokens=3))
    cut = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), ScriptedPolicy(renderer, gold_scripts(env), "length"),
                            renderer, per_turn), tasks[:1])[0].trajectories[0]
    assert (cut.status, cut.stop, cut.reason) == (Status.TRUNCATED, StopReason.MAX_TOKENS, "max_tokens reached mid-turn")
    assert len(cut.token_ids) == prompt_len + 3


class BrokenPolicy:
    weight_version = 3

    async def generate(self, prompt_ids, sampling):
        raise PolicyError("server at http://127.0.0.1:1 refused the connection")

    async def close(self): ...


class StuckEnv(ArithmeticEnv):
    def step(self, action):
        time.sleep(5)
        return super().step(action)


def test_policy_and_env_failures_are_data(renderer, tmp_path: Path):
    env = ArithmeticEnv(n_tasks=3)
    broken = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=3), BrokenPolicy(), renderer), list(env.tasks))
    assert all(g.trajectories[0].status is Status.ERROR and "PolicyError" in g.trajectories[0].reason for g in broken)
    assert all(g.trajectories[0].stop is StopReason.POLICY_ERROR for g in broken)
    assert all(len(g.trajectories[0].token_ids) > 0 for g in broken)  # the prompt is kept for debugging
    assert all(g.trajectories[0].weight_version == 3 for g in broken)
    assert all(g.valid == () for g in broken)

    stuck = run(RolloutEngine(lambda: StuckEnv(n_tasks=3), ScriptedPolicy(renderer, gold_scripts(env)), renderer,
                              RolloutConfig(step_timeout=0.5)), list(env.tasks)[:1])
    assert "EnvTimeout" in stuck[0].trajectories[0].reason and stuck[0].trajectories[0].stop is StopReason.ENV_ERROR

    path = tmp_path / "out.jsonl"
    trajectories = [t for g in broken + stuck for t in g.trajectories]
    write_jsonl(trajectories, path)
    assert read_jsonl(path) == trajectories  # stop reasons included


class RaisingPolicy(BrokenPolicy):
    async def generate(self, prompt_ids, sampling):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_whatever_the_policy_raises_is_a_policy_error(renderer):
    """Not only a backend's own `PolicyError`: any exception out of `generate` ends its episode as policy_error,
    with that exception (not the engine's wrapper) as the reason."""
    env = ArithmeticEnv(n_tasks=1)
    [group] = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=1), RaisingPolicy(), renderer), list(env.tasks))
    t = group.trajectories[0]
    assert (t.stop, t.reason) == (StopReason.POLICY_ERROR,
                                  "RuntimeError: CUDA error: an illegal memory access was encountered")


class RaisingEnv(ArithmeticEnv):
    """Its `step` raises what `raises` holds for the episode's task."""

    def __init__(self, raises: dict[str, BaseException], **kwargs):
        super().__init__(**kwargs)
        self.raises = raises

    def step(self, action):
        if self.task.id in self.raises:
            raise self.raises[self.task.id]
        return super().step(action)


def test_whatever_env_code_raises_ends_its_episode_not_the_batch(renderer):
    """Exceptions that are not ordinary ones (they would stop the process) and StopIteration (which cannot cross
    into the event loop: it used to hang until the step timeout) become env_error at once."""
    env = ArithmeticEnv(n_tasks=8)
    tasks = list(env.tasks)
    raised = [KeyboardInterrupt("the env's own ^C"), SystemExit(3), GeneratorExit("closed"), StopIteration("empty")]
    make = lambda: RaisingEnv({t.id: e for t, e in zip(tasks, raised)}, n_tasks=8)  # noqa: E731
    started = time.perf_counter()
    trajectories = [g.trajectories[0] for g in run(RolloutEngine(
        make, ScriptedPolicy(renderer, gold_scripts(env)), renderer, RolloutConfig(step_timeout=10.0)), tasks)]
    assert time.perf_counter() - started < 5
    for t, e in zip(trajectories, raised):
        assert (t.status, t.stop) == (Status.ERROR, StopReason.ENV_ERROR)
        assert t.reason == f"EnvRaised: {type(e).__name__} in step: {e}"
    assert all(t.status is Status.OK and t.reward == 1.0 for t in trajectories[len(raised):])

    def no_env():
        raise SystemExit("no env today")

    t = run(RolloutEngine(no_env, ScriptedPolicy(renderer, gold_scripts(env)), renderer), tasks[:1])[0].trajectories[0]
    assert (t.stop, t.reason) == (StopReason.ENV_ERROR, "EnvRaised: SystemExit in make_env: no env today")


def test_a_real_ctrl_c_still_stops_the_batch(renderer):
    env = ArithmeticEnv(n_tasks=4)
    engine = RolloutEngine(lambda: StuckEnv(n_tasks=4), ScriptedPolicy(renderer, gold_scripts(env)), renderer)
    # Python's own Ctrl-C handler, as a user's process has it: a library that an earlier test in this worker loaded
    # may have left another one (a full run once saw this signal not interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # while the 5 s steps run
        started = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            run(engine, list(env.tasks))
        assert time.perf_counter() - started < 3  # at once: the episodes were cancelled, their envs closed
    finally:
        signal.signal(signal.SIGINT, previous)


class ClosingEnv(ArithmeticEnv):
    """The first task's `close` raises, the second's takes 3 s; the other episodes' steps take 0.3 s, so that
    they are in flight while those two close."""

    def __init__(self, first: str, second: str, **kwargs):
        super().__init__(**kwargs)
        self.first, self.second = first, second

    def step(self, action):
        if self.task.id not in (self.first, self.second):
            time.sleep(0.3)
        return super().step(action)

    def close(self):
        if self.task.id == self.first:
            raise SystemExit("close failed")
        if self.task.id == self.second:
            time.sleep(3)


def test_a_failing_or_slow_close_is_noted_and_holds_up_no_one(renderer):
    env = ArithmeticEnv(n_tasks=6)
    tasks = list(env.tasks)
    engine = RolloutEngine(lambda: ClosingEnv(tasks[0].id, tasks[1].id, n_tasks=6),
                           ScriptedPolicy(renderer, gold_scripts(env)), renderer, RolloutConfig(step_timeout=1.0))
    trajectories = [g.trajectories[0] for g in run(engine, tasks)]
    assert all(t.status is Status.OK and t.reward == 1.0 for t in trajectories), [t.reason for t in trajectories]
    assert trajectories[0].logs["close_error"] == "EnvRaised: SystemExit in close: close failed"
    assert trajectories[1].logs["close_error"] == "EnvTimeout: close took more than 1.0s (rollout.step_timeout)"
    assert all("close_error" not in t.logs for t in trajectories[2:])


class HangingPolicy(ScriptedPolicy):
    """Never answers a prompt about `stuck`."""

    def __init__(self, renderer: Renderer, scripts: dict[str, list[str]], stuck: str):
        super().__init__(renderer, scripts)
        self.stuck = stuck

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        if self.stuck in self.r.decode(prompt_ids):
            await asyncio.sleep(3600)
        return await super().generate(prompt_ids, sampling)


def test_a_hanging_policy_ends_its_episode_at_the_generate_timeout(renderer):
    env = ArithmeticEnv(n_tasks=4)
    tasks = list(env.tasks)
    policy = HangingPolicy(renderer, gold_scripts(env), tasks[0].data["question"])
    started = time.perf_counter()
    trajectories = [g.trajectories[0] for g in run(RolloutEngine(
        lambda: ArithmeticEnv(n_tasks=4), policy, renderer, RolloutConfig(generate_timeout=0.5)), tasks)]
    assert time.perf_counter() - started < 5
    assert (trajectories[0].status, trajectories[0].stop) == (Status.ERROR, StopReason.POLICY_ERROR)
    assert trajectories[0].reason == ("PolicyTimeout: generate took more than 0.5s: raise rollout.generate_timeout "
                                      "if the backend is slow, not hung")
    assert all(t.status is Status.OK and t.reward == 1.0 for t in trajectories[1:])


def test_a_huge_observation_is_cut_before_it_is_tokenized(renderer):
    make = lambda: ArithmeticEnv(n_tasks=2, extra_tools=[flood])  # noqa: E731
    env = make()
    scripts = gold_scripts(env)
    for task in env.tasks:
        scripts[task.data["question"]][0] = env.parser.format_call(ToolCall("flood", {"reason": "21 MB"}))
    started = time.perf_counter()
    trajectories = [g.trajectories[0] for g in run(RolloutEngine(
        make, ScriptedPolicy(renderer, scripts), renderer, RolloutConfig(max_observation_chars=1000)), list(env.tasks))]
    assert time.perf_counter() - started < 5  # the whole 21 MB took about 30 s to tokenize
    for t in trajectories:
        assert t.status is Status.OK and t.reward == 1.0, t.reason
        content = next(m.content for m in t.messages if m.role == "tool")
        cut = "\n[... 20999000 characters cut: the rollout keeps 1000 of an observation (max_observation_chars) ...]\n"
        assert content == "flood " * 83 + "fl" + cut + "d " + "flood " * 83


def test_rollout_config_refuses_impossible_limits():
    for bad in ({"step_timeout": 0.0}, {"generate_timeout": float("nan")}, {"max_observation_chars": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RolloutConfig(**bad)


def test_a_conversation_the_template_cannot_express_is_a_render_error(renderer, monkeypatch):
    def cannot(*args, **kwargs):
        raise RendererError("The chat template dropped a 'tool' message")

    env = ArithmeticEnv(n_tasks=1)
    monkeypatch.setattr(renderer, "observation_ids", cannot)  # fault injection: the template drops the tool reply
    t = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=1), ScriptedPolicy(renderer, gold_scripts(env)), renderer),
            list(env.tasks))[0].trajectories[0]
    assert (t.status, t.stop) == (Status.ERROR, StopReason.RENDER_ERROR) and t.reason.startswith("RendererError: ")


def test_each_stop_reason_gives_its_status():
    ok = {StopReason.TERMINATED}
    error = {StopReason.ENV_ERROR, StopReason.POLICY_ERROR, StopReason.RENDER_ERROR}
    for stop in StopReason:
        expected = Status.OK if stop in ok else Status.ERROR if stop in error else Status.TRUNCATED
        assert stop.status is expected, stop


class SlowResetEnv(ArithmeticEnv):
    def reset(self, *args, **kwargs):
        time.sleep(0.6)  # most of the step timeout: two in a row on one thread would outlast it
        return super().reset(*args, **kwargs)


def test_the_step_timeout_counts_from_when_a_thread_starts_the_call(renderer):
    """Four episodes on one env thread queue for it; each call's time, not its wait, meets `step_timeout`.
    When no thread comes free at all, the wait ends with its own error."""
    env = ArithmeticEnv(n_tasks=4)
    config = RolloutConfig(step_timeout=1.0, env_workers=1, concurrency=4)
    engine = RolloutEngine(lambda: SlowResetEnv(n_tasks=4), ScriptedPolicy(renderer, gold_scripts(env)), renderer,
                           config)
    trajectories = [g.trajectories[0] for g in run(engine, list(env.tasks))]
    assert all(t.status is Status.OK for t in trajectories), [t.reason for t in trajectories]

    stuck = RolloutEngine(lambda: SlowResetEnv(n_tasks=4), ScriptedPolicy(renderer, gold_scripts(env)), renderer,
                          RolloutConfig(step_timeout=0.05, env_workers=1, concurrency=2))
    reasons = [g.trajectories[0].reason for g in run(stuck, list(env.tasks)[:2])]
    assert any("no env thread was free" in r for r in reasons), reasons


class PooledEnv(ArithmeticEnv):
    """Each episode holds one of `pool`'s 2 slots from reset to close, waiting up to 5 s for one in its reset, as a
    sandbox pool's lease does; `max_concurrent_episodes` says so."""
    max_concurrent_episodes = 2

    def __init__(self, pool: threading.BoundedSemaphore, held: list[int], **kwargs):
        super().__init__(**kwargs)
        self.pool, self.held, self.holding = pool, held, False

    def reset(self, *args, **kwargs):
        if not self.pool.acquire(timeout=5.0):
            raise RuntimeError("no free slot in the pool for 5 s")
        self.holding = True
        self.held.append(2 - self.pool._value)  # slots taken now
        return super().reset(*args, **kwargs)

    def close(self):
        if self.holding:
            self.holding = False
            self.pool.release()
        super().close()


def test_episodes_beyond_the_envs_limit_wait_for_a_slot_without_an_env_thread(renderer):
    """Eight episodes, two env threads, an env whose pool holds two: without the engine's gate the waiting resets
    took both threads, and the episodes holding the pool could not step or close (CI's code agent evaluation: 32
    episodes, 16 threads, 8 sandboxes; half ended in step timeouts)."""
    env, pool, held = ArithmeticEnv(n_tasks=8), threading.BoundedSemaphore(2), []
    engine = RolloutEngine(lambda: PooledEnv(pool, held, n_tasks=8), ScriptedPolicy(renderer, gold_scripts(env)),
                           renderer, RolloutConfig(step_timeout=1.0, env_workers=2, concurrency=8))
    trajectories = [g.trajectories[0] for g in run(engine, list(env.tasks))]
    assert all(t.status is Status.OK and t.reward == 1.0 for t in trajectories), [t.reason for t in trajectories]
    assert len(held) == 8 and max(held) <= 2


class SeedSpy(ScriptedPolicy):
    def __init__(self, *args):
        super().__init__(*args)
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        self.seeds.append(sampling.seed)
        return await super().generate(prompt_ids, sampling)


def test_turn_seeds_reach_the_engine_only_when_seeded_sampling_is_on(renderer):
    env = ArithmeticEnv(n_tasks=3)
    for seeded in (True, False):
        spy = SeedSpy(renderer, gold_scripts(env))
        groups = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=3), spy, renderer,
                                   RolloutConfig(seeded_sampling=seeded, seed=5)), list(env.tasks))
        assert spy.seeds and all((s is not None) == seeded for s in spy.seeds)
        assert [g.trajectories[0].seed for g in groups] == [5 * 100_003 + i for i in range(3)]  # resets stay seeded


def test_the_seeds_are_the_ones_earlier_runs_drew(renderer):
    """The seeds as numbers (run seed 5, groups of 2, two tasks of two turns): a changed formula in
    `agentrl.rollout.seeds` would play other episodes than every earlier run did."""
    env = ArithmeticEnv(n_tasks=2)
    spy = SeedSpy(renderer, gold_scripts(env))
    groups = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), spy, renderer, RolloutConfig(seed=5, group_size=2)),
                 list(env.tasks))
    assert [t.seed for g in groups for t in g.trajectories] == [500_015, 500_015, 500_016, 500_016]  # env seeds
    # turns 0 and 1 of the samples seeded 1_000_030 to 1_000_033
    assert sorted(spy.seeds) == [1_000_033_000_090, 1_000_033_000_091, 1_000_034_000_093, 1_000_034_000_094,
                                 1_000_035_000_096, 1_000_035_000_097, 1_000_036_000_099, 1_000_036_000_100]


def test_the_step_and_eval_seeds_are_the_ones_earlier_runs_drew():
    """The seeds no rollout here draws, as numbers: a training step's (synchronous training) and an evaluation's."""
    assert seeds.step_seed(5, 2) == 500_017
    assert seeds.eval_seed(3, 1, 2) == 3_001_009_005  # seed 3, the suite's second entry, its third task
    assert seeds.sample_seed(3_001_009_005, 4, 3) == 12_004_036_023


def test_a_subset_at_its_positions_replays_what_the_whole_list_draws(renderer):
    """`run(tasks, positions=...)` plays each task with the seeds and group index of its place in the whole list, and
    hands every trajectory to `on_episode` as it ends."""
    env = ArithmeticEnv(n_tasks=3)
    tasks, config = list(env.tasks), RolloutConfig(group_size=2, seed=4)
    whole_spy, part_spy, seen = SeedSpy(renderer, gold_scripts(env)), SeedSpy(renderer, gold_scripts(env)), []
    whole = run(RolloutEngine(lambda: ArithmeticEnv(n_tasks=3), whole_spy, renderer, config), tasks)
    with RolloutEngine(lambda: ArithmeticEnv(n_tasks=3), part_spy, renderer, config) as engine:
        part = asyncio.run(engine.run([tasks[2], tasks[0]], on_episode=seen.append, positions=[2, 0]))
    assert [g.task for g in part] == [tasks[2], tasks[0]]
    assert [[(t.seed, t.group) for t in g.trajectories] for g in part] == \
        [[(t.seed, t.group) for t in whole[i].trajectories] for i in (2, 0)]
    assert len(part_spy.seeds) == 8 and set(part_spy.seeds) < set(whole_spy.seeds)  # 2 tasks x 2 samples x 2 turns
    assert sorted(map(id, seen)) == sorted(id(t) for g in part for t in g.trajectories)


def test_the_engine_closes_at_the_end_of_a_with_block_and_again_harmlessly(renderer):
    env = ArithmeticEnv(n_tasks=1)
    with RolloutEngine(lambda: ArithmeticEnv(n_tasks=1), ScriptedPolicy(renderer, gold_scripts(env)),
                       renderer) as engine:
        [group] = asyncio.run(engine.run(list(env.tasks)))
    assert group.trajectories[0].status is Status.OK
    engine.close()
    [after] = asyncio.run(engine.run(list(env.tasks)))  # closed: no env call starts any more
    assert after.trajectories[0].stop is StopReason.ENV_ERROR and "after shutdown" in after.trajectories[0].reason


class CountingParser:
    """The env's parser, counting the texts it parses."""

    def __init__(self, parser):
        self.parser, self.parses = parser, 0

    def parse(self, text):
        self.parses += 1
        return self.parser.parse(text)

    def __getattr__(self, name):
        return getattr(self.parser, name)


class OwnStepEnv(ArithmeticEnv):
    """An env whose own `step` hands back no assistant message (as one that overrides `step` may)."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {k: v for k, v in info.items() if k != "assistant"}


def test_the_assistant_text_is_parsed_once_a_turn(renderer):
    """`step` hands back the assistant message its env parsed, so the engine asks for no second parse; an env whose
    own `step` does not is asked for the message, and the trajectory is the same."""
    env, made = ArithmeticEnv(n_tasks=1), []

    def counted(kind):
        def make():
            made.append(kind(n_tasks=1))
            made[-1].parser = CountingParser(made[-1].parser)
            return made[-1]
        return make

    [t] = run(RolloutEngine(counted(ArithmeticEnv), ScriptedPolicy(renderer, gold_scripts(env)), renderer),
              list(env.tasks))[0].trajectories
    assert t.status is Status.OK and len(t.turns) == 2 and t.messages[2].tool_calls, t.reason  # the call, parsed
    assert made[0].parser.parses == 2  # one a turn
    [own] = run(RolloutEngine(counted(OwnStepEnv), ScriptedPolicy(renderer, gold_scripts(env)), renderer),
                list(env.tasks))[0].trajectories
    assert made[1].parser.parses == 4 and (own.token_ids, own.messages) == (t.token_ids, t.messages)


class PartnerPolicy(ScriptedPolicy):
    """As in tandem rollouts: the first two sampled ids of every turn are a frozen partner's (trainable 0), and
    the weights that sampled call k (from 1) are version 5 - k."""

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        [sample] = await super().generate(prompt_ids, sampling)
        n = len(sample.token_ids)
        return [Sample(sample.token_ids, sample.logprobs, sample.finish_reason, (0, 0) + (1,) * (n - 2),
                       5 - len(self.calls))]


def test_partner_tokens_keep_loss_mask_zero_and_are_counted(renderer):
    env = ArithmeticEnv(n_tasks=1)
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=1), PartnerPolicy(renderer, gold_scripts(env)), renderer)
    [t] = run(engine, list(env.tasks))[0].trajectories
    assert t.status is Status.OK and len(t.turns) == 2, t.reason
    # the mask: 0 on the prompt, the observation and each turn's first two ids, 1 on the rest of each turn
    expected = [0] * len(t.token_ids)
    for turn in t.turns:
        expected[turn.start + 2:turn.end] = [1] * (turn.end - turn.start - 2)
    assert list(t.loss_mask) == expected
    assert t.metrics["untrained_tokens"] == 4  # 2 per turn
    assert [turn.weight_version for turn in t.turns] == [4, 3] and t.weight_version == 3  # the oldest turn's
    assert "close_error" not in t.logs and t.metrics["tool_calls"] == 1 and t.answer == env.tasks[0].data["answer"]
    assert isinstance(t.metrics["seconds"], float) and 0.0 <= t.metrics["seconds"] < 600.0
    assert (t.task_id, t.group) == (env.tasks[0].id, 0)
    # every id the trained policy wrote: no untrained_tokens at all; each trajectory has its task's group index
    env = ArithmeticEnv(n_tasks=2)
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), ScriptedPolicy(renderer, gold_scripts(env)), renderer)
    trajectories = [g.trajectories[0] for g in run(engine, list(env.tasks))]
    assert [t.group for t in trajectories] == [0, 1]
    for t in trajectories:
        assert "untrained_tokens" not in t.metrics and sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)
