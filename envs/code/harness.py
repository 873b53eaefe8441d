"""Hidden tests, run in the sandbox: how many of a task's tests a submitted solution passes.

A task's tests are HumanEval's format: a `check(candidate)` function. Each top-level statement of its body
that contains an `assert` is one test (a loop of asserts is one); the other statements are setup and run in
order. The harness is one Python program: the task's prompt (imports and helper functions), then the
submission (which must define the entry point), then each test on its own, so one failing assert does not
hide the others. It prints one marked JSON line that the env reads; the submission's own prints cannot
forge it (the marker carries a per-run nonce).
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
    statements = [(any(isinstance(n, ast.Assert) for n in ast.walk(s)), ast.unparse(s)) for s in check.body]
    if not any(is_test for is_test, _ in statements):
        raise ValueError("check(candidate) holds no assert")
    return prelude, statements


def program(prompt: str, solution: str, entry_point: str, test_source: str, nonce: str) -> str:
    """The harness's source: it loads the prompt and the submission, runs each statement of `check` on its own
    and prints one `MARKER nonce {"passed", "total", "error"}` line."""
    prelude, statements = split_check(test_source)
    return f"""
import json
_n, _statements = {nonce!r}, {statements!r}
_total = sum(is_test for is_test, _ in _statements)
def _report(passed, error=""):
    print("\\n{MARKER} " + _n + " " + json.dumps({{"passed": passed, "total": _total, "error": error}}), flush=True)
_ns = {{}}
try:
    exec(compile({prompt!r}, "prompt.py", "exec"), _ns)  # its imports and helpers
    _ns.pop({entry_point!r}, None)  # the stub: the solution must define the function itself
    exec(compile({solution!r}, "solution.py", "exec"), _ns)
    _candidate = _ns[{entry_point!r}]
except BaseException as e:
    _report(0, f"the solution does not load: {{type(e).__name__}}: {{e}}")
    raise SystemExit(0)
_env = dict(_ns)  # as HumanEval runs them: the tests see the solution module's names (e.g. helpers)
exec(compile({prelude!r}, "tests.py", "exec"), _env)
_env["candidate"] = _candidate
_passed, _error = 0, ""
for _is_test, _src in _statements:
    try:
        exec(compile(_src, "tests.py", "exec"), _env)
        _passed += _is_test
    except BaseException as e:
        _error = _error or f"{{type(e).__name__}}: {{e}}"[:300]
        if not _is_test:
            break
_report(_passed, _error)
"""


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
    result: RunResult = sandbox.run(code=program(prompt, solution, entry_point, test_source, nonce),
                                    timeout=timeout)
    total = sum(is_test for is_test, _ in split_check(test_source)[1])
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(f"{MARKER} {nonce} "):
            report = json.loads(line.split(" ", 2)[2])
            return TestReport(report["passed"], report["total"], report["error"])
    why = "timed out" if result.timed_out else f"exit code {result.exit_code}: {result.stderr[-300:]}"
    return TestReport(0, total, f"the tests did not finish ({why})")
