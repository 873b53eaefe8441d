"""Other libraries' envs here, ours there: Gymnasium, TextArena, SkyRL-Gym, verifiers and OpenEnv envs through agentrl's
rollout engine with exact-token trajectories; agentrl envs served over OpenEnv's protocol and driven by
OpenEnv's own client; an agentrl env in TRL's GRPOTrainer; and the one conformance suite for all of them."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn
from openenv.core import GenericEnvClient
from transformers import AutoTokenizer

import agentrl
from agentrl.env.adapters.openenv_server import build_app
from agentrl.env.adapters.trl_env import trl_dataset, trl_environment
from agentrl.env.conformance import conformance
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.types import Status

RG_ENV = "verifiers.envs.integrations.reasoninggym_env:ReasoningGymEnv"
ADAPTED = ["gymnasium/FrozenLake-v1", "textarena/GuessTheNumber-v0", "skyrl/gsm8k-v0", "skyrl/gsm8k_multi_turn-v0",
           "verifiers/arith-tools-v0", "verifiers/guess-v0"]


@pytest.fixture(scope="module")
def math_server():
    """agentrl's math env behind an OpenEnv server on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app("math/arith-v0", max_sessions=8, n_tasks=16), port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def play_gold(make_env, renderer, tasks):
    """One episode at a time; its turns come from the env's own scripted solution, computed live from the env
    in play (as a policy reads its observations)."""
    made, plays = [], []

    def make():
        made.append(make_env())
        return made[-1]

    def respond(prompt: str, turn: int) -> str:
        if turn == 0:  # the engine has just reset the latest env
            plays.append(iter(made[-1].gold_actions(made[-1].task)))  # a list or a live generator
        return next(plays[-1])

    policy = ScriptedPolicy(renderer, respond, "<|im_start|>assistant")
    engine = RolloutEngine(make, policy, renderer, RolloutConfig(concurrency=1, max_turns=30, max_total_tokens=8192))
    try:
        return [g.trajectories[0] for g in asyncio.run(engine.run(tasks))]
    finally:
        engine.close()


@pytest.mark.parametrize("env_id", ADAPTED + ["math/arith-v0", "search/tools-v0"])
def test_conformance(env_id):
    assert conformance(lambda: agentrl.make(env_id)) == []


def test_conformance_finds_a_broken_env():
    class Broken(agentrl.make("math/arith-v0").__class__):
        def step(self, action):
            if "junk" in action:
                raise RuntimeError("crashed on junk")
            return super().step(action)

    problems = conformance(lambda: Broken(n_tasks=8))
    assert any("raised RuntimeError: crashed on junk" in p for p in problems), problems


@pytest.mark.parametrize("env_id", ADAPTED)
def test_adapted_envs_roll_out_with_exact_tokens(env_id, renderer):
    env = agentrl.make(env_id)
    tasks = list(env.tasks)[:3]
    trajectories = play_gold(lambda: agentrl.make(env_id), renderer, tasks)
    for t in trajectories:
        assert t.status == Status.OK and t.reward == pytest.approx(env.max_reward) and len(t.turns) >= 1, t.reason
        spans = {i for turn in t.turns for i in range(turn.start, turn.end)}
        assert [i for i, m in enumerate(t.loss_mask) if m] == sorted(spans)  # mask exactly on sampled tokens
        first = list(itertools.takewhile(lambda m: m.role != "assistant", t.messages))
        assert list(t.token_ids[:t.prompt_len]) == renderer.prompt_ids(first, env.tool_schemas or None)  # rendered


def test_verifiers_tool_env_sees_openai_tool_calls_and_scores_with_its_rubric():
    """The ToolEnv gets the model's Hermes call as an OpenAI tool call, runs its tool, and its rubric scores the
    rollout: reward and metrics come from verifiers, not from agentrl."""
    env = agentrl.make("verifiers/arith-tools-v0")
    task = env.tasks[0]  # Compute 2 - 17 - 13.
    env.reset(options={"task": task})
    obs, reward, done, _, info = env.step(task.data["info"]["gold"][0])
    assert not done and obs[0].role == "tool" and obs[0].content == "-28"
    call = env.state["trajectory"][-1]["completion"][0]["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "2 - 17 - 13"}'}
    assert obs[0].tool_call_id == call["id"]
    _, reward, done, _, info = env.step("<answer>-27</answer>")  # wrong: the rubric says 0
    assert done and reward == 0.0 and info["reward_components"]["exact_answer"] == 0.0
    assert info["reward_components"]["calculator_calls"] == 1.0 and info["reason"] == "stop: no_tools_called"


def test_verifiers_malformed_call_is_corrected_and_env_errors_are_status_error(renderer, monkeypatch):
    env = agentrl.make("verifiers/arith-tools-v0")
    env.reset(options={"task": env.tasks[0]})
    obs, _, done, _, _ = env.step("<tool_call>\n{calculator: 1}\n</tool_call>")
    assert not done and obs[0].content.startswith("Invalid action: Invalid JSON in <tool_call>")
    assert env.state["trajectory"] == []  # the env never saw the malformed turn

    import verifiers as vf

    async def sandbox_died(*args, **kwargs):
        raise vf.InfraError("sandbox died")

    monkeypatch.setattr(agentrl.make("verifiers/guess-v0").inner, "env_response", sandbox_died)
    [t] = play_gold(lambda: agentrl.make("verifiers/guess-v0"), renderer, [agentrl.make("verifiers/guess-v0").tasks[1]])
    assert t.status == Status.ERROR and t.reason == "InfraError: sandbox died"


def test_verifiers_own_reasoning_gym_env_through_the_rollout_engine(renderer):
    """verifiers' own ReasoningGymEnv (a SingleTurnEnv with an XML parser and its rubric), played through the
    engine: right answers get the rubric's 1, wrong ones 0, tokens exact."""
    make = lambda: agentrl.make("verifiers/env-v0", environment=RG_ENV,  # noqa: E731
                                env_args={"gym": "basic_arithmetic", "num_train_examples": 6, "num_eval_examples": 2})
    env = make()
    rg = env.inner.rg_dataset
    entries = [rg[int(t.data["answer"])] for t in env.tasks]
    replies = [e["answer"] if i % 2 == 0 else "I do not know" for i, e in enumerate(entries)]
    scripts = {e["question"]: [f"<answer>{r}</answer>"] for e, r in zip(entries, replies)}
    policy = ScriptedPolicy(renderer, playing(scripts), "<|im_start|>assistant")
    engine = RolloutEngine(make, policy, renderer, RolloutConfig(concurrency=3, max_turns=2, max_total_tokens=4096))
    try:
        trajectories = [g.trajectories[0] for g in asyncio.run(engine.run(list(env.tasks)))]
    finally:
        engine.close()
    assert [t.reward for t in trajectories] == [1.0, 0.0] * 3  # reasoning-gym's score_answer, via the rubric
    for t in trajectories:
        assert t.status == Status.OK and t.reward_components["check_answer_reward_func"] == t.reward
        [turn] = t.turns
        assert [i for i, m in enumerate(t.loss_mask) if m] == list(range(turn.start, turn.end))
        assert list(t.token_ids[:t.prompt_len]) == renderer.prompt_ids(t.messages[:2], None)


def group_scored_env():
    """A verifiers env whose rubric ranks the rollouts of a group: not adaptable to per-episode scoring."""
    import verifiers as vf
    from datasets import Dataset

    def best_of_group(completions, **kwargs) -> list[float]:
        return [1.0] + [0.0] * (len(completions) - 1)

    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "2+2?", "answer": "4"}]),
                            rubric=vf.Rubric(funcs=[best_of_group]))


def test_verifiers_env_with_group_rewards_is_refused_with_a_message():
    with pytest.raises(ValueError, match="group-level reward functions \\(best_of_group\\)"):
        agentrl.make("verifiers/env-v0", environment="test_adapters:group_scored_env")


def test_our_env_over_openenv_with_openenv_client(math_server):
    """OpenEnv's own client plays an agentrl env: reset to a task, the gold turns, the env's reward."""
    env = agentrl.make("math/arith-v0", n_tasks=16)
    task = env.tasks[5]
    with GenericEnvClient(base_url=math_server).sync() as client:
        result = client.reset(seed=0, task_index=5)
        assert result.observation["messages"][1]["content"] == env.first_messages(task)[1].content
        assert result.observation["metadata"]["task_id"] == task.id
        for action in env.gold_actions(task):
            result = client.step({"text": action})
        assert result.done and result.reward == 1.0
        assert result.observation["metadata"]["info"]["reward_components"] == {"outcome": 1.0, "process": 1.0}


def test_openenv_server_runs_concurrent_sessions(math_server):
    env = agentrl.make("math/arith-v0", n_tasks=16)

    def episode(i: int) -> float:
        with GenericEnvClient(base_url=math_server).sync() as client:
            client.reset(seed=0, task_index=i)
            for action in env.gold_actions(env.tasks[i]):
                result = client.step({"text": action})
                time.sleep(0.05)  # keep the sessions open together
            return result.reward

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(episode, range(6))) == [1.0] * 6


def test_openenv_env_through_the_rollout_engine(math_server, renderer):
    """The OpenEnv adapter (in) against our server (out): same rewards as the env in-process, exact tokens."""
    local = agentrl.make("math/arith-v0", n_tasks=16)
    gold = {t.data["question"]: t for t in local.tasks}

    def solver(messages):
        task = next(t for q, t in gold.items() if q in messages[1].content)
        return local.gold_actions(task)[sum(m.role == "assistant" for m in messages)]

    make = lambda: agentrl.make("openenv/remote-v0", url=math_server, agentrl_server=True, solver=solver)  # noqa: E731
    tasks = list(make().tasks)[:4]
    trajectories = play_gold(make, renderer, tasks)
    assert [t.reward for t in trajectories] == [1.0] * 4 and all(t.status == Status.OK for t in trajectories)
    for t in trajectories:
        spans = {i for turn in t.turns for i in range(turn.start, turn.end)}
        assert [i for i, m in enumerate(t.loss_mask) if m] == sorted(spans)
        assert t.messages[1].content == local.first_messages(local.tasks[int(t.task_id.rsplit("/", 1)[1])])[1].content


def test_trl_environment_plays_the_env():
    cls = trl_environment("search/tools-v0")
    rows = trl_dataset("search/tools-v0", n=3)
    env = agentrl.make("search/tools-v0")
    tasks = {t.id: t for t in env.tasks}
    for row in rows:
        trl_env = cls()
        trl_env.reset(**row)
        for call in [env.parser.parse(a).tool_calls[0] for a in env.gold_actions(tasks[row["task_id"]])]:
            response = getattr(trl_env, call.name)(**call.arguments)
        assert trl_env.get_reward() == 1.0 and trl_env.done, response
    assert trl_env.search("anything") == "The episode is over."


@pytest.mark.slow
def test_trl_grpo_trainer_takes_a_step_on_an_agentrl_env(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "left"
    tokenizer.response_template = qwen3_template  # our tiny model's template is ChatML with Qwen's <tool_call>
    resets = []
    base = trl_environment("search/tools-v0")

    class Counted(base):
        def reset(self, **row):
            resets.append(row["task_id"])
            return super().reset(**row)

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=24, max_tool_calling_iterations=2,
                      report_to="none", save_strategy="no", use_vllm=False, logging_steps=1)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), processing_class=tokenizer,
                          args=args, train_dataset=Dataset.from_list(trl_dataset("search/tools-v0", n=8)),
                          environment_factory=Counted)
    assert trainer.reward_func_names == ["Counted"]
    assert sorted(t.__name__ for t in trainer.tools) == ["answer", "open", "search"]
    trainer.train()
    assert trainer.state.global_step == 1 and len(resets) >= 4
    assert any("reward" in k for k in trainer.state.log_history[0])
