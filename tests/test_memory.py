"""Memory across episodes (ReflexionEnv): the env checker, the note turn through the real rollout engine (masked or
trained), notes at the next reset, and success at attempt k with and without memory."""

import asyncio

import pytest
from transformers import AutoTokenizer

import agentrl
from agentrl.env.memory import NOTES_HEADER, REFLECT_PROMPT, NoteStore, ReflexionEnv
from agentrl.eval.attempts import run_attempts, write_attempts
from agentrl.policy.scripted import ScriptedPolicy
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.rollout.jsonl import read_jsonl
from agentrl.types import Status

MATH = {"max_turns": 4, "kinds": ["expression"], "max_ops": 2, "parser": "react"}
NOTE = "I guessed. Use the calculator before answering."


def test_the_wrapper_passes_the_env_checker():
    assert agentrl.check("memory/reflexion-v0", env="math/arith-v0", env_kwargs=MATH) == []


def answer_from_notes(env: ReflexionEnv):
    """A policy that answers 123456 without a note (never right), writes NOTE when asked, and plays the gold
    solution once a note opens the episode."""
    def respond(prompt: str, turn: int) -> str:
        if REFLECT_PROMPT in prompt[-len(REFLECT_PROMPT) - 64:]:
            return NOTE
        if NOTES_HEADER in prompt:
            task = next(t for t in env.tasks if t.data["question"] in prompt)
            return env.gold_actions(task)[turn]
        return "Final Answer: 123456"
    return respond


@pytest.mark.parametrize("train_notes", [False, True])
def test_a_failed_episode_writes_a_note_that_the_next_reset_shows(tiny_model_dir, train_notes):
    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    store = NoteStore(max_notes=2)
    make = lambda: ReflexionEnv("math/arith-v0", MATH, split="heldout", store=store, train_notes=train_notes)  # noqa: E731
    env = make()
    task = env.tasks[0]
    policy = ScriptedPolicy(renderer, answer_from_notes(env), renderer.generation_prompt)
    engine = RolloutEngine(make, policy, renderer, RolloutConfig(max_total_tokens=2048))
    try:
        [first] = asyncio.run(engine.run([task]))
        [second] = asyncio.run(engine.run([task]))
    finally:
        engine.close()
    failed, solved = first.trajectories[0], second.trajectories[0]
    assert failed.status is Status.OK and failed.reward == 0.0 and failed.answer == "123456"
    assert len(failed.turns) == 2 and store.notes(task.id) == [NOTE]  # the answer, then the note
    note = failed.turns[1]
    assert renderer.decode(failed.token_ids[note.start:note.end]).startswith(NOTE)
    assert set(failed.loss_mask[note.start:note.end]) == {int(train_notes)}
    answer = failed.turns[0]
    assert set(failed.loss_mask[answer.start:answer.end]) == {1}  # the attempt itself is trained either way
    assert failed.metrics.get("untrained_tokens", 0) == (0 if train_notes else note.end - note.start)
    assert NOTES_HEADER in renderer.decode(solved.token_ids[:solved.prompt_len])
    assert solved.reward == 1.0 and len(solved.turns) == 2 and store.notes(task.id) == [NOTE]  # success: no note


def test_the_store_keeps_the_latest_notes_and_is_shared_by_name():
    store = NoteStore.named("test-memory", max_notes=2)
    for note in ("a", "b", "c"):
        store.add("t", note)
    assert store.notes("t") == ["b", "c"] and store.notes("other") == [] and len(store) == 2
    assert NoteStore.named("test-memory", max_notes=2) is store
    with pytest.raises(ValueError, match="keeps 2 notes"):
        NoteStore.named("test-memory", max_notes=3)
    envs = [ReflexionEnv("math/arith-v0", MATH, split=split, store="by-split")
            for split in ("train", "heldout", "train")]
    assert envs[0].store is envs[2].store is not envs[1].store  # a named store per split


def test_success_at_attempt_k_with_and_without_memory(tiny_model_dir, tmp_path):
    """The scripted policy fails every first attempt and solves a task only with its note: memory gives success@2 =
    1, plain attempts never succeed."""
    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    env = ReflexionEnv("math/arith-v0", MATH, split="heldout")
    tasks = list(env.tasks[:5])
    policy = ScriptedPolicy(renderer, answer_from_notes(env), renderer.generation_prompt)
    rollout = RolloutConfig(max_total_tokens=2048)
    runs = {f"scripted {c}": run_attempts("math/arith-v0", MATH, "heldout", tasks, 3, policy, renderer, rollout,
                                         c == "memory", trajectories=tmp_path / c / "trajectories.jsonl")
            for c in ("plain", "memory")}
    plain, memory = runs["scripted plain"], runs["scripted memory"]
    assert plain["success_at"] == [0.0, 0.0, 0.0] and plain["attempts"] == 15 and "notes" not in plain
    assert memory["success_at"] == [0.0, 1.0, 1.0] and memory["attempts"] == 10 and memory["notes"] == 5
    assert set(memory["solved_at"].values()) == {2}
    played = read_jsonl(tmp_path / "memory" / "trajectories.jsonl")
    assert [t.logs["attempt"] for t in played] == [1] * 5 + [2] * 5
    assert [t.reward for t in played] == [0.0] * 5 + [1.0] * 5
    md, png = write_attempts(tmp_path, runs, {"env": "math/arith-v0", "split": "heldout", "tasks": 5, "k": 3,
                                              "temperature": 1.0})
    assert "| scripted memory | 0.000 | 1.000 | 1.000 | 5 | 0 |" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"
