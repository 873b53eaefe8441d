"""The sandboxes: the runner protocol and output budget, the local runtime, and the Docker runtime with its
security battery (each attack contained, the host unaffected, a clear observation within the timeout) and
its warm pool (bounded, reset between leases, broken sandboxes replaced, nothing leaked)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agentrl.tools.sandbox import Limits, LocalRuntime, RunResult, SandboxError
from agentrl.tools.sandbox.pool import SandboxPool
from agentrl.tools.sandbox import runner
from agentrl.tools.sandbox.runner import Capture

# --- pure parts ---------------------------------------------------------------------------------------------


def test_capture_keeps_head_and_tail_and_states_the_cut():
    c = Capture(8)  # 4 bytes of head, 4 of tail
    for chunk in (b"abc", b"defgh", b"ijkl"):
        c.add(chunk)
    assert (c.head, c.tail, c.total) == (b"abcd", b"ijkl", 12) and c.truncated
    assert c.text() == "abcd\n[... 4 bytes of output truncated ...]\nijkl"
    small = Capture(100)
    small.add(b"hello")
    assert small.text() == "hello" and not small.truncated


def test_observation_says_how_the_run_ended():
    assert RunResult(0, "4\n", "").observation() == "4"
    assert RunResult(0, "", "").observation() == "[no output]"
    failed = RunResult(1, "", "Traceback ...\nValueError: x\n").observation()
    assert failed == "Traceback ...\nValueError: x\n[exit code 1]"
    timed_out = RunResult(None, "partial\n", "", timed_out=True, seconds=3.0).observation()
    assert timed_out == "partial\n[killed: still running after the 3 s timeout]"


def test_a_python_run_that_cannot_fork_is_an_exit_code_not_a_dead_runner(tmp_path, monkeypatch):
    """A process limit (RLIMIT_NPROC) makes the fork fail: the run reports it as a shell would (126), the runner
    lives on, and no pipe is left open."""
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(runner.os, "fork", no_fork)
    result = runner.run(None, "", 5.0, 10_000, kill_all=lambda proc: None, cwd=str(tmp_path), code="print(1)")
    assert result["exit_code"] == 126 and "cannot run 'python': Resource temporarily unavailable" in result["stderr"]
    assert len(os.listdir("/proc/self/fd")) == before


def test_limits_are_validated():
    with pytest.raises(ValueError, match="> 0"):
        Limits(timeout=0)


# --- the local runtime (not isolated; the same runner code) ------------------------------------------------


def test_local_runtime_runs_times_out_and_truncates(tmp_path):
    rt = LocalRuntime(Limits(timeout=2, output_bytes=1000))
    try:
        assert rt.run(code="print(6 * 7)").observation() == "42"
        rt.write("data/x.txt", "hi")
        assert rt.run(code="print(open('data/x.txt').read())").stdout == "hi\n"
        assert rt.read("data/x.txt") == "hi"
        with pytest.raises(PermissionError, match="outside the workspace"):
            rt.read("../../etc/passwd")
        slow = rt.run(code="import time\nprint('started', flush=True)\ntime.sleep(30)")
        assert slow.timed_out and slow.exit_code is None and "started" in slow.stdout and slow.seconds < 5
        loud = rt.run(code="print('x' * 100_000)")
        assert loud.truncated and len(loud.stdout) < 1000 and "bytes of output truncated" in loud.stdout
        assert rt.run(argv=["false"]).exit_code == 1
        rt.reset()
        with pytest.raises(FileNotFoundError):
            rt.read("data/x.txt")
    finally:
        rt.close()


# --- the Docker runtime ------------------------------------------------------------------------------------

docker_only = pytest.mark.docker


@pytest.fixture(scope="module")
def docker_client():
    from agentrl.tools.sandbox.docker_runtime import build_image, client

    c = client()  # a SandboxError here says how to start the daemon
    build_image(docker_client=c)
    return c


@pytest.fixture
def sandbox(docker_client):
    from agentrl.tools.sandbox.docker_runtime import DockerRuntime

    rt = DockerRuntime(Limits(timeout=3, memory_mb=128, pids=32, disk_mb=16, output_bytes=4000),
                       docker_client=docker_client)
    rt.start()
    yield rt
    rt.close()


def own_containers(docker_client):
    from agentrl.tools.sandbox.docker_runtime import LABEL, owner

    return [c for c in docker_client.containers.list(all=True, filters={"label": LABEL}) if c.labels[LABEL] == owner()]


@docker_only
def test_docker_runs_code_as_an_unprivileged_user_in_the_workspace(sandbox):
    r = sandbox.run(code="import os; print(os.getuid(), os.getcwd())")
    assert r.observation() == "1000 /workspace"
    sandbox.write("pkg/mod.py", "X = 5\n")
    assert sandbox.run(code="import sys; sys.path.insert(0, 'pkg'); import mod; print(mod.X)").stdout == "5\n"
    assert sandbox.read("pkg/mod.py") == "X = 5\n"
    assert sandbox.run(argv=["sh", "-c", "echo out; echo err >&2; exit 3"]).observation() == "out\nerr\n[exit code 3]"
    # the process probe the battery relies on does see a process that is alive
    probe = sandbox.run(code="import subprocess, time; subprocess.Popen(['sleep', '7']); time.sleep(0.3)\n"
                        + PROCESSES)
    assert "sleep S sleep 7" in probe.stdout.splitlines(), probe


# The security battery. Each attack must be contained, with a clear observation, within the timeout (3 s).
ATTACKS = {
    "network egress": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('CONNECTED')",
                       lambda r: "CONNECTED" not in r.stdout and r.exit_code != 0 and "Error" in r.stderr),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  lambda r: r.timed_out),
    "memory bomb": ("x = []\nwhile True:\n    x.append(bytearray(10 << 20))",
                    lambda r: r.exit_code != 0 and not r.timed_out),  # OOM-killed or MemoryError, not the runner
    "disk fill": ("f = open('big', 'wb')\nwhile True:\n    f.write(b'0' * (1 << 20))",
                  lambda r: "No space left on device" in r.stderr),
    "infinite loop": ("while True:\n    pass", lambda r: r.timed_out and r.seconds < 5),
    "huge output": ("while True:\n    print('spam' * 1000)",
                    lambda r: r.truncated and len(r.stdout) < 5000 and "truncated" in r.stdout),
    "read host files": ("print(open('/host_secret_probe').read())",
                        lambda r: "FileNotFoundError" in r.stderr),
    "write outside the workspace": ("open('/etc/evil', 'w').write('x')",
                                    lambda r: "Read-only file system" in r.stderr),
    "kill PID 1": ("import os, signal\nfor s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):\n"
                   "    os.kill(1, s)\nprint('still here')", lambda r: r.stdout == "still here\n"),
    "privilege escalation": ("import os\nos.setuid(0)\nprint('ROOT')",
                             lambda r: "ROOT" not in r.stdout and "PermissionError" in r.stderr),
    "sleep past the timeout": ("import time\ntime.sleep(60)", lambda r: r.timed_out and r.seconds < 5),
    "background process outliving the call": (
        "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 1; echo leaked > /workspace/leak'], "
        "start_new_session=True)\nprint('spawned')", lambda r: r.stdout == "spawned\n"),
}


@docker_only
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_security_battery(sandbox, attack, tmp_path):
    code, contained = ATTACKS[attack]
    if attack == "read host files":  # a real host file, at a path the sandbox tries to open
        probe = tmp_path / "host_secret_probe"
        probe.write_text("secret")
        code = code.replace("/host_secret_probe", str(probe))
    started = time.monotonic()
    result = sandbox.run(code=code)
    assert time.monotonic() - started < 3 + 5, "the call must return within the timeout (plus grace)"
    assert contained(result), (attack, result)
    assert result.observation()  # always something the model can read
    # the sandbox is still usable, and nothing of the attack survives the call
    time.sleep(1.5)  # what a surviving background process would need to write its file
    assert other_processes(sandbox) == []
    assert sandbox.run(argv=["ls", "/workspace"]).stdout.strip() in ("", "big")  # no `leak`
    assert not os.path.exists("/etc/evil")


# "name state command line" of every process but the runner (PID 1) and the probe itself; the name and
# state come from /proc/PID/stat, which a process has even before exec or as a zombie.
PROCESSES = ("import os\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) not in (1, os.getpid()):\n"
             "        stat = open(f'/proc/{p}/stat').read()\n"
             "        cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(bytes(1), b' ').decode().strip()\n"
             "        print(stat[stat.index('(') + 1:stat.rindex(')')], stat[stat.rindex(')') + 2], cmd)")


def other_processes(sandbox) -> list[str]:
    """The processes in the container besides the runner (PID 1) and this probe."""
    return sandbox.run(code=PROCESSES).stdout.splitlines()


@docker_only
def test_a_killed_container_is_a_sandbox_error_and_the_pool_replaces_it(docker_client):
    from agentrl.tools.sandbox.docker_runtime import DockerRuntime

    pool = SandboxPool(lambda: DockerRuntime(Limits(timeout=3), docker_client=docker_client), size=2, warm=False)
    try:
        rt = pool.acquire()
        rt.container.kill()
        with pytest.raises(SandboxError, match="died"):
            rt.run(code="print(1)")
        pool.release(rt)  # its reset fails: closed and replaced
        assert pool.replaced == 1
        with pool.lease() as fresh:
            assert fresh.run(code="print(1)").stdout == "1\n"
    finally:
        pool.close()


@docker_only
def test_pool_is_bounded_resets_between_leases_and_leaks_nothing(docker_client):
    from agentrl.tools.sandbox.docker_runtime import DockerRuntime

    before = len(own_containers(docker_client))
    pool = SandboxPool(lambda: DockerRuntime(Limits(timeout=3), docker_client=docker_client), size=2)
    try:
        a, b = pool.acquire(), pool.acquire()
        with pytest.raises(SandboxError, match="busy"):
            pool.acquire(timeout=0.5)
        a.write("state.txt", "from the last episode")
        a.run(code="import os, subprocess; subprocess.Popen(['sleep', '100']); os.makedirs('/tmp/d')\n"
                   "open('/tmp/left.txt', 'w').write('for the next episode')")
        assert a.run(argv=["ls", "-A", "/tmp"]).stdout.split() == ["d", "left.txt"]  # the program is not on disk
        pool.release(a)
        c = pool.acquire()  # a reset sandbox: empty workspace and /tmp, no processes
        assert c.run(argv=["ls", "-A", "/workspace", "/tmp"]).stdout == "/tmp:\n\n/workspace:\n"
        assert other_processes(c) == []
        assert len(own_containers(docker_client)) - before == 2
        pool.release(b)
        pool.release(c)
    finally:
        pool.close()
    time.sleep(1)
    assert len(own_containers(docker_client)) == before


@docker_only
def test_containers_end_with_the_process_that_made_them(docker_client, tmp_path):
    """SIGKILL the owner mid-run: the runner sees its stdin close and the container removes itself."""
    script = tmp_path / "owner.py"
    script.write_text("from agentrl.tools.sandbox.docker_runtime import DockerRuntime\n"
                      "rt = DockerRuntime(); rt.start(); print(rt.container.id, flush=True)\n"
                      "rt.run(code='import time; time.sleep(60)', timeout=60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    container_id = proc.stdout.readline().strip()
    time.sleep(1)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and docker_client.containers.list(all=True, filters={"id": container_id}):
        time.sleep(0.5)
    assert not docker_client.containers.list(all=True, filters={"id": container_id})


# --- state across resets, and the runner's own files (#33) ------------------------------------------------
PLANT_IPC = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(0x1234, 8 << 20, 0o1666)
ctypes.memset(libc.shmat(shm, None, 0), 1, 8 << 20)  # touched: its pages are held
libc.msgget(0x1235, 0o1666); libc.semget(0x1236, 1, 0o1666)
os.open("/dev/mqueue/q", os.O_CREAT | os.O_RDWR, 0o600)
open("/dev/shm/hidden_tests.py", "w").write("the hidden tests")
print(open("/proc/sysvipc/shm").read().count("\n") - 1, "segment")
"""


def ipc_objects(sandbox) -> list[str]:
    listing = sandbox.run(argv=["sh", "-c", "tail -qn +2 /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem; "
                                            "ls -A /dev/shm /dev/mqueue"]).stdout
    return [line for line in listing.splitlines() if line.strip() and not line.endswith(":")]


@docker_only
def test_a_reset_puts_back_what_a_run_changed_about_the_runner(sandbox):
    """Code runs as the runner's user, so it reaches PID 1 (prlimit, setpriority), whose every later fork inherits
    the change: a limit written by one episode was read back by the next, and RLIMIT_NPROC = 1 failed the next
    episodes' runs. A reset puts the limits back; what it cannot (a priority lowered) fails the reset, and the pool
    replaces the sandbox."""
    probe = "import os, resource; print(resource.getrlimit(resource.RLIMIT_NOFILE), os.getpriority(0, 0))"
    before = sandbox.run(code=probe).stdout
    sandbox.run(code="import resource\nfor r, soft in ((resource.RLIMIT_NOFILE, 42), (resource.RLIMIT_NPROC, 1)):\n"
                     "    resource.prlimit(1, r, (soft, resource.prlimit(1, r)[1]))")
    assert sandbox.run(code=probe).exit_code == 126  # inherited: the runner cannot fork
    sandbox.reset()
    assert sandbox.run(code=probe).stdout == before
    sandbox.run(code="import os; os.setpriority(0, 1, 10)")
    with pytest.raises(SandboxError, match=r"changed the runner's own nice 10 \(was 0\)"):
        sandbox.reset()


@docker_only
def test_a_reset_leaves_no_shared_memory_queues_or_files(sandbox):
    assert sandbox.run(code=PLANT_IPC).stdout == "1 segment\n"
    assert len(ipc_objects(sandbox)) == 5  # shm, msg, sem, the queue, the file
    sandbox.reset()
    assert ipc_objects(sandbox) == []


@docker_only
def test_memory_pinned_in_shared_memory_is_freed_by_a_reset(docker_client):
    """A segment that no process holds survives every kill; 440 MB of it made the next lease's allocation die."""
    from agentrl.tools.sandbox.docker_runtime import DockerRuntime

    rt = DockerRuntime(Limits(timeout=20, memory_mb=512), docker_client=docker_client)
    rt.start()
    try:
        pin = PLANT_IPC.replace("8 << 20", "300 << 20")
        assert rt.run(code=pin).stdout == "1 segment\n"
        rt.reset()  # does not raise: the memory came back
        grown = rt.run(code="x = bytearray(300 << 20); print(len(x) >> 20)")
        assert grown.stdout == "300\n", grown.observation()
    finally:
        rt.close()


@docker_only
def test_only_the_reset_places_are_writable(sandbox):
    found = sandbox.run(argv=["sh", "-c", "find / \\( -path /proc -o -path /sys \\) -prune -o -writable "
                                          "\\( -type d -o -type f \\) -print 2>/dev/null; true"], timeout=20).stdout
    allowed = ("/workspace", "/tmp", "/dev/shm", "/dev/mqueue")
    assert [p for p in found.split() if not p.startswith(allowed)] == []


@docker_only
@pytest.mark.parametrize("squat", ["os.mkdir('/tmp/agentrl_main.py')", "os.mkfifo('/tmp/agentrl_main.py')",
                                   "open('/tmp/fill', 'wb').write(bytes(15 << 20))"])
def test_the_runner_program_path_cannot_be_taken_from_it(sandbox, squat):
    sandbox.run(code=f"import os\n{squat}")
    assert sandbox.run(code="print(6 * 7)").stdout == "42\n"
    failed = sandbox.run(code="def f():\n    raise ValueError('x')\nf()")
    assert "raise ValueError('x')" in failed.stderr  # tracebacks still show the source


@docker_only
def test_unread_stdin_does_not_hold_the_runner_past_the_deadline(sandbox):
    start = time.monotonic()
    result = sandbox.run(argv=["sh", "-c", "echo started; sleep 60"], stdin="x" * (1 << 20), timeout=2)
    assert result.timed_out and result.stdout == "started\n" and time.monotonic() - start < 6
    assert sandbox.run(argv=["wc", "-c"], stdin="x" * (1 << 20)).stdout.strip() == str(1 << 20)
    assert sandbox.run(argv=["true"], stdin="x" * (1 << 20)).ok  # a program that exits without reading


@docker_only
def test_fifos_oversized_arguments_and_inode_floods_are_the_programs_problem(sandbox):
    sandbox.run(code="import os; os.mkfifo('pipe')")
    for call in (lambda: sandbox.read("pipe"), lambda: sandbox.write("pipe", "x")):
        start = time.monotonic()
        with pytest.raises(OSError, match="not a regular file|No such device"):  # never a hang
            call()
        assert time.monotonic() - start < 2
    long = sandbox.run(argv=["bash", "-c", "echo " + "x" * 200_000])
    assert long.exit_code == 126 and "Argument list too long" in long.stderr
    nul = sandbox.run(argv=["bash", "-c", "echo a\x00b"])
    assert nul.exit_code == 126 and "embedded null byte" in nul.stderr
    flood = sandbox.run(code="import os\nfor i in range(700_000):\n    open(f'f{i}', 'w').close()", timeout=20)
    assert "No space left on device" in flood.stderr
    sandbox.reset()
    assert sandbox.healthy() and sandbox.run(code="print('alive')").stdout == "alive\n"
