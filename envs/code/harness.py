"""Hidden tests, run in the sandbox: how many of a task's tests a submitted solution passes.

A task's tests are HumanEval's format: a `check(candidate)` function. Each top-level statement of its body
that contains an `assert` of something that can vary is one test (a loop of asserts is one); the other
statements, constant asserts like HumanEval's `assert True, "..."` among them, are setup and run in order, so
one failing assert does not hide the others and a solution that does nothing passes no test.

Two processes, so that the submission cannot forge its grade. The *tester* (`TESTER`, a fixed program; the
task comes on its stdin, so nothing secret is on disk) runs the prompt's helpers and the tests. The
*solution* runs in a child process that it starts: the child loads the prompt and the submission and
answers calls, and only values come back (None, bools, numbers, strings, bytes, and lists, tuples, sets and
dicts of them, tagged in JSON), so a returned object cannot fake an `==` and the submission never sees the
tests, the tester's variables or its output. The tester makes itself non-dumpable (as the sandbox's runner
does), so the child cannot open its `/proc` files either, and prints one JSON line marked with a per-run
nonce; the child's prints go nowhere.
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass

from agentrl.tools.sandbox import RunResult

MARKER = "AGENTRL_TESTS"


def split_check(test_source: str) -> tuple[str, list[tuple[bool, str]]]:
    """(the test module without `check`, [(is_test, statement source)] of check's body)."""
    module = ast.parse(test_source)
    check = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        raise ValueError("the tests define no `check(candidate)` function")
    prelude = ast.unparse(ast.Module([n for n in module.body if n is not check], type_ignores=[]))
    statements = [(any(isinstance(n, ast.Assert) and varies(n.test) for n in ast.walk(s)), ast.unparse(s))
                  for s in check.body]
    if not any(is_test for is_test, _ in statements):
        raise ValueError("check(candidate) holds no assert")
    return prelude, statements


def varies(expression: ast.expr) -> bool:
    """Whether an expression reads any name (a variable, a call): `assert True` or `assert 1 == 1` tests nothing."""
    return any(isinstance(n, ast.Name) for n in ast.walk(expression))


# Values cross between the two processes as JSON with type tags (both programs include this).
CODEC = r"""
def encode(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return {"int": str(v)}
    if isinstance(v, float):
        return {"float": repr(v)}
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    for kind in (list, tuple, set, frozenset):
        if isinstance(v, kind):
            return {kind.__name__: [encode(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[encode(k), encode(x)] for k, x in v.items()]}
    raise TypeError(f"a {type(v).__name__} cannot pass between the tests and the solution")

def decode(v):
    if not isinstance(v, dict):
        return v
    (kind, x), = v.items()
    if kind == "int":
        return int(x)
    if kind == "float":
        return float(x)
    if kind == "bytes":
        return bytes.fromhex(x)
    if kind == "dict":
        return {decode(k): decode(y) for k, y in x}
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](decode(y) for y in x)
"""

# The solution's process: load the prompt and the submission, then answer one call per stdin line.
SOLUTION = r"""
import json, os, sys
channel = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the submission's prints go nowhere
sys.stdout = open(os.devnull, "w")

CODEC
task = json.loads(sys.stdin.readline())
try:
    ns = {}
    exec(compile(task["prompt"], "prompt.py", "exec"), ns)
    ns.pop(task["entry_point"], None)  # the stub: the solution must define the function itself
    exec(compile(task["solution"], "solution.py", "exec"), ns)
    candidate = ns[task["entry_point"]]
    reply = {"ok": True}
except BaseException as e:
    reply = {"error": f"{type(e).__name__}: {e}"}
channel.write(json.dumps(reply) + "\n")
channel.flush()
for line in sys.stdin:
    args, kwargs = json.loads(line)
    try:
        reply = {"value": encode(candidate(*map(decode, args), **{k: decode(v) for k, v in kwargs.items()}))}
    except BaseException as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    channel.write(json.dumps(reply) + "\n")
    channel.flush()
"""

# The tester: the trusted half. Its task (nonce, prompt, submission, tests) arrives on stdin.
TESTER = r"""
import ctypes, json, subprocess, sys
task = json.loads(sys.stdin.read())
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the solution cannot open our /proc files
except (OSError, AttributeError):
    pass
nonce, statements = task["nonce"], task["statements"]
total = sum(is_test for is_test, _ in statements)

def report(passed, error=""):
    print("\n" + MARKER, nonce, json.dumps({"passed": passed, "total": total, "error": error}), flush=True)
    raise SystemExit(0)

CODEC
solution = subprocess.Popen([sys.executable, "-c", SOLUTION], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)

def ask(message):
    solution.stdin.write(json.dumps(message) + "\n")
    solution.stdin.flush()
    line = solution.stdout.readline()
    if not line:
        raise RuntimeError("the solution's process died")
    return json.loads(line)

loaded = ask({"prompt": task["prompt"], "solution": task["solution"], "entry_point": task["entry_point"]})
if "error" in loaded:
    report(0, "the solution does not load: " + loaded["error"])

def candidate(*args, **kwargs):
    reply = ask([[encode(a) for a in args], {k: encode(v) for k, v in kwargs.items()}])
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return decode(reply["value"])

env = {}
exec(compile(task["prompt"], "prompt.py", "exec"), env)  # the prompt's imports and helpers (trusted)
exec(compile(task["prelude"], "tests.py", "exec"), env)
env["candidate"] = env[task["entry_point"]] = candidate  # some tests name it (HumanEval/33)
passed, error = 0, ""
for is_test, src in statements:
    try:
        exec(compile(src, "tests.py", "exec"), env)
        passed += is_test
    except BaseException as e:
        error = error or f"{type(e).__name__}: {e}"[:300]
        if not is_test:
            break
report(passed, error)
""".replace("MARKER", repr(MARKER)).replace("SOLUTION", repr(SOLUTION.replace("CODEC", CODEC))).replace(
    "CODEC", CODEC)


@dataclass(frozen=True)
class TestReport:
    passed: int
    total: int
    error: str = ""

    @property
    def fraction(self) -> float:
        """The fraction of the tests passed (0 when there are none)."""
        return self.passed / self.total if self.total else 0.0


def run_tests(sandbox, prompt: str, solution: str, entry_point: str, test_source: str,
              timeout: float) -> TestReport:
    """Run the hidden tests on `solution` in `sandbox` and report how many pass.

    A run that prints no report (a timeout, a crash) counts as 0 of the tests passed, with the reason in `error`."""
    nonce = secrets.token_hex(8)
    prelude, statements = split_check(test_source)
    task = {"nonce": nonce, "prompt": prompt, "solution": solution, "entry_point": entry_point,
            "prelude": prelude, "statements": statements}
    result: RunResult = sandbox.run(code=TESTER, stdin=json.dumps(task), timeout=timeout)
    total = sum(is_test for is_test, _ in statements)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(f"{MARKER} {nonce} "):
            report = json.loads(line.split(" ", 2)[2])
            return TestReport(report["passed"], report["total"], report["error"])
    why = "timed out" if result.timed_out else f"exit code {result.exit_code}: {result.stderr[-300:]}"
    return TestReport(0, total, f"the tests did not finish ({why})")
