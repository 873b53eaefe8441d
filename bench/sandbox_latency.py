"""Latency of executing `print(1)` through the warm sandbox pool, against `docker run --rm` per call and a
bare local subprocess, measured in the same run; and throughput with 8 concurrent episodes.

1. p50/p99 of one `print(1)` execution: through a leased warm container (the runner inside it receives the
   code over its stdin), through `docker run --rm` of the same image with the same limits (docker-py), and
   as a bare `python3 -c` subprocess on the host. Goal (issue #6): warm / docker run <= 0.05.
2. Throughput: 8 concurrent "episodes" (threads), each leasing a sandbox from a pool of 8 and running 5
   short programs, then releasing it (the reset included): executions per second.

    python bench/sandbox_latency.py [--quick]

Needs a Docker daemon and the sandbox image (`make setup-docker`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from agentrl.tools.sandbox import Limits
from agentrl.tools.sandbox.docker_runtime import DockerRuntime, build_image, client
from agentrl.tools.sandbox.pool import SandboxPool
from results import record  # bench/results.py: the last line, kept in bench/results/

GOAL = 0.05
LIMITS = Limits(timeout=10, memory_mb=256, pids=64)


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": round(1000 * statistics.median(ordered), 2),
            "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)}


def timed(fn, n: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    a = parser.parse_args()
    n_warm, n_run, n_local = (100, 10, 100) if a.quick else (500, 40, 500)
    c = client()
    image = build_image(docker_client=c)

    pool = SandboxPool(lambda: DockerRuntime(LIMITS, image=image, docker_client=c), size=8)
    with pool.lease() as sandbox:
        def warm():
            assert sandbox.run(code="print(1)").stdout == "1\n"
        warm_s = timed(warm, n_warm)

    def docker_run():
        out = c.containers.run(image, entrypoint=["python3", "-c", "print(1)"], remove=True, network_mode="none",
                               mem_limit=f"{LIMITS.memory_mb}m", pids_limit=LIMITS.pids, user="1000:1000",
                               read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"])
        assert out == b"1\n"
    run_s = timed(docker_run, n_run)

    def local():
        assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\n"
    local_s = timed(local, n_local)

    def episode(_: int) -> int:
        with pool.lease() as sb:
            for i in range(5):
                assert sb.run(code=f"print(sum(range({i * 1000})))").exit_code == 0
        return 5
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as executor:
        executions = sum(executor.map(episode, range(8 if a.quick else 32)))
    throughput = executions / (time.perf_counter() - start)
    pool.close()

    warm, run, bare = percentiles(warm_s), percentiles(run_s), percentiles(local_s)
    ratio = statistics.median(warm_s) / statistics.median(run_s)
    print(f"print(1): warm pool p50 {warm['p50_ms']} ms, docker run p50 {run['p50_ms']} ms, "
          f"bare subprocess p50 {bare['p50_ms']} ms; 8 concurrent episodes: {throughput:.0f} executions/s",
          file=sys.stderr)
    record(__file__, {"ratio": round(ratio, 4), "goal": f"<= {GOAL}", "met": ratio <= GOAL,
                      "warm": warm, "docker_run": run, "bare_subprocess": bare,
                      "warm_over_bare": round(statistics.median(warm_s) / statistics.median(local_s), 2),
                      "throughput_8_episodes_per_s": round(throughput, 1)})


if __name__ == "__main__":
    main()
