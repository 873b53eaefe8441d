"""MCP tools against real MCP servers written with the official SDK (tests/data/mcp_server.py over stdio and over
streamable HTTP; examples/mcp/calculator_server.py): listing, schemas in the chat template, calls, the model's
mistakes, server errors, timeouts, a server that dies mid-episode, servers per episode, and `mcp/tools-v0`.
(That a stdio server and its children end with a SIGKILLed owner: test_lifetime.py.)"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

import agentrl
from agentrl.envs.math import ArithmeticEnv
from agentrl.envs.mcp import McpToolsEnv, load_tasks
from agentrl.policy import scripted
from agentrl.policy.vllm_server import free_port
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.system.lifetime import ProcessGroup
from agentrl.tools import ToolArgumentError, ToolError, ToolSet, ToolTimeout
from agentrl.tools.mcp import McpServer, McpTools, close_pooled, pool, untitled
from agentrl.types import Status, ToolCall

ROOT = Path(__file__).resolve().parents[1]
TESTING = [sys.executable, str(ROOT / "tests" / "data" / "mcp_server.py")]
CALCULATOR = [sys.executable, str(ROOT / "examples" / "mcp" / "calculator_server.py")]


def spec(**fields) -> dict:
    return {"name": "testing", "command": TESTING, **fields}


@pytest.fixture(scope="module")
def tools():
    return {t.name: t for t in McpTools([spec(timeout=2.0, max_result_chars=1000)])}


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """The testing server over streamable HTTP, started as a user would start it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("mcp") / "http.log", "w")
    group = ProcessGroup([*TESTING, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    group.stop(timeout=5)


def test_the_server_tools_are_listed_with_their_schemas_in_openai_format(tools):
    assert list(tools) == ["add", "refuse", "busy", "sleep", "flood", "count", "spawn", "crash"]
    function = tools["add"].schema["function"]
    assert tools["add"].schema["type"] == "function" and function["name"] == "add"
    assert function["description"] == "Add two integers."
    assert function["parameters"]["properties"]["a"]["type"] == "integer"
    assert function["parameters"]["required"] == ["a", "b"]
    assert "title" not in function["parameters"] and "title" not in function["parameters"]["properties"]["a"]


def test_title_annotations_leave_the_prompt_but_properties_named_title_stay():
    schema = {"title": "Args", "type": "object", "required": ["title"],
              "properties": {"title": {"title": "Title", "type": "string"},
                             "tags": {"type": "array", "items": {"title": "Tag", "type": "string"}}}}
    assert untitled(schema) == {"type": "object", "required": ["title"],
                                "properties": {"title": {"type": "string"},
                                               "tags": {"type": "array", "items": {"type": "string"}}}}


def test_the_schemas_reach_the_prompt_through_the_chat_template(tiny_model_dir):
    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    env = ArithmeticEnv(n_tasks=2, extra_tools=McpTools([spec(tools=["add", "refuse"])]))
    messages, info = env.reset(seed=0)
    prompt = renderer.decode(renderer.prompt_ids(list(messages), info["tools"]))
    assert '"name": "add"' in prompt and "Add two integers." in prompt and '"name": "refuse"' in prompt
    assert '"name": "calculator"' in prompt and '"name": "sleep"' not in prompt  # beside @tool; only those listed


def test_calls_return_text_and_the_models_mistakes_are_caught_before_sending(tools):
    assert tools["add"].run({"a": 2, "b": 40}) == "42"
    with pytest.raises(ToolArgumentError, match="argument 'a': '2' is not of type 'integer'"):
        tools["add"].run({"a": "2", "b": 40})
    with pytest.raises(ToolArgumentError, match="'b' is a required property"):
        tools["add"].validate({"a": 1})
    with pytest.raises(ToolArgumentError, match="surrogate"):
        tools["refuse"].validate({"reason": "\ud800"})
    toolset = ToolSet(list(tools.values()))
    assert toolset.check([ToolCall("add", {"a": 1})]) == "Invalid arguments for add: 'b' is a required property"


def test_server_errors_are_observations_and_long_results_are_cut(tools):
    assert tools["refuse"].run({"reason": "no"}) == "Error executing tool refuse: refused: no"
    assert tools["busy"].run({}) == "Error: the server is busy"  # code -32000, the SDK's "connection closed" too
    flood = tools["flood"].run({"chars": 5000})
    assert flood == "x" * 1000 + "\n[... 4000 more characters cut]"


def test_a_call_past_its_timeout_is_a_tool_timeout_and_the_session_lives_on(tools):
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match="'sleep' of server 'testing' timed out after 2s"):
        tools["sleep"].run({"seconds": 30})
    assert time.monotonic() - started < 4
    assert tools["add"].run({"a": 1, "b": 1}) == "2"


def test_a_result_still_arriving_after_its_timeout_does_not_wedge_the_next_call():
    """A 40 MB result outlives its 1 s timeout and held up every later reply of the session (the next call timed out
    too): a session that does not answer after a timeout is reopened."""
    tools = {t.name: t for t in McpTools([spec(name="wedged", timeout=1)])}
    with pytest.raises(ToolTimeout, match="'flood' of server 'wedged' timed out"):
        tools["flood"].run({"chars": 40_000_000})
    assert tools["add"].run({"a": 1, "b": 1}) == "2"
    close_pooled()


def test_streamable_http_servers_answer_like_stdio_ones(http_server):
    remote = {t.name: t for t in McpTools([{"name": "remote", "url": http_server, "prefix": "remote_"}])}
    assert remote["remote_add"].run({"a": 3, "b": 4}) == "7"
    assert remote["remote_add"].schema["function"]["name"] == "remote_add"
    assert remote["remote_refuse"].run({"reason": "http"}).endswith("refused: http")


@pytest.mark.slow
def test_envs_in_one_process_share_a_server_and_per_episode_servers_start_fresh():
    shared_a = {t.name: t for t in McpTools([spec(name="shared")])}
    shared_b = {t.name: t for t in McpTools([spec(name="shared")])}
    assert [int(shared_a["count"].run({})), int(shared_b["count"].run({}))] == [1, 2]  # one server process
    server = int(shared_a["spawn"].run({}).split()[0])
    close_pooled()  # what the process's exit does: the shared servers end
    assert gone(server) and shared_b["count"].run({}) == "1"  # and the next call starts a fresh one

    env = ArithmeticEnv(n_tasks=2, extra_tools=McpTools([spec(name="fresh", per_episode=True)]))
    counts, servers = [], set()
    for episode in range(3):
        env.reset(seed=episode)
        counts += [env.toolset.run(ToolCall("count", {})) for _ in range(2)]
        servers.add(env.toolset.run(ToolCall("spawn", {})).split()[0])
    assert counts == ["1", "2"] * 3 and len(servers) == 3  # a new server each episode
    env.close()
    assert all(gone(int(p)) for p in servers), "a per-episode server outlived its env"


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not Path(f"/proc/{pid}").exists()


def test_a_server_that_dies_mid_episode_ends_it_as_error_and_the_next_episode_reconnects(tiny_model_dir):
    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    make = lambda: ArithmeticEnv(n_tasks=2, extra_tools=McpTools([spec(name="dying")]))  # noqa: E731
    env = make()
    crash, gold = env.tasks
    scripts = {crash.data["question"]: [env.parser.format_call(ToolCall("crash", {}))],
               gold.data["question"]: env.gold_actions(gold)}
    policy = scripted.ScriptedPolicy(renderer, scripted.playing(scripts), renderer.generation_prompt)
    engine = RolloutEngine(make, policy, renderer, RolloutConfig())
    try:
        died = asyncio.run(engine.run([crash]))[0].trajectories[0]
        lived = asyncio.run(engine.run([gold]))[0].trajectories[0]
    finally:
        engine.close()
    assert died.status is Status.ERROR and "ToolError" in died.reason
    assert "MCP server 'dying' failed during a call of 'crash'" in died.reason and "stderr:" in died.reason
    assert lived.status is Status.OK and lived.reward == 1.0
    assert {t.name: t for t in McpTools([spec(name="dying")])}["add"].run({"a": 1, "b": 2}) == "3"


def test_unreachable_servers_and_bad_settings_fail_with_the_reason():
    with pytest.raises(ToolError, match="did not start or answer"):
        McpTools([{"name": "missing", "command": [sys.executable, "-c", "import sys; sys.exit(3)"]}])
    with pytest.raises(ToolError, match="'nowhere' did not start or answer"):
        McpTools([{"name": "nowhere", "url": f"http://127.0.0.1:{free_port()}/mcp", "connect_timeout": 10}])
    with pytest.raises(ValueError, match="exactly one of command .* or url"):
        McpServer("both", command=("x",), url="http://x")
    with pytest.raises(ValueError, match="per_episode needs a command"):
        McpServer("remote", url="http://127.0.0.1:1/mcp", per_episode=True)
    with pytest.raises(ValueError, match=r"unknown keys \['timout'\]"):
        McpServer.of({"name": "typo", "command": ["x"], "timout": 3})
    with pytest.raises(ValueError, match=r"has no tools \['nope'\]"):
        McpTools([spec(tools=["nope"])])
    with pytest.raises(ValueError, match=r"\['add', .*\] are offered by more than one server"):
        McpTools([spec(name="one"), spec(name="two")])


def test_mcp_tools_env_checks_with_the_calculator_server(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples" / "mcp" / "arithmetic_tasks.py"), str(tmp_path / "t.jsonl"),
                    "--train", "8", "--heldout", "4"], check=True, cwd=ROOT)
    kwargs = {"tasks": str(tmp_path / "t.jsonl"), "servers": [{"name": "calc", "command": CALCULATOR}]}
    assert agentrl.check("mcp/tools-v0", **kwargs) == []
    env = agentrl.make("mcp/tools-v0", split="heldout", **kwargs)
    assert len(env.tasks) == 4 and env.tool_schemas[0]["function"]["name"] == "calculator"
    env.reset(seed=0, options={"task": env.tasks[0]})
    _, reward, done, _, info = env.step(env.parser.format_answer(" " + env.tasks[0].data["answer"] + " "))
    assert done and reward == 1.0 and info["reward_components"] == {"outcome": 1.0}
    env.reset(seed=0, options={"task": env.tasks[0]})
    obs, *_ = env.step(env.parser.format_call(ToolCall("calculator", {"expression": "7 / 2 * 2"})))
    assert obs[0].content == "7"  # exact fractions, as math/arith-v0's own calculator
    obs, *_ = env.step(env.parser.format_call(ToolCall("calculator", {"expression": "2 ** 0.5"})))
    assert obs[0].content == "Error executing tool calculator: exponents must be whole numbers up to 8"
    task = env.tasks[0]
    assert env.demonstration(task, random.Random(0), error_rate=0.0) == env.gold_actions(task)
    [slip] = env.demonstration(task, random.Random(0), error_rate=1.0)  # one of the task's mistakes, no tool call
    wrong = {m["answer"] for m in task.data["mistakes"]}
    assert slip.splitlines()[-1].removeprefix("<answer>").removesuffix("</answer>") in wrong


def test_task_files_with_mistakes_are_named_with_the_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: not a task: needs a string 'question' and a string"):
        load_tasks(path, "train")
    path.write_text(json.dumps({"question": "q", "answer": "a", "split": "dev"}) + "\n")
    with pytest.raises(ValueError, match=r"has no tasks of split 'train' \(its splits: \['dev'\]\)"):
        load_tasks(path, "train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        McpToolsEnv(str(tmp_path / "none.jsonl"), [spec()]).tasks


def _add_in_a_fork() -> str:
    return {t.name: t for t in McpTools([spec(name="forked", connect_timeout=20)])}["add"].run({"a": 2, "b": 3})


def test_a_forked_process_gets_its_own_pool(tools):
    """The parent's loop thread does not exist in a fork (Ray and multiprocessing workers): the child needs its own."""
    parent = pool()
    with multiprocessing.get_context("fork").Pool(1) as workers:
        assert workers.apply(_add_in_a_fork) == "5"
    assert pool() is parent
