"""A real Chromium for the web envs, driven through Playwright.

    browser = shared_browser()              # one Chromium per process, launched on first use
    with browser.session() as page:         # a fresh context (cookies, storage, cache) per episode
        page.goto("file:///.../task.html")  # only file:// and loopback URLs load; the rest is blocked
        page.restrict(Site(page.url))       # from now on, only this task's site loads
        state = page.observe()              # URL, title, and the page as text with numbered elements
        page.click(3)                       # act on element [3] of the observation

Playwright's sync API belongs to the thread that started it, and the rollout engine steps envs from many
threads; so the async API runs on one private event-loop thread and every call is submitted to it. At most
`max_sessions` contexts are open at once; every call has a timeout. The browser closes at exit; if this
process is killed, Playwright's driver sees its pipe close and takes the browser down with it.

Every request a page makes (navigations, scripts, images, frames, WebSockets) passes the session's request
route, which sees the URL as Chromium parsed it (`%2e%2e` resolved, `\\` read as `/`): so a session restricted
to a `Site` loads nothing else, however the model spells a URL. A server's redirect is fetched without being
followed and followed only onto the site; a popup is closed.

Two kinds of failure: `ActionError` is the model's (no element [7], a click that cannot land, a blocked URL):
the env shows it as the observation's error line. `BrowserError` is the browser's (crashed, hung): the episode
ends as `error`.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from importlib.resources import files
from pathlib import Path
from typing import Any, Coroutine, Iterator
from urllib.parse import unquote, urljoin, urlsplit

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ALWAYS_ALLOWED_SCHEMES = ("file", "data", "about", "blob")
DEFAULT_PORTS = {"http": 80, "https": 443}
# Marks this process's Chromium on its command line, so that tests (and people) can find leftovers.
OWNER_FLAG = "--agentrl-owner"
_OBSERVE_JS = files("agentrl.tools.browser").joinpath("observe.js").read_text()
INSTALL_HINT = ("Install Debian's Chromium and the Playwright package (its own browser download is not used):\n"
                "    apt-get install -y chromium && pip install playwright     # or: make setup-browser")


class BrowserError(RuntimeError):
    """The browser failed (crashed, closed, or did not answer in time): the episode ends as `error`."""


class ActionError(Exception):
    """The model's action could not be carried out; the message is written for the model."""


def is_local(url: str) -> bool:
    """Whether the runtime lets `url` load: file/data/about/blob URLs and http(s) on the loopback."""
    parts = urlsplit(url)
    if parts.scheme in ALWAYS_ALLOWED_SCHEMES:
        return True
    return parts.scheme in ("http", "https", "ws", "wss") and (parts.hostname or "") in LOCAL_HOSTS


@dataclass(frozen=True)
class Site:
    """Where an episode's page may go once its task has started.

    An http(s) site is one origin: exactly its scheme, host and port. A file site is the real paths under
    `folder` (default: the folder of `url`'s file), symlinks resolved. With `navigate=False` the page may load
    what it needs but never leave its document (a MiniWoB page: another page, or a reload, is another task).
    """

    url: str
    folder: str | None = None
    navigate: bool = True

    def allows(self, url: str) -> bool:
        """Whether `url` (as Chromium spells it) is on this site."""
        a, b = urlsplit(url), urlsplit(self.url)
        if a.scheme != b.scheme:
            return False
        if a.scheme == "file":
            return a.netloc in ("", "localhost") and _real_path(a.path).is_relative_to(self.root)
        return a.scheme in DEFAULT_PORTS and (a.hostname, a.port or DEFAULT_PORTS[a.scheme]) == \
            (b.hostname, b.port or DEFAULT_PORTS[b.scheme])

    @cached_property  # resolved once, not on every request the page makes
    def root(self) -> Path:
        """A file site's folder, as a real path."""
        return _real_path(self.folder or os.path.dirname(urlsplit(self.url).path))

    def __str__(self) -> str:
        parts = urlsplit(self.url)
        return f"{self.root}/" if parts.scheme == "file" else f"{parts.scheme}://{parts.netloc}"


def _real_path(url_path: str) -> Path:
    return Path(os.path.realpath(unquote(url_path)))


def find_chromium() -> str:
    """The Chromium executable: $AGENTRL_CHROMIUM, else `chromium` (Debian) or `chromium-browser` on PATH."""
    path = os.environ.get("AGENTRL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise BrowserError(f"no Chromium found (set AGENTRL_CHROMIUM to its path). {INSTALL_HINT}")
    return path


@dataclass
class PageState:
    """What a text policy sees of the page. `lines` holds one line per element, actionable ones numbered."""

    url: str
    title: str
    lines: list[str]
    elements: list[dict[str, Any]] = field(default_factory=list)

    def element(self, id: int) -> dict[str, Any] | None:
        """The element numbered `id`, or None."""
        return next((e for e in self.elements if e["id"] == id), None)

    def find(self, role: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
        """Elements with this role and (case-insensitively) this exact name, in page order."""
        return [e for e in self.elements if (role is None or e["role"] == role)
                and (name is None or e["name"].lower() == name.lower())]


class Browser:
    """One Chromium process; `session()` opens a fresh context and page for one episode."""

    def __init__(self, executable: str | None = None, max_sessions: int = 8, action_timeout: float = 5.0,
                 launch_timeout: float = 60.0, headless: bool = True, warm_contexts: int = 2,
                 viewport: tuple[int, int] = (1280, 800)):
        try:
            from playwright.async_api import async_playwright
        except ImportError as e:
            raise BrowserError(f"the web envs need Playwright. {INSTALL_HINT}") from e
        self.executable = executable or find_chromium()
        self.action_timeout, self.viewport = action_timeout, viewport
        # Contexts made ahead (a new one costs ~250 ms): a session takes one and the loop makes the next while
        # the episode runs. Only the loop thread touches these.
        self.warm_contexts, self._warm, self._warming = warm_contexts, [], 0
        self.blocked: list[str] = []  # requests the runtime refused, for tests and logs
        self._slots = threading.BoundedSemaphore(max_sessions)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agentrl-browser", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._playwright = self.call(async_playwright().start(), launch_timeout)
            self._browser = self.call(self._playwright.chromium.launch(
                executable_path=self.executable, headless=headless,
                args=[f"{OWNER_FLAG}={os.getpid()}",
                      # Hostnames other than localhost do not resolve: a second wall behind the request filter,
                      # for requests that filter cannot see (service workers, prefetch).
                      "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
                      "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking"]),
                launch_timeout)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    def call(self, coroutine: Coroutine, timeout: float | None = None) -> Any:
        """Runs `coroutine` on the browser's loop and returns its result (Playwright errors → BrowserError)."""
        if self._closed:
            coroutine.close()
            raise BrowserError("the browser is closed")
        timeout = timeout if timeout is not None else self.action_timeout + 30.0
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise BrowserError(f"the browser did not answer within {timeout} s") from None
        except ActionError:
            raise
        except Exception as e:  # Playwright's errors: a closed target, a crashed browser
            raise BrowserError(f"{type(e).__name__}: {e}") from e

    @property
    def connected(self) -> bool:
        """Whether the browser is open and Chromium is still connected."""
        return not self._closed and self._browser.is_connected()

    @contextmanager
    def session(self, timeout: float = 120.0) -> Iterator["Session"]:
        """A fresh context and page, closed on exit; waits up to `timeout` s for one of `max_sessions`."""
        page = self.open_session(timeout)
        try:
            yield page
        finally:
            page.close()

    def open_session(self, timeout: float = 120.0) -> "Session":
        """Like `session()`, for callers that close it themselves (envs, whose episodes span calls)."""
        if not self._slots.acquire(timeout=timeout):
            raise BrowserError(f"all browser sessions stayed busy for {timeout:.0f} s")
        try:
            context, page = self.call(self._take_context())
        except BaseException:
            self._slots.release()
            raise
        session = Session(self, context, page)
        try:
            self.call(session._guard())
        except BaseException:
            session.close()
            raise
        return session

    async def _take_context(self):
        made = self._warm.pop() if self._warm else await self._new_context()
        while len(self._warm) + self._warming < self.warm_contexts:
            self._warming += 1
            self._loop.create_task(self._make_warm())
        return made

    async def _make_warm(self) -> None:
        try:
            self._warm.append(await self._new_context())
        except Exception:  # noqa: BLE001 -- the browser is going away; a session will report it
            pass
        finally:
            self._warming -= 1

    async def _new_context(self):
        width, height = self.viewport
        context = await self._browser.new_context(viewport={"width": width, "height": height},
                                                  service_workers="block")
        context.set_default_timeout(self.action_timeout * 1000)
        return context, await context.new_page()

    def close(self) -> None:
        """Closes the browser and the driver; idempotent."""
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            for context, _ in self._warm:
                try:
                    await context.close()
                except Exception:  # noqa: BLE001 -- already dead
                    pass
            for name in ("_browser", "_playwright"):
                thing = getattr(self, name, None)
                if thing is not None:
                    try:
                        await (thing.close() if name == "_browser" else thing.stop())
                    except Exception:  # noqa: BLE001 -- already dead: nothing left to close
                        pass

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(30)
            except Exception:  # noqa: BLE001 -- closing is best effort; the driver kills Chromium when it exits
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


class Session:
    """One episode's page. Element ids are those of the latest `observe()`."""

    def __init__(self, browser: Browser, context, page):
        self.browser, self._context, self.page = browser, context, page
        self.site: Site | None = None  # None: any local URL loads (the env opening its task)
        self._refused_navigation = False  # set by the request route when it cancels a navigation
        self.closed = False

    def restrict(self, site: Site) -> None:
        """From now on, this page loads only what `site` allows; every other request is refused."""
        self.site = site

    # ---- reading ----
    def observe(self, root: str | None = None) -> PageState:
        """The page as text: every visible element under `root` (a CSS selector; default the body)."""
        async def read():
            snapshot = await self.page.evaluate(_OBSERVE_JS, root)
            return PageState(self.page.url, await self.page.title(), snapshot["lines"], snapshot["elements"])
        return self._call(read())

    def evaluate(self, expression: str, arg: Any = None) -> Any:
        """Evaluates JavaScript `expression` (with `arg`) in the page and returns its result.

        A script that throws raises BrowserError.
        """
        return self._call(self.page.evaluate(expression, arg))

    def screenshot(self) -> bytes:
        """A PNG of the viewport."""
        return self._call(self.page.screenshot(type="png"))

    # ---- acting ----
    def goto(self, url: str, timeout: float | None = None) -> None:
        """Opens `url` and waits up to `timeout` s (default: the action timeout) for its load event; ActionError if
        it is off the site or does not load."""
        if self.site is None and not is_local(url):
            raise ActionError(f"{url} is not a local page; only file:// and localhost URLs can be opened")
        if self.site is not None and not self.site.navigate:
            raise ActionError(f"{url} was not opened: this task stays on its own page")
        # Only these schemes pass the request route; the others (data:, javascript:) would bypass it.
        if self.site is not None and urlsplit(url).scheme not in ("http", "https", "file"):
            raise ActionError(f"{url} cannot be opened; only pages of this task's site ({self.site}) can")

        async def goto():
            self._refused_navigation = False
            try:
                await self.page.goto(url, wait_until="load", timeout=load_timeout * 1000)
            except Exception as e:  # a missing file, a refused port, a slow page, a refused request
                if not self.browser.connected:
                    raise
                if self._refused_navigation:
                    raise ActionError(f"{url} is not on this task's site ({self.site})") from e
                raise ActionError(f"could not open {url}: {str(e).splitlines()[0]}") from e
        load_timeout = timeout if timeout is not None else self.browser.action_timeout
        self._call(goto(), load_timeout + 30.0)

    def click(self, id: int) -> None:
        """Clicks element [`id`]; ActionError if there is none or the click fails."""
        self._act(id, "click")

    def fill(self, id: int, text: str) -> None:
        """Types `text` into element [`id`] (an input, textarea or editable element), replacing its content."""
        self._act(id, "fill", text)

    def select(self, id: int, option: str) -> None:
        """Picks the option labelled `option` in the `<select>` element [`id`]."""
        self._act(id, "select_option", label=option)

    def press(self, key: str) -> None:
        """Presses `key` (a Playwright key name: Enter, ArrowDown, Control+a) on the focused element."""
        async def press():
            try:
                await self.page.keyboard.press(key)
            except Exception as e:
                if "Unknown key" in str(e):
                    raise ActionError(f"unknown key {key!r}; use names like Enter, Tab, ArrowDown, a, Control+a") from e
                raise
            await self._settle()
        self._call(press())

    def scroll(self, direction: str) -> None:
        """Turns the mouse wheel 600 px toward `direction` (up, down, left or right); ActionError for others."""
        deltas = {"down": (0, 600), "up": (0, -600), "right": (600, 0), "left": (-600, 0)}
        if direction not in deltas:
            raise ActionError(f"scroll direction must be one of {', '.join(deltas)}; got {direction!r}")
        self._call(self.page.mouse.wheel(*deltas[direction]))

    def close(self) -> None:
        """Closes the context and frees its slot of `max_sessions`; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.browser.connected:
                self.browser.call(self._context.close(), 30)
        finally:
            self.browser._slots.release()

    # ---- internals ----
    async def _guard(self) -> None:
        """Every request of the context through `_route`, every WebSocket through `_route_web_socket`; a page the
        episode's page opens (a popup, `target=_blank`) is closed: the episode has one page."""
        await self._context.route("**/*", self._route)
        await self._context.route_web_socket(lambda url: True, self._route_web_socket)
        self._context.on("page", lambda page: None if page == self.page else asyncio.ensure_future(page.close()))

    async def _route(self, route) -> None:
        request = route.request
        try:
            leaving = request.is_navigation_request() and request.frame.parent_frame is None  # the page would change
        except Exception:  # noqa: BLE001 -- Playwright's Error: a popup's first navigation, before its frame exists
            leaving = True
        if not self._allows(request.url, leaving):
            await self._refuse(route, request.url, leaving)
            return
        if self.site is None or urlsplit(request.url).scheme not in DEFAULT_PORTS:
            await route.continue_()
            return
        # Chromium follows a server's redirect without asking the route again: fetch without following, and let
        # the browser follow (back through here) only a redirect that stays on the site.
        response = await route.fetch(max_redirects=0)
        target = urljoin(request.url, response.headers.get("location", "")) if 300 <= response.status < 400 else None
        if target is not None and not self._allows(target, leaving):
            await self._refuse(route, target, leaving)
            return
        await route.fulfill(response=response)

    async def _refuse(self, route, url: str, leaving: bool) -> None:
        self.browser.blocked.append(url)
        self._refused_navigation |= leaving
        # A refused navigation is cancelled ("aborted"), not failed: a failed one replaces the page by an error page.
        await route.abort("aborted" if leaving else "blockedbyclient")

    async def _route_web_socket(self, ws) -> None:
        if self._allows(ws.url.replace("ws", "http", 1), False):  # a site's origin is its http(s) one
            ws.connect_to_server()
        else:
            self.browser.blocked.append(ws.url)
            await ws.close(code=1008, reason="not on this task's site")

    def _allows(self, url: str, leaving: bool) -> bool:
        if self.site is None:
            return is_local(url)
        if leaving:
            return self.site.navigate and self.site.allows(url)
        return self.site.allows(url) or urlsplit(url).scheme in ("data", "blob")

    def _call(self, coroutine: Coroutine, timeout: float | None = None) -> Any:
        if self.closed:
            coroutine.close()
            raise BrowserError("this browser session is closed")
        return self.browser.call(coroutine, timeout)

    def _act(self, id: int, method: str, *args: Any, **kwargs: Any) -> None:
        async def act():
            locator = self.page.locator(f'[data-agentrl-id="{int(id)}"]')
            if await locator.count() == 0:
                raise ActionError(f"there is no element [{id}] on this page; use a number from the latest page")
            try:
                await getattr(locator.first, method)(*args, **kwargs)
            except Exception as e:  # the element is covered, detached, not editable, has no such option...
                if not self.browser.connected:
                    raise
                first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ActionError(f"{method.replace('_option', '')} on [{id}] failed: {first_line}") from e
            await self._settle()
        self._call(act())

    async def _settle(self) -> None:
        """Lets a navigation or script that the action started finish before the next observation."""
        try:
            await self.page.wait_for_load_state("load", timeout=self.browser.action_timeout * 1000)
        except Exception:  # noqa: BLE001 -- a slow page: observe what is there
            pass


_SHARED: Browser | None = None
_SHARED_LOCK = threading.Lock()


def shared_browser(max_sessions: int = 8) -> Browser:
    """This process's browser, launched on first use and again if it has died."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED.connected:
            if _SHARED is not None:
                _SHARED.close()
            _SHARED = Browser(max_sessions=max_sessions)
        return _SHARED
