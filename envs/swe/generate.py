"""Generated SWE tasks, SWE-smith style: inject a bug into a real repository with a program transformation,
run the repository's tests in the sandbox, and keep the bug if some passing tests now fail.

For each repository (`repos.py`), sites of every mutation kind (`mutate.py`) are enumerated over its
library modules and tried in a seeded order that alternates kinds, until `per_repo` bugs are kept (or the
attempts run out). A bug's FAIL_TO_PASS tests pass on the clean repository and fail with the bug; its
PASS_TO_PASS tests pass on both; a bug needs both kinds (one that fails every test is an import error, not a
task). The problem statement names the failing tests and their error messages,
not the fix. Splits: `heldout_repo` holds every bug of the last repository, `heldout_kind` the
`swap_arguments` bugs of the others, `train` the rest. Deterministic: same repositories, seed and
per_repo → the same instances.

    agentrl swe generate [--per-repo 20]      # ~/.cache/agentrl/swe/generated/instances.jsonl
"""

from __future__ import annotations

import difflib
import json
import random
import re
from pathlib import Path
from typing import Any, Callable

from agentrl.envs.swe.instances import parse_pytest_summary, write_jsonl
from agentrl.envs.swe.mutate import KINDS, mutate, sites
from agentrl.envs.swe.repos import REPOS, RepoSpec, fetch, image, upload
from agentrl.tools.sandbox import Limits
from agentrl.tools.sandbox.docker_runtime import DockerRuntime, client

CACHE = Path.home() / ".cache" / "agentrl" / "swe"
INSTANCES = CACHE / "generated" / "instances.jsonl"
LIMITS = Limits(timeout=120, memory_mb=1024, disk_mb=256, pids=128, output_bytes=2_000_000)
WORKDIR = "repo"  # in the sandbox's workspace
HELD_OUT_KIND = "swap_arguments"
ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def file_diff(path: str, old: str | None, new: str) -> str:
    """A git-style unified diff of one file (`old` None: the file is created)."""
    a = [] if old is None else old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    lines = list(difflib.unified_diff(a, b, "/dev/null" if old is None else f"a/{path}", f"b/{path}"))
    body = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    return header + body


def test_files(repo: Path, spec: RepoSpec) -> dict[str, str]:
    """The repository's test files (`spec.tests`, directories expanded to their `.py` files): path → content."""
    out = {}
    for entry in spec.tests:
        paths = [repo / entry] if (repo / entry).is_file() else sorted((repo / entry).rglob("*.py"))
        out.update({str(p.relative_to(repo)): p.read_text() for p in paths})
    return out


def run_suite(sandbox: DockerRuntime, repo: Path, spec: RepoSpec,
              changed: dict[str, str]) -> tuple[dict[str, str], str]:
    """(test id → status, pytest's output) for the clean repository with `changed` files replaced."""
    sandbox.reset()
    upload(sandbox, repo, WORKDIR)
    for path, content in changed.items():
        sandbox.write(f"{WORKDIR}/{path}", content)
    result = sandbox.run(argv=["sh", "-c", f"cd {WORKDIR} && COLUMNS=250 python3 -m pytest -rA --tb=no "
                               "-p no:cacheprovider -q " + " ".join(spec.tests)])  # wide: whole messages
    return parse_pytest_summary(result.stdout), result.stdout


def problem_statement(spec: RepoSpec, failing: list[str], output: str) -> str:
    """A bug's issue text: the failing tests (the first five) with pytest's error messages, not the fix."""
    messages = {}
    for line in output.splitlines():
        if line.startswith("FAILED ") and " - " in line:
            test, _, message = line[len("FAILED "):].partition(" - ")
            messages[test.strip()] = ADDRESS.sub(" at 0x...", message.strip())[:200]  # reprs: deterministic text
    shown = "\n".join(f"- `{t}`" + (f": {messages[t]}" if t in messages else "") for t in failing[:5])
    more = f"\n- ... and {len(failing) - 5} more" if len(failing) > 5 else ""
    return (f"After a recent change to {spec.name}, {len(failing)} of its tests fail:\n\n{shown}{more}\n\n"
            "The tests are not in your copy of the repository; they will be run against your fix. Find the bug "
            "in the library code and fix it without breaking other behaviour.")


def candidates(repo: Path, spec: RepoSpec, rng: random.Random) -> list[tuple[str, str, int]]:
    """(path, kind, index) of every mutation site, shuffled within each kind, the kinds interleaved."""
    by_kind: dict[str, list[tuple[str, str, int]]] = {k: [] for k in KINDS}
    for path in spec.sources:
        for kind, n in sites((repo / path).read_text()).items():
            by_kind[kind] += [(path, kind, i) for i in range(n)]
    for sites_of_kind in by_kind.values():
        rng.shuffle(sites_of_kind)
    interleaved = []
    while any(by_kind.values()):
        for kind in KINDS:
            if by_kind[kind]:
                interleaved.append(by_kind[kind].pop())
    return interleaved


def generate_repo(spec: RepoSpec, cache: Path, per_repo: int, seed: int, split_of: Callable[[str], str],
                  docker_client: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The bugs kept for one repository, as SWE-bench style instances: mutation sites are tried in a seeded order
    until `per_repo` are kept or `6 * per_repo` tried; `split_of` maps a mutation kind to its split."""
    repo, img = fetch(spec, cache), image(spec, cache, docker_client)
    tests = test_files(repo, spec)
    sandbox = DockerRuntime(LIMITS, image=img, docker_client=docker_client)
    sandbox.start()
    try:
        baseline, _ = run_suite(sandbox, repo, spec, {})
        passing = sorted(t for t, s in baseline.items() if s == "PASSED")
        test_patch = "".join(file_diff(path, None, content) for path, content in sorted(tests.items()))
        kept, tried = [], 0
        for path, kind, index in candidates(repo, spec, random.Random(f"{seed}-{spec.name}")):
            if len(kept) >= per_repo or tried >= 6 * per_repo:
                break
            tried += 1
            clean = (repo / path).read_text()
            buggy = mutate(clean, kind, index)
            results, output = run_suite(sandbox, repo, spec, {path: buggy})
            f2p = [t for t in passing if results.get(t) != "PASSED"]
            p2p = [t for t in passing if results.get(t) == "PASSED"]
            if not f2p or not p2p:  # no failure, or one that breaks everything (an import error)
                continue
            kept.append({
                "instance_id": f"{spec.name}__{kind}-{index}-{Path(path).stem}", "repo": spec.name,
                "base_commit": spec.sdist, "problem_statement": problem_statement(spec, f2p, output),
                "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                "patch": file_diff(path, buggy, clean), "test_patch": test_patch,
                "setup_patch": file_diff(path, clean, buggy),
                "hidden_tests": sorted(spec.tests), "image": img,
                "repo_dir": None,  # not in the image: the env uploads the host's snapshot
                "test_cmd": "python3 -m pytest -rA --tb=no -p no:cacheprovider -q " + " ".join(spec.tests),
                "split": split_of(kind), "kind": kind,
            })
        log(f"{spec.name}: {len(kept)} bugs kept of {tried} tried ({len(passing)} passing tests)")
        return kept
    finally:
        sandbox.close()


def up_to_date(out: Path, per_repo: int, seed: int) -> bool:
    """Whether `out` was generated with these settings and names the images the current code builds (same
    image tags = same repositories, runner and test dependencies: a changed sandbox runner regenerates)."""
    settings = out.with_suffix(".settings.json")
    if not out.exists() or not settings.exists():
        return False
    if json.loads(settings.read_text()) != _settings(per_repo, seed):
        return False
    docker_client = client()
    images = {json.loads(line)["image"] for line in out.read_text().splitlines() if line.strip()}
    return images <= {image(spec, CACHE, docker_client) for spec in REPOS}


def generate(out: Path = INSTANCES, cache: Path = CACHE, per_repo: int = 20, seed: int = 0,
             log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Generates the instances of every repository and writes them to `out` (JSONL, SWE-bench fields)."""
    docker_client, instances = client(), []
    for i, spec in enumerate(REPOS):
        held_out_repo = i == len(REPOS) - 1

        def split_of(kind: str, held_out_repo: bool = held_out_repo) -> str:
            return "heldout_repo" if held_out_repo else "heldout_kind" if kind == HELD_OUT_KIND else "train"

        instances += generate_repo(spec, cache, per_repo, seed, split_of, docker_client, log)
    write_jsonl(instances, out)
    out.with_suffix(".settings.json").write_text(json.dumps(_settings(per_repo, seed)))
    return instances


def _settings(per_repo: int, seed: int) -> dict[str, Any]:
    # format 2: repositories are uploaded from the host, not copied from /repo in the image
    return {"per_repo": per_repo, "seed": seed, "repos": [r.sdist for r in REPOS], "format": 2}
