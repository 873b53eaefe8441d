"""Reports and the trajectory viewer, on run directories built from handmade trajectories.

The `browser` tests open the pages in headless Chromium (Playwright) and save screenshots for a person to
look at: under $AGENTRL_SCREENSHOTS if set, else the test's tmp_path (the path is printed)."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from PIL import Image

from agentrl.eval.metrics import summarize_run
from agentrl.eval.report import idle_table, plot_timeline, timeline_steps, write_report
from agentrl.rollout.jsonl import write_jsonl
from agentrl.models.tokenizer import load_tokenizer
from agentrl.types import TYPICAL_STOP, Message, Status, StopReason, ToolCall, Trajectory, Turn
from agentrl.eval.viewer import turn_blocks, write_viewer

CHROMIUM = os.environ.get("AGENTRL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]
EVIL = "<script>alert('pwned')</script>"
UNSEEN, HOPS = "search/r1-v0:unseen_entities", "search/r1-v0:more_hops"


def episode(encode, task: str, entry: str, sample: int, success: bool, answer: str | None = None,
            status: Status = Status.OK, reason: str = "", hops: int = 2) -> Trajectory:
    """A search episode: a search call, its observation, then a final answer (an error stops after the
    search). Tokens are the tokenizer's own for each piece, masks exact."""
    answer = answer if answer is not None else ("Paris" if success else "Lyon")
    call = ToolCall("search", {"query": f"capital of {task}"}, "c0")
    messages = [Message("system", "Answer with the search tool."), Message("user", f"What is the capital of {task}?"),
                Message("assistant", "", (call,)),
                Message("tool", f"Doc 1: {task} ... capital Paris.", tool_call_id="c0", name="search")]
    ids, mask = list(encode("Answer with the search tool. What is the capital?")), []
    mask, prompt_len = [0] * len(ids), len(ids)

    def add(text: str, sampled: bool) -> None:
        piece = encode(text)
        ids.extend(piece)
        mask.extend([int(sampled)] * len(piece))

    start = len(ids)
    add(f'search("capital of {task}")', True)
    end = len(ids)
    turns = [Turn(start, end, end)]
    if status is not Status.ERROR:
        add(f"Doc 1: {task} ... capital Paris.", False)
        turns = [Turn(start, end, len(ids))]
        start = len(ids)
        add(f"<answer>{answer}</answer>", True)
        turns.append(Turn(start, len(ids), len(ids), 1.0 if success else 0.0))
        messages.append(Message("assistant", f"<answer>{answer}</answer>"))
    reward = 1.0 if success else 0.0
    metrics = {"success": success, "tool_calls": 1, "seconds": 0.5}
    logs = {"entry": entry, "env": entry.split(":")[0], "split": entry.split(":")[1], "sample": sample,
            "difficulty": {"hops": hops}}
    logprobs = tuple(-0.25 if m else 0.0 for m in mask)
    return Trajectory(task, tuple(ids), tuple(mask), logprobs, prompt_len, tuple(turns), reward,
                      {"outcome": reward}, TYPICAL_STOP[status], reason, tuple(messages),
                      answer=None if status is Status.ERROR else answer, metrics=metrics, logs=logs)


def make_run(run_dir: Path, encode, model: str, wins: dict[str, set[tuple[str, int]]],
             extra: list[Trajectory] = (), train_dir: Path | None = None) -> list[Trajectory]:
    """Two entries × 3 tasks × 2 samples; `wins[entry]` holds the (task, sample) that succeed."""
    run_dir.mkdir(parents=True)
    tasks = [(e, f"{e[-5:]}-{t}", 2 + t % 2 + (e == HOPS)) for e in (UNSEEN, HOPS) for t in range(3)]
    trajectories = [episode(encode, task, e, s, (task, s) in wins[e], hops=hops)
                    for e, task, hops in tasks for s in range(2)] + list(extra)
    write_jsonl(trajectories, run_dir / "trajectories.jsonl")
    run = {"suite": "search/heldout", "version": 1, "model": model, "k": [1, 2], "n": 2, "seed": 0,
           "sampling": {"temperature": 1.0},
           "entries": [{"name": e, "env": "search/r1-v0", "split": e.split(":")[1], "n_tasks": 3}
                       for e in (UNSEEN, HOPS)],
           "started": "2025-01-01T10:00:00", "finished": "2025-01-01T10:05:00", "seconds": 300.0}
    if train_dir is not None:
        run["train_dir"] = str(train_dir)
    (run_dir / "run.json").write_text(json.dumps(run))
    return trajectories


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def runs(tmp_path, tokenizer):
    """Run A (with an error, a truncation and a <script> answer), run B, and a training run."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    train = tmp_path / "train"
    train.mkdir()
    rows = [{"step": s, "mean_reward": 0.1 + 0.04 * s, "success": 0.05 + 0.04 * s, "mean_tool_calls": 1 + s / 10,
             "mean_sampled_tokens": 40 - s, "valid_action_rate": 0.5 + s / 40} for s in range(1, 21)]
    (train / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (train / "summary.json").write_text(json.dumps({"before": {"success": 0.1, "mean_reward": 0.1},
                                                    "after": {"success": 0.8, "mean_reward": 0.8}}))
    extra = [episode(encode, "extra-err", UNSEEN, 0, False, status=Status.ERROR,
                     reason="ConnectionError: retriever down <b>|</b>"),
             episode(encode, "extra-err", UNSEEN, 1, False, answer=EVIL),
             episode(encode, "extra-trunc", HOPS, 0, False, status=Status.TRUNCATED, reason="max_turns=4"),
             episode(encode, "extra-trunc", HOPS, 1, True)]
    wins_a = {UNSEEN: {("ities-0", 0), ("ities-0", 1), ("ities-1", 0), ("ities-2", 1)}, HOPS: {("_hops-0", 0)}}
    wins_b = {UNSEEN: set(), HOPS: set()}
    a = make_run(tmp_path / "a", encode, "tiny-grpo", wins_a, extra, train_dir=train)
    make_run(tmp_path / "b", encode, "tiny-sft", wins_b)
    return tmp_path / "a", tmp_path / "b", train, a


def test_report_markdown(runs):
    run_a, _, _, trajectories = runs
    md_path, html_path = write_report(run_a)
    assert (md_path, html_path) == (run_a / "report.md", run_a / "report.html")
    md = md_path.read_text()
    results = summarize_run(trajectories, [1, 2])
    unseen = results["entries"][UNSEEN]
    # 4 wins of 7 scored episodes (the error is out of the denominator); its Wilson interval
    assert unseen["success"]["successes"] == 4 and unseen["success"]["n"] == 7
    low, high = unseen["success"]["low"], unseen["success"]["high"]
    row = next(line for line in md.splitlines() if line.startswith(f"| {UNSEEN} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "8"  # episodes, the error included
    assert cells[2] == f"{4 / 7:.3f} [{low:.2f}, {high:.2f}]"
    assert cells[4] == f"{unseen['pass_at_k']['1']['value']:.3f}"
    assert cells[5] == f"{unseen['pass_at_k']['2']['value']:.3f}"
    assert cells[6] == f"{unseen['maj_at_k']['1']['value']:.3f}"
    assert cells[-2:] == ["1", "0"]  # errors, truncated
    assert "| pass@1 | pass@2 | maj@1 | maj@2 |" in md
    assert next(line for line in md.splitlines() if line.startswith("| **all** |")).split("|")[2].strip() == "16"
    # errors with their reasons, made safe for a table cell
    assert (f"| {UNSEEN} | error | 1 | 0.125 | ConnectionError: retriever down &lt;b&gt;\\|&lt;/b&gt; (×1) |"
            in md)
    assert f"| {HOPS} | truncated | 1 | 0.125 | max_turns=4 (×1) |" in md
    assert "## Success by hops" in md and "| hops=2 | hops=3 | hops=4 |" in md
    assert "(viewer.html)" in md and "finished 2025-01-01T10:05:00" in md
    # run.json names a training run: its reward curve and held-out before/after are reported
    assert "## Training run" in md and "20 RL steps logged" in md and "held-out after RL: success 0.800" in md
    for png in ("success", "difficulty_hops", "reward_curve", "learning_dynamics"):
        assert (run_a / "report_files" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"](report_files/{png}.png)" in md
    # its rows are from before the timeline: no section, no plot
    assert "Timeline" not in md and not (run_a / "report_files" / "timeline.png").exists()


def test_report_html_is_self_contained_and_escaped(runs):
    run_a, run_b, train, _ = runs
    _, html_path = write_report(run_a, vs=run_b, train_dir=train)
    html = html_path.read_text()
    assert EVIL not in html and "<script" not in html  # the report has no script at all
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html) and "url(" not in html
    pngs = re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{100,}"', html)
    assert len(pngs) == 4  # success, hops, reward curve, learning dynamics
    assert "&lt;b&gt;|&lt;/b&gt;" in html  # the error reason, as text
    assert f'href="viewer.html#entry={UNSEEN.replace("/", "%2F").replace(":", "%3A")}"' in html
    # comparison: A wins 4/7 on unseen entities, B 0/6
    assert "A − B [95% CI]" in html and f"{4 / 7:+.3f}" in html


def timeline_rows() -> list[dict]:
    """Three asynchronous steps; the third from a resumed run, whose clock restarted at 0."""
    return [
        {"step": 1, "timeline": {"engine": [[0.0, 2.0]], "env": [[0.5, 1.0], [1.5, 1.8]], "trainer": [[2.0, 3.0]]},
         "idle": {"engine": 0.4, "env": 0.8, "trainer": 0.6}, "staleness": {"0": 4}, "stale_groups": 0},
        {"step": 2, "timeline": {"engine": [[3.0, 4.5]], "env": [[3.2, 3.6]], "trainer": [[4.5, 5.0]]},
         "idle": {"engine": 0.2, "env": 0.6, "trainer": 0.9}, "staleness": {"0": 2, "1": 2}, "stale_groups": 1},
        {"step": 3, "timeline": {"engine": [[0.5, 1.5]], "env": [[0.7, 1.0]], "trainer": [[1.5, 2.0]]},
         "idle": {"engine": 0.3, "env": 0.7, "trainer": 0.6}, "staleness": {"1": 3, "2": 1}, "stale_groups": 2},
    ]


def is_png(data: bytes) -> bool:
    """A PNG that Pillow reads whole, wide enough to be a plot."""
    image = Image.open(io.BytesIO(data))
    image.verify()
    return image.format == "PNG" and image.size[0] > 300


def test_idle_table_and_timeline_plot():
    rows = timeline_rows()
    table = idle_table(rows)
    assert table["steps"] == 3 and list(table["idle"]) == ["engine", "env", "trainer"]
    assert table["idle"] == pytest.approx({"engine": 0.3, "env": 0.7, "trainer": 0.7})
    assert table["staleness"] == {"0": 6, "1": 5, "2": 1} and table["stale_groups"] == 3
    # synchronous rows have no staleness figures; a row without `idle` is left out of the means
    sync = [{k: v for k, v in row.items() if k not in ("staleness", "stale_groups")} for row in rows]
    assert idle_table([*sync, {"step": 4}]) == {**table, "staleness": None, "stale_groups": None}
    # the resumed run's step is moved to start at the last step's end (5.0)
    steps = timeline_steps(rows)
    assert [(s["step"], s["end"], s["resumed"]) for s in steps] == [(1, 3.0, False), (2, 5.0, False), (3, 7.0, True)]
    assert steps[2]["spans"]["engine"] == [[5.5, 6.5]] and steps[1]["spans"] == rows[1]["timeline"]
    assert is_png(plot_timeline(rows))
    # a long run draws its last steps; rows from before the timeline are skipped
    long_run = [{"step": 0}] + [{"step": s, "timeline": {"engine": [[s, s + 0.6]], "env": [[s + 0.1, s + 0.2]],
                                                          "trainer": [[s + 0.6, s + 1.0]]},
                                 "idle": {"engine": 0.4, "env": 0.9, "trainer": 0.6}} for s in range(1, 41)]
    assert is_png(plot_timeline(long_run))
    with pytest.raises(ValueError, match="no metrics row has a timeline"):
        plot_timeline([{"step": 1, "mean_reward": 0.5}])


def test_report_with_a_timeline(runs):
    run_a, _, train, _ = runs
    timed = train.parent / "train_timed"
    timed.mkdir()
    rows = [{**row, "mean_reward": 0.2, "success": 0.1} for row in timeline_rows()]
    (timed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md_path, html_path = write_report(run_a, train_dir=timed)
    md, html = md_path.read_text(), html_path.read_text()
    assert "### Timeline" in md and "](report_files/timeline.png)" in md
    assert is_png((run_a / "report_files" / "timeline.png").read_bytes())
    assert "| engine | 0.300 |" in md and "| env | 0.700 |" in md and "| trainer | 0.700 |" in md
    assert "0: 6, 1: 5, 2: 1; stale groups dropped: 3." in md and "averaged over 3 steps" in md
    assert '<h3 id="timeline">Timeline</h3>' in html and "<td>trainer</td><td>0.700</td>" in html
    assert "0: 6, 1: 5, 2: 1" in html and "stale groups dropped: 3" in html
    pngs = re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{100,}"', html)
    assert len(pngs) == 4  # success, hops, reward curve, timeline


def test_report_with_the_entropy_law(runs):
    """A run evaluated during training (`[eval] every`) gets the law's panel; one without (`runs`) does not."""
    from test_entropy_law import run_rows

    run_a, _, train, _ = runs
    assert "Entropy–performance law" not in write_report(run_a, train_dir=train)[0].read_text()
    evaluated = train.parent / "train_evaluated"
    evaluated.mkdir()
    (evaluated / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run_rows()))
    (evaluated / "summary.json").write_text(json.dumps({"after": {"success": 0.74, "mean_reward": 0.74}}))
    md_path, html_path = write_report(run_a, train_dir=evaluated)
    md, html = md_path.read_text(), html_path.read_text()
    assert "### Entropy–performance law" in md and "](report_files/entropy_law.png)" in md
    assert "Final held-out success 0.740" in md and "at 5 evaluations" in md and "| 20 | 0." in md
    assert is_png((run_a / "report_files" / "entropy_law.png").read_bytes())
    assert '<h3 id="entropy-law">' in html and 'id="entropy-law-table"' in html


def test_report_comparison_markdown(runs):
    run_a, run_b, _, _ = runs
    md = write_report(run_a, vs=run_b)[0].read_text()
    assert "## Comparison: a (tiny-grpo) (A) vs b (tiny-sft) (B)" in md
    section = md.split("## Comparison")[1].splitlines()
    row = next(line for line in section if line.startswith(f"| {UNSEEN} |"))
    assert f"| {4 / 7:.3f} [" in row and "| 0.000 [0.00, 0.39] |" in row
    all_row = next(line for line in section if line.startswith("| all |"))
    assert "better" in all_row  # 6/15 scored vs 0/12: the interval excludes 0


def test_viewer_escapes_and_shows_tokens(runs, tokenizer):
    run_a, _, _, trajectories = runs
    path = write_viewer(run_a, tokenizer=tokenizer)
    assert path == run_a / "viewer.html"
    html = path.read_text()
    assert EVIL not in html and html.count("<script") == 2  # the token JSON and the filter script
    assert "&lt;answer&gt;&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;&lt;/answer&gt;" in html
    assert html.count('<details class="episode"') == len(trajectories)
    data = json.loads(re.search(r'<script type="application/json" id="token-data">(.*?)</script>', html, re.DOTALL)[1])
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert all(data["vocab"][str(i)] == tokenizer.decode([i]) for i in paris)
    first = data["episodes"][0]
    assert len(first["ids"]) == len(first["mask"]) and 1 in first["mask"] and 0 in first["mask"]
    assert '<option value="error">error</option>' in html and f'<option value="{HOPS}">' in html
    assert "ConnectionError: retriever down &lt;b&gt;|&lt;/b&gt;" in html
    assert 'href="report.html"' not in html  # no report written yet
    write_report(run_a)
    assert 'href="report.html"' in write_viewer(run_a).read_text()


def test_viewer_on_a_training_file_without_tokenizer(tmp_path, runs):
    _, _, _, trajectories = runs
    bare = [Trajectory.from_dict({**t.to_dict(), "metrics": {}, "logs": {}}) for t in trajectories[:3]]
    path = tmp_path / "train" / "sft_demos.jsonl"
    write_jsonl(bare, path)
    out = write_viewer(path, limit=2)
    assert out == tmp_path / "train" / "sft_demos.html"
    html = out.read_text()
    assert html.count('<details class="episode"') == 2
    assert 'data-success="unknown"' in html and "ids: no tokenizer given" in html
    data = json.loads(re.search(r'id="token-data">(.*?)</script>', html, re.DOTALL)[1])
    assert data["vocab"] is None and data["episodes"][0]["ids"] == list(bare[0].token_ids)


def test_turn_blocks(runs, tokenizer):
    _, _, _, trajectories = runs
    blocks = turn_blocks(trajectories[0])  # prompt, then the search turn with its observation, then the answer
    assert [b["index"] for b in blocks] == [None, 0, 1]
    assert [[m["role"] for m in b["messages"]] for b in blocks] == [["system", "user"], ["assistant", "tool"],
                                                                    ["assistant"]]
    assert blocks[1]["messages"][0]["tool_calls"][0]["name"] == "search" and blocks[2]["turn"]["observation"] == 0
    # cut off mid-turn: the rollout records the sampled tokens but no message; the viewer still shows them
    prompt, sampled = tokenizer.encode("Question?"), tokenizer.encode(" partial answ")
    T = len(prompt) + len(sampled)
    cut = Trajectory("t", tuple(prompt + sampled), (0,) * len(prompt) + (1,) * len(sampled), (0.0,) * T, len(prompt),
                     (Turn(len(prompt), T, T, 0.0, "length"),), 0.0, stop=StopReason.MAX_TOKENS,
                     reason="max_tokens reached mid-turn", messages=(Message("user", "Question?"),))
    blocks = turn_blocks(cut, tokenizer.decode)
    assert [b["index"] for b in blocks] == [None, 0] and blocks[1]["messages"] == []
    assert blocks[1]["unparsed"] == " partial answ" and blocks[1]["turn"]["finish_reason"] == "length"
    assert turn_blocks(cut)[1]["unparsed"] == " ".join(map(str, sampled))  # no tokenizer: the ids


def test_report_of_an_unfinished_empty_run(tmp_path):
    run = {"suite": "s", "model": "m", "k": [1, 8], "n": 8, "seed": 0, "entries": [{"name": "e:x", "env": "e",
           "split": "x", "n_tasks": 5}], "started": "2025-01-01T10:00:00", "finished": None, "seconds": None}
    (tmp_path / "run.json").write_text(json.dumps(run))
    md, html = write_report(tmp_path)
    assert "**not finished**" in md.read_text() and "| **all** | 0 | **— ** |" in md.read_text()
    assert "This run has not finished" in html.read_text()
    with pytest.raises(FileNotFoundError, match="no trajectories"):
        write_viewer(tmp_path)
    with pytest.raises(FileNotFoundError, match="not an eval run directory"):
        write_report(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------- browser

INSTALL = ("apt-get install -y chromium   # Debian's Chromium at /usr/bin/chromium (or set AGENTRL_CHROMIUM)\n"
           "pip install playwright        # the Python package only: its own browser download is not needed")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Playwright. Missing pieces fail (CI must install them), with how to."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"the browser tests need Playwright; install it with:\n{INSTALL}")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"the browser tests need Chromium at {CHROMIUM}; install it with:\n{INSTALL}")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def screenshots_dir(tmp_path: Path) -> Path:
    out = Path(os.environ.get("AGENTRL_SCREENSHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    print(f"screenshots in {out}")
    return out


def open_page(browser, path: Path):
    """A page at file://path that records console errors, page errors and failed requests."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
    page.on("dialog", lambda d: problems.append(f"dialog (injected script ran?): {d.message}"))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page, problems


@pytest.mark.browser
def test_report_in_browser(browser, runs, tmp_path):
    run_a, run_b, train, _ = runs
    _, html = write_report(run_a, vs=run_b, train_dir=train)
    write_viewer(run_a)
    page, problems = open_page(browser, html)
    images = page.eval_on_selector_all("img.plot", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
    assert len(images) == 4 and all(w > 100 for w in images)  # success, hops, reward curve, learning dynamics
    assert page.locator("#results-table tbody tr").count() == 3
    page.screenshot(path=screenshots_dir(tmp_path) / "report.png", full_page=True)
    page.click('#results-table a[href^="viewer.html#entry="]')  # the first entry's episodes
    page.wait_for_load_state("load")
    assert page.url.endswith("viewer.html#entry=" + UNSEEN.replace("/", "%2F").replace(":", "%3A"))
    assert page.locator("#f-entry").input_value() == UNSEEN
    assert page.locator("details.episode:not(.hidden)").count() == 8
    assert problems == []
    page.close()


@pytest.mark.browser
def test_viewer_in_browser(browser, runs, tokenizer, tmp_path):
    run_a, _, _, trajectories = runs
    page, problems = open_page(browser, write_viewer(run_a, tokenizer=tokenizer))
    episodes = page.locator("details.episode:not(.hidden)")
    assert episodes.count() == len(trajectories) == 16
    page.screenshot(path=screenshots_dir(tmp_path) / "viewer_list.png", full_page=True)
    page.select_option("#f-status", "error")
    assert episodes.count() == 1 and page.locator("#shown").inner_text() == "1 of 16 shown"
    page.select_option("#f-status", "")
    page.select_option("#f-success", "yes")
    assert episodes.count() == 6
    page.select_option("#f-success", "")
    page.fill("#f-text", "pwned")
    assert episodes.count() == 1
    episode = episodes.first
    episode.locator("summary").first.click()
    assert episode.locator(".msg pre", has_text="alert('pwned')").count() == 1  # shown as text, not run
    episode.locator("details.tokens > summary").click()
    tokens = episode.locator(".tok")
    tokens.first.wait_for()  # drawn on the toggle event
    ids = next(t for t in trajectories if t.answer == EVIL).token_ids
    assert tokens.count() == len(ids)
    assert episode.locator(".tok.s").count() == sum(next(t for t in trajectories if t.answer == EVIL).loss_mask)
    assert "".join(tokens.all_inner_texts()).replace("\u21b5", "") == "".join(tokenizer.decode([i]) for i in ids)
    page.screenshot(path=screenshots_dir(tmp_path) / "viewer.png", full_page=True)
    assert problems == []
    page.close()
