"""The base of the web envs: a real Chromium page per episode, read as text and acted on through tools.

Each turn the model calls one tool: `click(id)`, `fill(id, text)`, `select(id, option)`, `press(key)`,
`scroll(direction)`, `goto(url)` (pages of the task's site only), or ends the episode with `answer(text)` / `done()`.
The tool's result is the page after the action: its URL, title, and one line per visible element, the ones
that can be acted on numbered (`[3] button "Submit"`); numbers stay with their element while the page
lives. A failed action (no element [9], a click that cannot land, a page that is not local) is the first
line of that observation, not a crash; a browser that dies ends the episode as `error`.

Observations are cut to `max_obs_words` words (the search env's model-independent token budget) and say
so; `screenshots=DIR` saves a PNG of the page after every action; the trajectory's `logs["screenshots"]`
holds their (turn, path) pairs.

A subclass opens the task's page (`start`), says when the page has ended the task (`finished`), and scores
it (`score`).
"""

from __future__ import annotations

import abc
import itertools
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from agentrl.env.api import EnvNotReady, ToolEnv
from agentrl.tools import PARSERS, ToolSet, tool
from agentrl.tools.browser import ActionError, BrowserError, PageState, Session, Site, shared_browser
from agentrl.tools.browser.runtime import find_chromium
from agentrl.types import Message, Task, ToolCall

SYSTEM_PROMPT = (
    "You operate a web browser to complete the user's task. Each turn, call exactly one tool. Elements of the "
    "page are numbered like [3]; use these numbers in click, fill and select. When the task is complete, call "
    "done (or answer, if the task asks for an answer).\n{fmt}"
)
# The task's own page, opened at reset, may take longer than a model's action may (a busy machine, several
# episodes loading at once): its timeout is not the model's to spend.
START_TIMEOUT = 30.0
_episodes = itertools.count()


class WebEnv(ToolEnv):
    """The base of the web envs: a Chromium page per episode, observed as text and acted on through tools.

    A subclass implements `load_tasks`, `start`, `finished`, `instruction`, `score` and `solve`.
    """

    root: str | None = None  # CSS selector of the part of the page that is observed (default: the body)

    def __init__(self, split: str = "train", max_turns: int = 10, max_invalid: int = 3, parser: str = "hermes",
                 max_obs_words: int = 400, screenshots: str | None = None, max_sessions: int = 8,
                 reward_weights: dict[str, float] | None = None):
        self.max_obs_words, self.max_sessions = max_obs_words, max_sessions
        self.max_concurrent_episodes = max_sessions  # each holds a browser session of this process while it runs
        self.screenshot_dir = Path(screenshots).expanduser() if screenshots else None
        self._session: Session | None = None
        self._ended_by: str | None = None  # "done" or "answer" once the model ends the episode

        def action(fn: Callable[[], None]) -> str:
            try:
                fn()
                return self.observation()
            except ActionError as e:
                return self.observation(error=str(e))

        @tool(timeout=60.0)
        def click(id: int) -> str:
            """Click an element of the page.

            Args:
                id: The element's number, as shown in brackets on the page.
            """
            return action(lambda: self.session.click(id))

        @tool(timeout=60.0)
        def fill(id: int, text: str) -> str:
            """Replace the text of a text field.

            Args:
                id: The text field's number.
                text: The text to type into it.
            """
            return action(lambda: self.session.fill(id, text))

        @tool(timeout=60.0)
        def select(id: int, option: str) -> str:
            """Choose an option of a drop-down list.

            Args:
                id: The list's number.
                option: The option's text, as shown in the list's options.
            """
            return action(lambda: self.session.select(id, option))

        @tool(timeout=60.0)
        def press(key: str) -> str:
            """Press a key on the focused element, e.g. Enter, Tab, ArrowDown or Control+a.

            Args:
                key: The key's name.
            """
            return action(lambda: self.session.press(key))

        @tool(timeout=60.0)
        def scroll(direction: str) -> str:
            """Scroll the page.

            Args:
                direction: One of up, down, left, right.
            """
            return action(lambda: self.session.scroll(direction))

        @tool(timeout=60.0)
        def goto(url: str) -> str:
            """Open a URL of this task's site.

            Args:
                url: The address to open.
            """
            return action(lambda: self.session.goto(url))  # the session's site decides what loads

        @tool(timeout=1.0)
        def answer(text: str) -> str:
            """End the episode with an answer, for tasks that ask a question.

            Args:
                text: The answer.
            """
            return text

        @tool(timeout=1.0)
        def done() -> str:
            """End the episode: the task is complete."""
            return ""

        super().__init__(ToolSet([click, fill, select, press, scroll, goto, answer, done]), PARSERS[parser](),
                         split=split, max_turns=max_turns, max_invalid=max_invalid,
                         reward_weights=reward_weights or {"outcome": 1.0}, answer_tool="answer")

    # ---- the subclass's part ----
    @abc.abstractmethod
    def start(self, task: Task) -> None:
        """Open the task's page in `self.session`."""

    @abc.abstractmethod
    def finished(self) -> bool:
        """Whether the page has ended the task (a MiniWoB page reports done, a shop order was placed)."""

    def site(self, task: Task) -> Site:
        """Where the page may go once the task has started: by default the origin (http) or the folder (file) of
        the page `start` opened."""
        return Site(self.session.page.url)

    @abc.abstractmethod
    def instruction(self, task: Task) -> str:
        """The task in words, for the first user message (read after `start`: a page may state it)."""

    # ---- the episode ----
    @property
    def session(self) -> Session:
        """This episode's browser session, opened on first use in the process's shared browser."""
        if self._session is None:
            self._session = shared_browser(self.max_sessions).open_session()
        return self._session

    def check_ready(self) -> None:
        """A Chromium for Playwright to drive."""
        try:
            find_chromium()
        except BrowserError as e:
            raise EnvNotReady(f"the web envs drive a real Chromium: {e}") from e

    def on_reset(self, task: Task) -> None:
        super().on_reset(task)
        self._close_session()
        self._ended_by, self._episode, self._shots = None, next(_episodes), 0
        self.start(task)
        self.session.restrict(self.site(task))  # not the machine's other files or services

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The system prompt, and the task's instruction with the page as it is after `start`."""
        return (Message("system", SYSTEM_PROMPT.format(fmt=self.parser.instructions)),
                Message("user", f"Task: {self.instruction(task)}\n\n{self.observation()}"))

    def act(self, action: str):
        obs, reward, terminated, info = super().act(action)
        if terminated:
            return obs, reward, terminated, info
        if info.get("tool_calls"):
            info = {**info, **self._screenshot()}
            call = self.transcript[-1].tool_calls[0].name
            if call == "done" or self.finished():
                _, reward, terminated, final = self._finish("")
                return [], reward, True, {**info, **final, "ended_by": "model" if call == "done" else "page"}
        return obs, reward, terminated, info

    def observation(self, error: str | None = None) -> str:
        """The page as the model sees it, within the word budget."""
        return render(self.session.observe(self.root), self.max_obs_words, error)

    def close(self) -> None:
        self._close_session()
        super().close()

    def _close_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    def _screenshot(self) -> dict[str, Any]:
        if self.screenshot_dir is None:
            return {}
        self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        self._shots += 1
        path = self.screenshot_dir / f"{self.task.id.replace('/', '_')}-ep{self._episode}-{self._shots}.png"
        path.write_bytes(self.session.screenshot())
        return {"per_turn": {"screenshots": str(path)}}  # the trajectory's logs["screenshots"]: (turn, path) pairs

    # ---- scripted solutions ----
    def gold_actions(self, task: Task) -> Iterator[str]:
        """A scripted solver that reads the live page: a generator, so each action sees the page the previous
        one left (element numbers are only known once a page is shown). Subclasses yield `ToolCall`s from
        `solve`."""
        for call in self.solve(task):
            yield self.parser.format_call(call)

    @abc.abstractmethod
    def solve(self, task: Task) -> Iterator[ToolCall]:
        """Tool calls that complete `task`, each computed from the page as it is when it is asked for."""

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        raise NotImplementedError("web demonstrations are played on a live page; SFT warm starts for the web envs "
                                  "are not built (use a hub model that can already call tools)")


def render(state: PageState, max_words: int, error: str | None = None) -> str:
    """URL, title, the last action's error, and the page's lines up to `max_words` words (cut at a line)."""
    head = [f"URL: {state.url}", f"Title: {state.title}"]
    if error:
        head.append(f"Last action failed: {error}")
    kept, words = [], 0
    for i, line in enumerate(state.lines):
        n = len(line.split())
        if words + n > max_words:
            kept.append(f"[{len(state.lines) - i} more lines not shown: the observation is limited to {max_words} "
                        f"words; scroll or act on what is shown]")
            break
        kept.append(line)
        words += n
    return "\n".join(head + ["", *kept])


def find_one(state: PageState, role: str | None, name: str) -> int:
    """The number of the element with this role and name; the scripted solvers' way to read a page."""
    found = state.find(role, name)
    if not found:
        raise LookupError(f"no {role or 'element'} named {name!r} on {state.url}: {state.lines}")
    return found[0]["id"]
