"""Context policies (agentrl/rollout/context.py): segments of one episode, exact tokens in each, budgets across them,
and the ledger env that needs them, played by a scripted reader that remembers only what its context shows."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
import torch

from agentrl.envs.recall import LedgerEnv
from agentrl.eval.metrics import summarize
from agentrl.policy import scripted
from agentrl.policy.protocol import Sample, SamplingParams
from agentrl.rollout.context import SUMMARY_PROMPT, ContextConfig, resumed
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.rollout.jsonl import read_jsonl
from agentrl.trainers.advantages import ADVANTAGES
from agentrl.trainers.job.pipeline import demonstrations
from agentrl.trainers.methods.grpo import to_batch
from agentrl.types import Group, Message, StopReason, Task


def reader(env: LedgerEnv, prompt: str, turn: int) -> str:
    """The env's expert: it remembers only what its context shows, and writes the codes it sees into a summary when
    asked for one."""
    return env.expert_turn(prompt, SUMMARY_PROMPT in prompt[-len(SUMMARY_PROMPT) - 80:])


class Reader(scripted.ScriptedPolicy):
    """The reader as a policy, recording each call's (prompt ids, sampled ids), with logprobs -0.5."""

    def __init__(self, renderer, env: LedgerEnv):
        super().__init__(renderer, lambda prompt, turn: reader(env, prompt, turn), renderer.generation_prompt)
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        sample = (await super().generate(prompt_ids, sampling))[0]
        self.calls.append((tuple(prompt_ids), sample.token_ids))
        return [Sample(sample.token_ids, (-0.5,) * len(sample.token_ids), sample.finish_reason)]


def play(renderer, policy: str, window: int | None, max_total_tokens: int = 6000, n: int = 4, notes: bool = False,
         parser: str = "hermes", every_page: bool = False, max_tokens: int = 64, **context):
    make_env = lambda: LedgerEnv(split="heldout", n_tasks=n, expert_notes=notes, parser=parser,  # noqa: E731
                                 every_page=every_page)
    env = make_env()
    config = RolloutConfig(max_total_tokens=max_total_tokens, max_turns=14,
                           sampling=SamplingParams(max_tokens=max_tokens),
                           context=ContextConfig(policy=policy, window=window, **context))
    policy_ = Reader(renderer, env)
    with RolloutEngine(make_env, policy_, renderer, config) as engine:
        groups = asyncio.run(engine.run(env.tasks))
    return [t for g in groups for t in g.trajectories], policy_, env


def episodes(trajectories):
    """The last segment of each episode (the whole trajectory of an unsegmented one)."""
    return [t for t in trajectories if t.logs.get("segment", 0) + 1 == t.metrics.get("segments", 1)]


def test_the_ledger_needs_compaction_when_the_window_holds_two_pages(renderer):
    """The same reader, the same window: compact solves every task, sliding_window forgets the code, and truncate
    runs out of tokens; with room for the whole episode, truncate solves them all (the reader is right)."""
    whole, _, _ = play(renderer, "truncate", None)
    assert [t.reward for t in whole] == [1.0] * 4 and all(t.session is None for t in whole)
    truncated, _, _ = play(renderer, "truncate", None, max_total_tokens=900)
    assert {t.stop for t in truncated} == {StopReason.MAX_TOTAL_TOKENS} and sum(t.reward for t in truncated) == 0
    sliding, _, _ = play(renderer, "sliding_window", 900)
    compact, _, _ = play(renderer, "compact", 900, summary_tokens=48)
    assert sum(t.reward for t in episodes(sliding)) == 0 and all(t.stop is StopReason.TERMINATED
                                                                  for t in episodes(sliding))
    assert [t.reward for t in episodes(compact)] == [1.0] * 4
    assert all(t.metrics["segments"] > 1 for t in episodes(compact) + episodes(sliding))
    # no totals, no segment index
    assert all(t.metrics.keys() == {"tool_calls", "invalid_actions", "seconds"} and not t.logs for t in whole)


def test_a_reader_that_repeats_the_code_in_its_turns_survives_the_sliding_window(renderer):
    """With `expert_notes` the reader writes the codes it sees before each action: the window drops the first page
    but keeps the note, so sliding_window solves every task; truncate still runs out of tokens."""
    sliding, policy_, env = play(renderer, "sliding_window", 900, notes=True)
    assert [t.reward for t in episodes(sliding)] == [1.0] * 4 and all(t.metrics["segments"] > 1
                                                                        for t in episodes(sliding))
    turns = [renderer.decode(sampled) for _, sampled in policy_.calls]
    assert any(f"Thought: code {task.data['answer']}." in turn for task in env.tasks for turn in turns)
    truncated, _, _ = play(renderer, "truncate", None, max_total_tokens=900, notes=True)
    assert {t.stop for t in truncated} == {StopReason.MAX_TOTAL_TOKENS}


def test_codes_on_every_page_outgrow_a_turn_but_not_a_summary(renderer):
    """recall/ledger-many-v0: a code on every page, the last page names one. The reader that repeats every code in
    its turns solves it under sliding_window while its notes fit a turn's max_tokens, and fails the tasks whose notes
    outgrow it; compact's summaries, with a budget of their own, keep them all at the same turn budget."""
    kwargs = dict(n=8, every_page=True, parser="react")
    roomy, _, env = play(renderer, "sliding_window", 900, notes=True, max_tokens=96, **kwargs)
    assert [t.reward for t in episodes(roomy)] == [1.0] * 8
    tight, _, _ = play(renderer, "sliding_window", 900, notes=True, max_tokens=40, **kwargs)
    compact, _, _ = play(renderer, "compact", 900, max_tokens=40, summary_tokens=64, **kwargs)
    pages = [len(task.data["chain"]) for task in env.tasks]
    assert [t.reward for t in episodes(tight)] == [float(n == 3) for n in pages] and 3 in pages and 5 in pages
    assert [t.reward for t in episodes(compact)] == [1.0] * 8
    assert len({task.data["answer"] for task in env.tasks}) == 8 and any(  # not always the first page's code
        task.data["answer"] not in task.data["pages"][str(task.data["chain"][0])] for task in env.tasks)


@pytest.mark.parametrize("parser", ["react", "hermes"])
def test_a_window_rendered_afresh_shows_the_turns_it_keeps_as_they_were_sampled(renderer, parser):
    """A sliding window renders its kept turns again from their messages: ReAct's calls (not the template's syntax)
    come back as the model wrote them, not as `<tool_call>` blocks it never wrote; Hermes' calls are the template's
    own, so its rendering of them is the text as sampled too."""
    trajectories, policy_, _ = play(renderer, "sliding_window", 900, notes=True, parser=parser)
    sampled = {renderer.decode(ids).removesuffix("<|im_end|>") for _, ids in policy_.calls}
    later = [t for t in trajectories if t.logs["segment"] > 0]
    assert later
    for t in later:
        turns = [m for m in t.messages[2:] if m.role == "assistant"]  # the kept ones, then the segment's own
        text = renderer.decode(t.token_ids)
        assert all(m.content in sampled and m.content in text for m in turns if not m.tool_calls)
        assert ('<tool_call>\n{"name": "read"' in text) is (parser == "hermes")
        assert all(m.tool_calls for m in turns[:-1]) is (parser == "hermes")  # the last: its answer


def test_every_segment_carries_its_episodes_totals(renderer):
    """An episode of several segments, of two or more: each segment has the episode's counts and its totals over
    all segments (sampled tokens, turns, summaries), and the session that joins them."""
    trajectories, _, _ = play(renderer, "compact", 1300, summary_tokens=48)  # episodes of 2 and 3 segments
    sessions = {}
    for t in trajectories:
        sessions.setdefault(t.session, []).append(t)
    assert None not in sessions and {len(segments) for segments in sessions.values()} == {2, 3}
    for segments in sessions.values():
        totals = {"segments": len(segments), "summaries": len(segments) - 1,
                  "summary_tokens": sum(t.turns[-1].end - t.turns[-1].start for t in segments[:-1]),
                  "episode_sampled_tokens": sum(t.num_sampled for t in segments),
                  "episode_turns": sum(len(t.turns) for t in segments),
                  # every turn reads a page, but the summaries and the answer
                  "tool_calls": sum(len(t.turns) for t in segments) - len(segments)}
        for t in segments:
            assert {k: t.metrics[k] for k in totals} == totals and t.metrics["invalid_actions"] == 0


def test_each_segment_holds_exactly_the_sampled_tokens_and_the_summary_is_trained(renderer):
    trajectories, policy, env = play(renderer, "compact", 900, summary_tokens=48)
    sampled = {ids for _, ids in policy.calls}
    for t in trajectories:
        ids, mask = t.token_ids, t.loss_mask
        for turn in t.turns:  # every turn: the sampled ids verbatim, mask 1 exactly there, logprobs with them
            assert tuple(ids[turn.start:turn.end]) in sampled
            assert set(mask[turn.start:turn.end]) == {1} and set(t.logprobs[turn.start:turn.end]) == {-0.5}
            assert set(mask[turn.end:turn.obs_end]) <= {0}
        assert sum(mask) == sum(turn.end - turn.start for turn in t.turns) and set(mask[:t.prompt_len]) == {0}
        assert tuple(ids) == policy.calls[[c[0] for c in policy.calls].index(tuple(ids[:t.turns[-1].start]))][0] \
            + tuple(ids[t.turns[-1].start:])  # the last call saw exactly the segment's ids before its turn
    first = [t for t in trajectories if t.logs.get("segment") == 0][0]
    second = next(t for t in trajectories if t.session == first.session and t.logs["segment"] == 1)
    summary = first.turns[-1]  # a segment that hands over ends with the summary, sampled after the request
    summary_text = renderer.decode(first.token_ids[summary.start:summary.end - 1])
    assert SUMMARY_PROMPT in renderer.decode(first.token_ids[first.turns[-2].end:summary.start])
    handing_over = [t for t in trajectories
                    if t.session == first.session and t.logs["segment"] + 1 < t.metrics["segments"]]
    assert first.metrics["summaries"] == len(handing_over) == first.metrics["segments"] - 1  # each ends in a summary
    assert first.metrics["summary_tokens"] == sum(t.turns[-1].end - t.turns[-1].start for t in handing_over)
    # the next segment is the task and that summary, rendered afresh (mask 0), then its own sampled turns
    task = list(env.first_messages(env.tasks[int(first.task_id.rsplit("-", 1)[1])]))
    expected = renderer.prompt_ids(resumed(task, summary_text, ContextConfig().resume_prompt), env.tool_schemas)
    assert list(second.token_ids[:second.prompt_len]) == expected and set(second.loss_mask[:second.prompt_len]) == {0}
    # one episode, one sample: the segments share the reward and the advantage
    assert first.reward == second.reward == 1.0 and first.stop is second.stop is StopReason.TERMINATED


def test_sliding_window_keeps_the_task_and_the_latest_turns(renderer):
    trajectories, _, env = play(renderer, "sliding_window", 900)
    for t in trajectories:
        assert len(t.token_ids) <= 900 and t.messages[:2] == tuple(env.first_messages(
            env.tasks[int(t.task_id.rsplit("-", 1)[1])]))
        if t.logs["segment"] > 0:  # it starts with a kept turn: the assistant's call and the page it read
            assert t.messages[2].role == "assistant" and t.messages[3].role == "tool"


def test_budgets_hold_across_segments(renderer):
    """max_total_tokens bounds the whole episode (every segment, re-rendered prompts included), the window each
    segment; the episode that runs out stops as max_total_tokens in every segment."""
    trajectories, _, _ = play(renderer, "compact", 900, max_total_tokens=2500, summary_tokens=48)
    by_episode = {}
    for t in trajectories:
        by_episode.setdefault(t.session, []).append(t)
    assert any(len(segments) > 1 for segments in by_episode.values())
    for segments in by_episode.values():
        assert all(len(t.token_ids) <= 900 for t in segments) and sum(len(t.token_ids) for t in segments) <= 2500
        assert {t.stop for t in segments} == {StopReason.MAX_TOTAL_TOKENS}
        assert {t.reason for t in segments} == {"max_total_tokens=2500"}
    # an episode whose budget, not its window, cannot hold the summary request says so
    short, _, _ = play(renderer, "compact", 900, max_total_tokens=1300, summary_tokens=48, n=2)
    assert {t.reason for t in short} == {"max_total_tokens=1300"}


def test_the_segments_of_an_episode_are_one_sample_of_the_group(renderer):
    """Session-level GRPO: beside a failed episode, the segments of a solved one share one advantage, and the
    baseline counts that episode once (as two samples: rewards 1 and 0), not once per segment."""
    segments, _, _ = play(renderer, "compact", 900, n=1, summary_tokens=48)
    failed = replace(segments[-1], session=None, reward=0.0, metrics={}, logs={})
    batch = to_batch([Group(Task("t"), (*segments, failed))], "grpo", [[t.reward for t in (*segments, failed)]])
    advantage = [batch.adv_BT[b][batch.mask_BT[b].bool()].unique().tolist() for b in range(len(batch))]
    expected = ADVANTAGES["grpo"](torch.tensor([1.0, 0.0]), None, torch.tensor([0, 0])).tolist()
    assert len(segments) > 1 and advantage == [[pytest.approx(expected[0])]] * len(segments) + [
        [pytest.approx(expected[1])]]


def test_rollout_metrics_count_episodes_once_and_every_segments_tokens(renderer):
    trajectories, _, _ = play(renderer, "compact", 900, summary_tokens=48)
    summary = summarize(trajectories, max_reward=1.0)
    summaries = [t.turns[-1].end - t.turns[-1].start for t in trajectories  # a segment that hands over ends with one
                 if t.logs.get("segment", 0) + 1 < t.metrics.get("segments", 1)]
    assert summary["episodes"] == 4 and summary["success"] == 1.0 and len(trajectories) > 4
    assert summary["sampled_tokens"] == sum(t.num_sampled for t in trajectories)
    assert summary["mean_turns"] == sum(len(t.turns) for t in trajectories) / 4
    assert summary["segments_per_episode"] == len(trajectories) / 4
    assert summary["mean_summary_tokens"] == sum(summaries) / len(summaries) > 0
    assert summary["success_by_segments"] == {str(k): 1.0 for k in sorted({t.metrics["segments"]
                                                                         for t in trajectories})}


@pytest.mark.parametrize("table, problem", [
    ({"policy": "keep"}, "must be one of truncate, sliding_window, compact"),
    ({"policy": "compact"}, "needs context.window"),
    ({"window": 512}, "with truncate the episode is one segment"),
])
def test_context_settings_that_cannot_work_are_refused(table, problem):
    with pytest.raises(ValueError, match=problem):
        ContextConfig(**table)


@pytest.mark.parametrize("window, problem", [(2048, "must be below max_total_tokens"),
                                             (300, r"must exceed sampling.max_tokens \(256\) \+ summary_tokens")])
def test_a_window_that_never_applies_or_cannot_hold_a_turn_is_refused(window, problem):
    with pytest.raises(ValueError, match=problem):
        RolloutConfig(max_total_tokens=2048, context=ContextConfig(policy="compact", window=window))


def test_expert_demonstrations_play_with_the_context_policy_and_write_the_summaries(renderer, tmp_path):
    """SFT demos on the ledger: played with `compact` at a window that cannot hold an episode, the expert's summaries
    keep the code, and every episode is solved, over several segments of exact tokens."""
    env = LedgerEnv(split="train", n_tasks=4)
    rollout = RolloutConfig(max_total_tokens=6000, max_turns=14, sampling=SamplingParams(max_tokens=64),
                            context=ContextConfig(policy="compact", window=900, summary_tokens=48))
    demos = demonstrations(lambda split="train": LedgerEnv(split=split, n_tasks=4), list(env.tasks), renderer,
                           rollout, 0.0, 0, tmp_path / "demos.jsonl")
    assert [t.reward for t in episodes(demos)] == [1.0] * 4 and all(len(t.token_ids) <= 900 for t in demos)
    assert any(t.metrics["segments"] > 1 for t in episodes(demos))
    for t in demos:
        if t.logs["segment"] + 1 < t.metrics["segments"]:  # it hands over: its last turn is the expert's summary
            summary = renderer.decode(t.token_ids[t.turns[-1].start:t.turns[-1].end])
            assert f"code {env.tasks[int(t.task_id.rsplit('-', 1)[1])].data['answer']}." in summary
    assert len(list(read_jsonl(tmp_path / "demos.jsonl"))) == len(demos)


def test_the_experts_mistakes_are_summaries_that_lose_the_code(renderer, tmp_path):
    """`sft.error_rate` with an expert: at 1.0 every summary keeps only the next page, so every episode that compacts
    answers wrong; at 0.2 some do and some do not, the same ones when played again (drawn from seed and prompt)."""
    rollout = RolloutConfig(max_total_tokens=6000, max_turns=14, sampling=SamplingParams(max_tokens=64),
                            context=ContextConfig(policy="compact", window=900, summary_tokens=48))
    make_env = lambda split="train": LedgerEnv(split=split, n_tasks=8)  # noqa: E731
    tasks = list(make_env().tasks)

    def rewards(error_rate, name):
        demos = demonstrations(make_env, tasks, renderer, rollout, error_rate, 0, tmp_path / name)
        return [t.reward for t in episodes(demos) if t.metrics["segments"] > 1]

    assert rewards(1.0, "all.jsonl") == [0.0] * 8
    some = rewards(0.2, "some.jsonl")
    assert 0 < sum(some) < len(some) and rewards(0.2, "again.jsonl") == some


def test_the_summary_request_joins_a_user_observation():
    """Templates that want roles to alternate accept the request: it is added to a user observation."""
    from agentrl.rollout.context import with_request

    assert with_request([Message("user", "Invalid action")], "Summarize.") == (
        Message("user", "Invalid action\n\nSummarize."),)
    assert with_request([Message("tool", "page")], "Summarize.")[-1] == Message("user", "Summarize.")


def test_a_ledger_answer_scores_only_after_the_last_page():
    env = LedgerEnv(split="heldout", n_tasks=1)
    task = env.tasks[0]
    env.reset(options={"task": task})
    *_, info = env.step(env.parser.format_answer(task.data["answer"]))
    assert info["reward_components"] == {"outcome": 0.0} and "before reading the last page" in info["detail"]
    assert env.validate(tasks=[task]) == []  # the gold path (every page, then the code) scores 1


@pytest.mark.slow
def test_a_compacting_run_trains_and_resumes_with_the_same_segments(tiny_model_dir, tmp_path):
    """`agentrl train` on the ledger with compact, the tiny model sampling: its episodes compact, the step trains on
    their segments, and a run stopped after step 1 resumes to the uninterrupted run's step 2, segment for segment."""
    from agentrl.config import load_config
    from agentrl.trainers.job.pipeline import run
    from agentrl.trainers.job.recipe import TrainJob

    rollout = {"max_total_tokens": 4000, "max_turns": 6, "sampling": {"max_tokens": 32},
               "context": {"policy": "compact", "window": 660, "summary_tokens": 16}}

    def job(out, steps, model, sft=None):
        return load_config(TrainJob, {
            "env": "recall/ledger-v0", "model": str(model), "out_dir": str(out), "train_tasks": 8,
            "env_kwargs": {"page_lines": 3, "max_invalid": 6}, "eval": None, "sft": sft,
            "grpo": {"steps": steps, "tasks_per_step": 2, "group_size": 2, "minibatch_size": 4, "lr": 1e-3,
                     "checkpoint_every": 1, "rollout": rollout, "reward": {"terms": {"env": 1.0, "random": 0.5}}}})

    quiet = lambda _: None  # noqa: E731
    sft = {"episodes": 32, "config": {"epochs": 4, "batch_size": 8, "lr": 3e-3}}  # to end its turns
    run(job(tmp_path / "sft", 0, tiny_model_dir, sft), log=quiet)  # once: both runs start from its model
    start = tmp_path / "sft" / "sft_model"
    run(job(tmp_path / "straight", 2, start), log=quiet)
    run(job(tmp_path / "resumed", 1, start), log=quiet)  # "killed" after step 1
    run(job(tmp_path / "resumed", 2, start), log=quiet)
    demos = read_jsonl(tmp_path / "sft" / "sft_demos.jsonl")
    assert all(t.reward == 1.0 for t in demos)  # every segment of a solved episode carries its reward
    assert len({t.session for t in demos}) < len(demos)  # the expert compacts too: its episodes are several segments
    straight, resumed = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                         for name in ("straight", "resumed"))
    assert any(row.get("segments_per_episode", 1) > 1 and row["mean_summary_tokens"] > 0 for row in straight)
    assert any("loss" in row for row in straight)  # trained on segments
    for key in ("sampled_tokens", "segments_per_episode", "mean_summary_tokens", "mean_reward", "loss"):
        assert straight[1].get(key) == pytest.approx(resumed[1].get(key), abs=1e-6), key
