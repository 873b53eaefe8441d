"""SWE task instances in SWE-bench's format, and their loader.

SWE-bench fields: `instance_id`, `repo`, `base_commit`, `problem_statement`, `FAIL_TO_PASS`, `PASS_TO_PASS`
(pytest node ids; SWE-bench files store them as JSON strings, both forms are read), `patch` (the gold fix)
and `test_patch` (the tests, applied only for grading). agentrl adds:
    image         the sandbox image holding the repository (required: no registry here to pull from)
    repo_dir      where the repository is in the image (default "/testbed", SWE-bench's convention); null for
                  generated instances, whose repository the env uploads from the host's snapshot of `repo`
    test_cmd      the command that runs the tests, printing pytest's `-rA` summary (default: pytest on the
                  files that FAIL_TO_PASS and PASS_TO_PASS name)
    setup_patch   applied when an episode starts (generated tasks: the injected bug)
    hidden_tests  paths removed when an episode starts (generated tasks: the test files, which
                  `test_patch` re-creates for grading)
    split, kind   generated tasks: train / heldout_repo / heldout_kind, and the mutation kind
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any, Iterable

from agentrl.types import Task

REQUIRED = ("instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "image")


def to_task(d: dict[str, Any], split: str | None = None) -> Task:
    """A task from one instance dict; a clear error names what is missing."""
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"SWE instance {d.get('instance_id', '?')}: missing {', '.join(missing)}"
                         + (" (give each instance the sandbox image that holds its repository)" if "image" in missing
                            else ""))
    data = dict(d)
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS", "hidden_tests"):
        if isinstance(data.get(key), str):  # SWE-bench stores these lists as JSON strings
            data[key] = json.loads(data[key])
    data.setdefault("repo_dir", "/testbed")
    data.setdefault("test_patch", "")
    if not data.get("test_cmd"):
        files = sorted({t.split("::")[0] for t in data["FAIL_TO_PASS"] + data["PASS_TO_PASS"]})
        data["test_cmd"] = "python3 -m pytest -rA --tb=no -p no:cacheprovider -q " + " ".join(files)
    return Task(d["instance_id"], data, split or d.get("split", "test"))


def load_jsonl(path: str | Path, split: str | None = None) -> list[Task]:
    """SWE-bench / SWE-Gym style instances, one JSON object per line; `split` keeps those of one split."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    tasks = [to_task(r) for r in rows]
    return [t for t in tasks if split is None or t.split == split]


def load_folder(path: str | Path, split: str | None = None) -> list[Task]:
    """Our own tasks, one directory each: `instance.json` with the fields, and optionally the long ones as
    files beside it (`problem_statement.md`, `patch.diff`, `test_patch.diff`, `setup_patch.diff`), which
    take precedence. The directory name is the default instance_id."""
    tasks = []
    for directory in sorted(p for p in Path(path).iterdir() if (p / "instance.json").exists()):
        d = {"instance_id": directory.name, **json.loads((directory / "instance.json").read_text())}
        for key, name in (("problem_statement", "problem_statement.md"), ("patch", "patch.diff"),
                          ("test_patch", "test_patch.diff"), ("setup_patch", "setup_patch.diff")):
            if (directory / name).exists():
                d[key] = (directory / name).read_text()
        tasks.append(to_task(d))
    return [t for t in tasks if split is None or t.split == split]


def load(path: str | Path, split: str | None = None) -> list[Task]:
    """Instances from a JSONL file or a folder of task directories."""
    return load_folder(path, split) if Path(path).is_dir() else load_jsonl(path, split)


def write_jsonl(instances: Iterable[dict[str, Any]], path: str | Path) -> None:
    """Write instances to `path` as JSONL, through a temporary file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(i) + "\n" for i in instances))
    tmp.rename(path)


class InconsistentOutput(ValueError):
    """Test output that contradicts itself, as output forged by the code under test would."""


STATUSES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XFAIL": "xfailed", "XPASS": "xpassed"}
FINAL_LINE = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s(?: \([\d:]+\))?\s*=*$")


def parse_pytest_summary(output: str) -> dict[str, str]:
    """Test id → PASSED / FAILED / ERROR / XFAIL / XPASS, from the status lines of pytest's `-rA` short test
    summary (a FAILED line is `id - message`: an id that itself holds " - " would be cut there).

    The output must end its run the way pytest does: one short test summary, then one final counts line
    (`2 failed, 3 passed in 0.1s`) with as many status lines of each kind as it counts, no test with two
    statuses, and nothing but blank lines after it; otherwise InconsistentOutput (the code under test prints
    into this output and could forge it). No final line: the run did not finish, and no test counts as
    passed (an empty dict)."""
    results: dict[str, str] = {}
    seen: collections.Counter[str] = collections.Counter()
    summaries, final = 0, None
    for line in output.splitlines():
        if final is not None:
            if line.strip():
                raise InconsistentOutput(f"output after the final counts line: {line.strip()[:200]}")
            continue
        if "short test summary info" in line:
            summaries += 1
            if summaries > 1:
                raise InconsistentOutput("two short test summaries")
        elif match := FINAL_LINE.match(line.strip()):
            final = match.group(1)
        elif summaries:
            status, _, rest = line.partition(" ")
            if status in STATUSES and rest.strip():
                seen[STATUSES[status]] += 1
                test = rest.split(" - ")[0].strip()
                if "::" in test and results.setdefault(test, status) != status:
                    raise InconsistentOutput(f"{test} is reported {results[test]} and {status}")
    if final is None:
        return {}
    counts = {word.rstrip("s") if word in ("errors", "warnings") else word: int(n)
              for n, word in (part.split(" ", 1) for part in final.split(", "))}
    for kind in STATUSES.values():
        if seen[kind] != counts.get(kind, 0):
            raise InconsistentOutput(f"{seen[kind]} {kind} status lines, but the final line says "
                                     f"{counts.get(kind, 0)} ({final})")
    return results
