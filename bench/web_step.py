"""Reset and step latency of the web envs with the pooled browser, against launching a Chromium per episode,
measured in the same run; and episodes per second with 4 concurrent episodes.

1. Reset: `web/miniwob-click-checkboxes-v0`'s reset (a fresh context in the shared browser, the page loaded,
   seeded and started, the first observation read), against the same work in a browser launched for the
   episode and closed after it. The issue sets no goal; `ratio` = pooled / per-episode reset (lower is better).
2. Step: one `click` on a checkbox and the observation after it (the same in both set-ups: the browser is
   already up), p50/p99.
3. Throughput: 4 threads play whole scripted episodes (reset, the solver's 2-5 actions, the page's reward)
   of the MiniWoB training split on one shared browser: episodes/s, against the same episodes played one
   after another.

    python bench/web_step.py [--quick]

Needs Chromium and Playwright (`make setup-browser`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import agentrl
from agentrl.envs.web.miniwob import pages_dir
from agentrl.tools.browser import Browser
from agentrl.types import ToolCall
from results import record  # bench/results.py: the last line, kept in bench/results/

TASK = "click-checkboxes"


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": round(1000 * statistics.median(ordered), 1),
            "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1)}


def play(env, task) -> float:
    env.reset(seed=0, options={"task": task})
    reward = 0.0
    for action in env.gold_actions(task):
        _, reward, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            break
    return reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    a = parser.parse_args()
    n_reset, n_launch, n_step, n_episodes = (10, 3, 20, 16) if a.quick else (40, 10, 100, 64)

    env = agentrl.make(f"web/miniwob-{TASK}-v0", per_type=n_reset + 1)
    play(env, env.tasks[0])  # launches the shared browser: not part of any measurement
    reset_s, step_s = [], []
    for task in env.tasks[1:n_reset + 1]:
        start = time.perf_counter()
        env.reset(seed=0, options={"task": task})
        reset_s.append(time.perf_counter() - start)
    for _ in range(n_step):
        checkbox = env.session.observe().find("checkbox")[0]["id"]
        start = time.perf_counter()
        env.step(env.parser.format_call(ToolCall("click", {"id": checkbox})))
        step_s.append(time.perf_counter() - start)
    env.close()

    page = (pages_dir() / f"{TASK}.html").as_uri()
    launch_s = []
    for i in range(n_launch):  # the same reset work, in a browser of its own
        start = time.perf_counter()
        browser = Browser(max_sessions=1)
        with browser.session() as session:
            session.goto(page)
            session.evaluate("s => { core.EPISODE_MAX_TIME = 3600000; Math.seedrandom(s); core.startEpisodeReal(); }",
                             str(i))
            session.observe()
        browser.close()
        launch_s.append(time.perf_counter() - start)

    def episodes(tasks) -> float:
        env = agentrl.make("web/miniwob-v0", per_type=n_episodes)
        try:
            return sum(play(env, t) for t in tasks)
        finally:
            env.close()

    tasks = agentrl.make("web/miniwob-v0", per_type=n_episodes).tasks[:n_episodes]
    start = time.perf_counter()
    solved_serial = episodes(tasks)
    serial = len(tasks) / (time.perf_counter() - start)
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        solved_concurrent = sum(pool.map(episodes, [tasks[i::4] for i in range(4)]))
    concurrent = len(tasks) / (time.perf_counter() - start)

    pooled, launched, step = percentiles(reset_s), percentiles(launch_s), percentiles(step_s)
    ratio = statistics.median(reset_s) / statistics.median(launch_s)
    print(f"reset: pooled p50 {pooled['p50_ms']} ms, browser per episode p50 {launched['p50_ms']} ms; "
          f"step p50 {step['p50_ms']} ms; episodes/s: 4 concurrent {concurrent:.2f}, serial {serial:.2f} "
          f"(solved {solved_concurrent:g} and {solved_serial:g} of {len(tasks)})", file=sys.stderr)
    record(__file__, {"ratio": round(ratio, 3), "goal": "none set (lower is better)", "reset_pooled": pooled,
                      "reset_browser_per_episode": launched, "step": step,
                      "episodes_per_s_4_concurrent": round(concurrent, 2), "episodes_per_s_serial": round(serial, 2),
                      "solved": [solved_concurrent, solved_serial, len(tasks)]})


if __name__ == "__main__":
    main()
