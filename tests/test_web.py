"""The web envs in a real Chromium (`browser` marker): MiniWoB++ task pages from the `miniwob` package and the
local shop, read as numbered text and acted on through tools. Pure parts (the URL filter, the observation
budget, the shop's reward) are checked by hand without a browser."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import agentrl
from agentrl.envs.web.env import render
from agentrl.envs.web.miniwob import HELDOUT_TYPES, SOLVERS, TRAIN_TYPES
from agentrl.envs.web.shop.catalog import Goal, Product, reward
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.scripted import ScriptedPolicy
from agentrl.tools.browser import ActionError, Browser, BrowserError, PageState, Site, is_local, shared_browser
from agentrl.tools.browser.runtime import OWNER_FLAG
from agentrl.types import Status, ToolCall


def chromium_pids(owner: int) -> list[int]:
    """Live Chromium processes launched by the agentrl process `owner`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if f"{OWNER_FLAG}={owner}".encode() in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def call(env, name: str, **arguments) -> str:
    return env.parser.format_call(ToolCall(name, arguments))


# ------------------------------------------------------------------------------------------------ pure
@pytest.mark.parametrize("url, ok", [
    ("file:///tmp/page.html", True), ("http://127.0.0.1:8000/x", True), ("http://localhost/", True),
    ("http://[::1]:9/", True), ("data:text/html,hi", True), ("about:blank", True),
    ("https://example.com/", False), ("http://10.0.0.1/", False), ("http://127.0.0.1.nip.io/", False),
    ("ftp://localhost/", False), ("http://localhost.example.com/", False),
])
def test_only_local_urls_are_allowed(url, ok):
    assert is_local(url) is ok


def test_observation_budget_cuts_at_a_line_and_says_so():
    state = PageState("file:///p.html", "P", ["one two three", "[1] button \"Go\"", "four five six seven"])
    full = render(state, 100)
    assert full.splitlines() == ["URL: file:///p.html", "Title: P", "", "one two three", "[1] button \"Go\"",
                                 "four five six seven"]
    # "one two three" (3 words) and the button line (3) fit in 7, the last line (4) does not
    cut = render(state, 7, error="no element [9]")
    assert cut.splitlines()[2] == "Last action failed: no element [9]"
    assert cut.splitlines()[-2:] == ["[1] button \"Go\"", "[1 more lines not shown: the observation is limited "
                                                          "to 7 words; scroll or act on what is shown]"]


def test_shop_reward_by_hand():
    goal = Goal("P0001", "t-shirt", ("cotton", "slim fit"), {"color": "red", "size": "M"}, 20.0)
    shirt = Product("P0001", "A Cotton T-Shirt", "t-shirt", ("cotton", "slim fit"), {"color": ("red",)}, 15.0)
    assert reward(goal, shirt, {"color": "red", "size": "M"})[0] == 1.0
    # 1 of 2 attributes, 1 of 2 options, price over the limit: (1 + 1 + 0) / 5
    dear = Product("P0002", "B", "t-shirt", ("cotton", "v-neck"), {}, 25.0)
    total, parts = reward(goal, dear, {"color": "Red", "size": "L"})
    assert total == pytest.approx(2 / 5) and parts == {"r_type": 1.0, "attributes_matched": 1,
                                                       "options_matched": 1, "price_ok": 0.0}
    # another clothing type: r_type 0.5; everything else matched: 0.5 * 5/5
    hoodie = Product("P0003", "C", "hoodie", ("cotton", "slim fit"), {}, 10.0)
    assert reward(goal, hoodie, {"color": "red", "size": "M"})[0] == pytest.approx(0.5)
    # another category: 0.1 * (0 + 0 + 1) / 5
    mug = Product("P0004", "D", "mug", ("ceramic",), {}, 5.0)
    assert reward(goal, mug, {})[0] == pytest.approx(0.02)


def test_without_a_chromium_a_web_env_is_not_ready_and_says_how_to_install_one(monkeypatch):
    monkeypatch.delenv("AGENTRL_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(agentrl.env.api.EnvNotReady, match="apt-get install -y chromium"):
        agentrl.make("web/shop-v0").check_ready()


def test_task_splits_are_disjoint():
    assert len(SOLVERS) >= 10 and set(SOLVERS) == {*TRAIN_TYPES, *HELDOUT_TYPES}
    assert not set(TRAIN_TYPES) & set(HELDOUT_TYPES)
    train = {t.id for t in agentrl.make("web/miniwob-v0", per_type=5).tasks}
    seeds = {t.id for t in agentrl.make("web/miniwob-v0", split="heldout_seeds", per_type=5).tasks}
    assert len(train) == 5 * len(TRAIN_TYPES) and not train & seeds
    shop_train = agentrl.make("web/shop-v0", n_tasks=50).tasks
    shop_heldout = agentrl.make("web/shop-v0", split="heldout", n_tasks=50).tasks
    assert not {t.data["goal"]["product_id"] for t in shop_train} & {t.data["goal"]["product_id"] for t in shop_heldout}


# --------------------------------------------------------------------------------------------- browser
@pytest.mark.browser
@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_miniwob_scripted_solver_gets_the_page_reward(name):
    """17 task types: the page's own reward, read from WOB_RAW_REWARD_GLOBAL, is the maximum."""
    env = agentrl.make(f"web/miniwob-{name}-v0", per_type=3)
    try:
        assert env.validate(3) == []
    finally:
        env.close()


@pytest.mark.browser
def test_envs_check_passes_for_miniwob_and_shop():
    for env_id in ("web/miniwob-click-checkboxes-v0", "web/shop-v0"):
        assert agentrl.check(env_id, n_tasks=2) == [], env_id


@pytest.mark.browser
def test_miniwob_wrong_answer_gets_the_page_negative_reward():
    env = agentrl.make("web/miniwob-click-test-2-v0", per_type=2)
    obs, _ = env.reset(seed=0, options={"task": env.tasks[0]})
    target = "TWO" if "button ONE" in obs[1].content else "ONE"  # the wrong one
    page = env.session.observe()
    _, reward, terminated, _, info = env.step(call(env, "click", id=page.find("button", target)[0]["id"]))
    assert terminated and reward == 0.0 and info["reward_components"] == {"success": 0.0, "raw_reward": -1.0}
    assert info["ended_by"] == "page"
    env.close()


@pytest.mark.browser
def test_bad_actions_become_corrective_observations():
    env = agentrl.make("web/miniwob-choose-list-v0", per_type=1)
    obs, _ = env.reset(seed=0, options={"task": env.tasks[0]})
    assert "[1] combobox" in obs[1].content and "Task: Select" in obs[1].content
    for action, message in [
        (call(env, "click", id=99), "there is no element [99]"),
        (call(env, "select", id=1, option="Nobody"), "select on [1] failed"),
        (call(env, "press", key="NoSuchKey"), "unknown key"),
        (call(env, "scroll", direction="sideways"), "scroll direction must be one of"),
        (call(env, "goto", url="https://example.com/"), "this task stays on its own page"),
        (call(env, "goto", url="file:///etc/hostname"), "this task stays on its own page"),  # the host's files
        (call(env, "goto", url="http://127.0.0.1:8000/v1/models"), "this task stays on its own page"),  # services
    ]:
        obs, reward, terminated, truncated, _ = env.step(action)
        assert not terminated and reward == 0.0
        failure = obs[0].content.splitlines()[2]
        assert failure.startswith("Last action failed: ") and message in failure, obs[0].content
        assert obs[0].content.startswith("URL: file://")  # the page is still shown
    env.close()


def test_a_site_is_an_exact_origin_or_the_real_paths_of_a_folder(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "out").symlink_to(tmp_path)  # a link inside the folder that leads out of it
    site = Site((tmp_path / "site" / "index.html").as_uri())
    assert site.allows((tmp_path / "site" / "b.html").as_uri()) and site.root == tmp_path / "site"
    folder = (tmp_path / "site").as_uri()
    for url in (f"{folder}/%2e%2e/secret.txt", f"{folder}/..%2fsecret.txt", f"{folder}/out/secret.txt",
                "file:///etc/passwd", f"file://otherhost{tmp_path}/site/b.html", "http://127.0.0.1/"):
        assert not site.allows(url), url
    shop = Site("http://127.0.0.1:5123/s/abc/")
    assert shop.allows("http://127.0.0.1:5123/item/7") and str(shop) == "http://127.0.0.1:5123"
    for url in ("http://127.0.0.1:8000/v1/models", "http://localhost:5123/", "https://127.0.0.1:5123/",
                "http://127.0.0.1/", "file:///etc/passwd", "data:text/html,hi"):
        assert not shop.allows(url), url
    assert Site("http://127.0.0.1/").allows("http://127.0.0.1:80/x")  # the scheme's default port


@pytest.mark.browser
def test_element_ids_are_stable_while_the_page_lives():
    env = agentrl.make("web/miniwob-login-user-v0", per_type=1)
    env.reset(seed=0, options={"task": env.tasks[0]})
    before = env.session.observe().elements
    obs, *_ = env.step(call(env, "fill", id=before[0]["id"], text="alice"))
    after = env.session.observe().elements
    assert [(e["id"], e["role"]) for e in after] == [(e["id"], e["role"]) for e in before]
    assert f'[{before[0]["id"]}] textbox value="alice"' in obs[0].content
    env.close()


@pytest.mark.browser
def test_requests_to_other_hosts_are_blocked(tmp_path):
    page = tmp_path / "page.html"
    page.write_text("<img src='https://example.com/pixel.png'><script>fetch('http://10.1.2.3/x').catch(() => {})"
                    "</script><p>hello</p>")
    browser = shared_browser()
    with browser.session() as session:
        session.goto(page.as_uri())
        time.sleep(0.5)
        assert "hello" in session.observe().lines
    assert {"https://example.com/pixel.png", "http://10.1.2.3/x"} <= set(browser.blocked)


@pytest.mark.browser
def test_sessions_are_bounded_and_isolated(tmp_path):
    page = tmp_path / "page.html"
    page.write_text("<p>hi</p>")
    browser = Browser(max_sessions=1)
    try:
        with browser.session() as first:
            first.goto(page.as_uri())
            first.evaluate("() => localStorage.setItem('k', 'v')")
            assert first.evaluate("() => localStorage.getItem('k')") == "v"
            with pytest.raises(BrowserError, match="all browser sessions stayed busy"):
                browser.open_session(timeout=0.5)
        with browser.session() as second:  # the slot is free again, in a fresh context: nothing stored
            second.goto(page.as_uri())
            assert second.evaluate("() => localStorage.getItem('k')") is None
    finally:
        browser.close()
    assert not browser.connected


@pytest.mark.browser
def test_shop_episode_through_the_rollout_engine(tiny_model_dir, tmp_path):
    """A scripted shopper plays the whole episode through the renderer: search, results, item, options, buy."""
    env = agentrl.make("web/shop-v0", split="heldout", n_tasks=4, screenshots=str(tmp_path / "shots"))
    task = env.tasks[1]
    plays = {}

    def respond(prompt: str, turn: int) -> str:
        if turn == 0:
            plays["gold"] = env.gold_actions(task)
        return next(plays["gold"])

    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    policy = ScriptedPolicy(renderer, respond, "<|im_start|>assistant")
    engine = RolloutEngine(lambda: env, policy, renderer, RolloutConfig(max_turns=12, max_total_tokens=16384))
    try:
        [group] = asyncio.run(engine.run([task]))
    finally:
        engine.close()
    t = group.trajectories[0]
    assert t.status == Status.OK and t.reward == 1.0 and t.reward_components == {"shop_reward": 1.0, "success": 1.0}
    pages = [m.content for m in t.messages if m.role == "tool"]
    assert "Search results" in pages[1] and task.data["title"] in pages[1]
    assert "Buy Now" in pages[-1]  # the item page, last before the order
    shots = sorted((tmp_path / "shots").glob("*.png"))
    assert len(shots) == len(pages) + 1 and all(s.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for s in shots)
    in_order = [str(s) for s in sorted(shots, key=lambda p: int(p.stem.rsplit("-", 1)[1]))]
    assert t.logs["screenshots"] == [(turn, path) for turn, path in enumerate(in_order)]  # one per turn here
    # the viewer shows each turn's page: written as JSONL and read back, as an eval run's file is
    from agentrl.rollout.jsonl import write_jsonl
    from agentrl.eval.viewer import write_viewer
    write_jsonl([t], tmp_path / "episodes.jsonl")
    page = write_viewer(tmp_path / "episodes.jsonl").read_text()
    assert all(f'<img src="{path}"' in page for path in in_order)


@pytest.mark.browser
def test_shop_wrong_purchase_gets_webshop_partial_reward():
    env = agentrl.make("web/shop-v0", n_tasks=4)
    task = env.tasks[0]
    goal = Goal.from_dict(task.data["goal"])
    env.reset(seed=0, options={"task": task})
    gold = env.gold_actions(task)
    for _ in range(3):  # fill, search, open the goal's product (each action reads the page the last one left)
        env.step(next(gold))
    # buy without choosing options: options matched 0
    page = env.session.observe()
    _, reward, terminated, _, info = env.step(call(env, "click", id=page.find("button", "Buy Now")[0]["id"]))
    product = env.by_id[goal.product_id]
    matched = sum(a in product.attributes for a in goal.attributes)
    expected = (matched + 0 + 1) / (len(goal.attributes) + len(goal.options) + 1)  # no options, price ok
    assert terminated and reward == pytest.approx(expected) and info["reward_components"]["success"] == 0.0
    env.close()


@pytest.mark.browser
def test_concurrent_episodes_share_one_browser():
    def play(i: int) -> list[str]:
        env = agentrl.make("web/miniwob-v0", per_type=2)
        try:
            return env.validate(4)
        finally:
            env.close()

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(play, range(4))) == [[]] * 4


@pytest.mark.browser
def test_a_browser_crash_ends_the_episode_as_error_and_the_next_one_relaunches(tiny_model_dir):
    env = agentrl.make("web/miniwob-click-button-v0", per_type=2)
    task = env.tasks[0]

    def respond(prompt: str, turn: int) -> str:
        for pid in chromium_pids(os.getpid()):  # the browser dies under the episode
            os.kill(pid, signal.SIGKILL)
        return call(env, "click", id=1)

    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    engine = RolloutEngine(lambda: env, ScriptedPolicy(renderer, respond, "<|im_start|>assistant"), renderer,
                           RolloutConfig(max_total_tokens=4096))
    try:
        [group] = asyncio.run(engine.run([task]))
    finally:
        engine.close()
    t = group.trajectories[0]
    assert t.status == Status.ERROR and "BrowserError" in t.reason, t.reason
    env.close()
    fresh = agentrl.make("web/miniwob-click-button-v0", per_type=2)
    assert fresh.validate(1) == []  # shared_browser() launched a new Chromium
    fresh.close()


LEAK_SCRIPT = textwrap.dedent("""
    import sys, agentrl
    env = agentrl.make("web/miniwob-enter-text-v0", per_type=2)
    env.reset(seed=0, options={"task": env.tasks[0]})
    print("ready", flush=True)
    if sys.argv[1] == "interrupt":
        import time
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            raise SystemExit(130)
    else:
        import time; time.sleep(60)
""")


@pytest.mark.browser
@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_no_chromium_is_left_after_an_episode_is_killed(how, tmp_path):
    script = tmp_path / "episode.py"
    script.write_text(LEAK_SCRIPT)
    # the episode's process gets Ctrl-C as a shell would deliver it, whatever the test worker's own signal state
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL),
                                                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})))
    assert proc.stdout.readline().strip() == "ready"
    assert chromium_pids(proc.pid), "the episode's Chromium should be running"
    proc.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
    proc.wait(60)  # Chromium's shutdown takes seconds, more under the full suite's load
    deadline = time.monotonic() + 20
    while chromium_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert chromium_pids(proc.pid) == []


# ------------------------------------------------------------------------------------- escapes (#33)
@pytest.fixture
def listener():
    """A loopback HTTP server standing for the machine's other services (vLLM, the retriever): counts its hits."""
    import http.server
    import threading

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"SECRET-SERVICE")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hits
    server.shutdown()


@pytest.mark.browser
def test_a_file_site_cannot_be_left_however_the_url_is_spelled(tmp_path, listener):
    """Chromium reads `%2e%2e` as `..`; the request route sees its reading, so none of these loads."""
    port, hits = listener
    (tmp_path / "secret.txt").write_text("SECRET-FILE")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "out").symlink_to(tmp_path)
    (site_dir / "index.html").write_text(f"<p>home</p><img src='../secret.txt'><iframe src='out/secret.txt'></iframe>"
                                         f"<script>fetch('http://127.0.0.1:{port}/from-script').catch(() => {{}})"
                                         f"</script>")
    (site_dir / "other.html").write_text("<p>other page</p>")
    folder = site_dir.as_uri()
    with shared_browser().session() as session:
        session.restrict(Site(f"{folder}/index.html"))
        session.goto(f"{folder}/index.html")
        session.goto(f"{folder}/other.html")  # the site's own pages open
        assert "other page" in session.observe().lines
        for url in (f"{folder}/%2e%2e/secret.txt", f"{folder}/%2E%2E/%2e%2e{tmp_path}/secret.txt",
                    f"{folder}/..%2fsecret.txt", f"{folder}/out/secret.txt", f"file://{tmp_path}/secret.txt",
                    f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}\\@127.0.0.1:1/",
                    f"http://localhost:{port}/", "data:text/html,<p>SECRET-FILE</p>", "javascript:alert(1)"):
            with pytest.raises(ActionError, match="not on this task's site|cannot be opened|could not open"):
                session.goto(url)
            page = session.observe()
            assert not any("SECRET" in line for line in page.lines) and page.url.startswith(folder), (url, page)
        session.goto(f"{folder}/index.html")
        time.sleep(0.3)
        assert "home" in session.observe().lines
    assert hits == []


@pytest.fixture
def site_server(listener):
    """The task's site on another loopback port: a page, a redirect to the listener, a WebSocket and a popup to it."""
    import http.server
    import threading

    port = listener[0]
    pages = {"/": "<p>home</p>", "/same": "<p>same site</p>",
             "/ws": f"<p>sockets</p><script>new WebSocket('ws://127.0.0.1:{port}/socket')</script>",
             "/popup": f"<a href='/same' target='_blank'>tab</a><a href='http://127.0.0.1:{port}/tab' "
                       f"target='_blank'>away</a><script>window.open('/same')</script>"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in ("/away", "/hop"):  # a server-side redirect: off the site, or on it
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{port}/redirected" if self.path == "/away" else "/same")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(pages.get(self.path, "<p>404</p>").encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.browser
def test_redirects_websockets_and_popups_stay_on_the_site(site_server, listener):
    """Ways off the page that the request route did not see: a server's 302 to another loopback port, and popups
    (on the site, they stayed open beside the episode's page); a WebSocket to the other port is refused too."""
    port, hits = listener
    with shared_browser().session() as session:
        session.restrict(Site(f"{site_server}/"))
        session.goto(f"{site_server}/")
        with pytest.raises(ActionError):
            session.goto(f"{site_server}/away")
        session.goto(f"{site_server}/hop")  # a redirect within the site is followed
        assert "same site" in session.observe().lines
        session.goto(f"{site_server}/ws")
        session.goto(f"{site_server}/popup")
        for name in ("tab", "away"):
            session.click(next(e["id"] for e in session.observe().elements if e.get("name") == name))
        time.sleep(0.5)
        assert session.page.context.pages == [session.page]  # every popup closed
        page = session.observe()
        assert page.url == f"{site_server}/popup" and "tab" in "\n".join(page.lines)
    assert hits == []


@pytest.mark.browser
def test_the_shop_reaches_no_other_loopback_port(listener):
    port, hits = listener
    env = agentrl.make("web/shop-v0", n_tasks=2)
    env.reset(seed=0, options={"task": env.tasks[0]})
    shop = env.server.port
    for url in (f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}\\@127.0.0.1:{shop}/",
                f"http://127.0.0.1:{shop}@127.0.0.1:{port}/", f"http://localhost:{port}/", f"http://[::1]:{port}/",
                f"http://0.0.0.0:{port}/", f"http://2130706433:{port}/"):
        obs, reward, terminated, _, _ = env.step(call(env, "goto", url=url))
        text = obs[0].content
        assert not terminated and "Last action failed" in text and "SECRET" not in text, (url, text)
        assert text.startswith(f"URL: http://127.0.0.1:{shop}/"), text
    env.close()
    assert hits == []


@pytest.mark.browser
@pytest.mark.parametrize("target", ["click-test.html", "click-checkboxes.html", "../core/core.js", "../core/"])
def test_a_miniwob_task_is_scored_on_its_own_page_only(target):
    """Another task's page (click-test is solved by one click), a reload (a new instance) and the package's
    scripts are refused as observations; the task is still the one scored."""
    env = agentrl.make("web/miniwob-click-checkboxes-v0", per_type=1)
    task = env.tasks[0]
    env.reset(seed=0, options={"task": task})
    url = f"{env.page_url(task).rsplit('/', 1)[0]}/{target}"
    obs, reward, terminated, _, _ = env.step(call(env, "goto", url=url))
    assert not terminated and "this task stays on its own page" in obs[0].content
    assert env.session.page.url == env.page_url(task)
    gold = env.gold_actions(task)
    for action in gold:
        obs, reward, terminated, truncated, info = env.step(action)
    assert terminated and reward == 1.0
    env.close()


@pytest.mark.browser
def test_a_miniwob_page_that_is_left_anyway_scores_zero_not_error():
    """No tool leaves the page; should something else (a page script), the episode is a failure, not `error`."""
    env = agentrl.make("web/miniwob-click-test-v0", per_type=1)
    env.reset(seed=0, options={"task": env.tasks[0]})
    env.session.site = None  # the test's own way out: the package's script file, where no task globals exist
    env.session.goto(env.page_url(env.tasks[0]).replace("miniwob/click-test.html", "core/core.js"))
    obs, reward, terminated, _, info = env.step(call(env, "done"))
    assert terminated and reward == 0.0 and "no longer the task's" in info["detail"], info
    env.close()


@pytest.mark.browser
def test_a_null_policy_succeeds_on_click_checkboxes_only_where_nothing_is_to_be_checked():
    """Clicking Submit at once earns click-checkboxes' partial credit (the share of boxes left right) on many tasks;
    success is the page's full reward, which it earns only on "Select nothing"."""
    env = agentrl.make("web/miniwob-click-checkboxes-v0")
    try:
        outcomes = []
        for task in list(env.tasks)[:12]:
            env.reset(options={"task": task})
            nothing = env.instruction(task).startswith("Select nothing")
            submit = env.session.observe().find("button", "Submit")[0]["id"]
            *_, info = env.step(call(env, "click", id=submit))
            outcomes.append((nothing, info["reward_components"]["success"], info["reward_components"]["raw_reward"]))
        assert all(success == float(nothing) for nothing, success, _ in outcomes), outcomes
        assert any(not nothing and raw > 0 for nothing, _, raw in outcomes)  # partial credit, not success
        assert any(nothing for nothing, *_ in outcomes)
    finally:
        env.close()
