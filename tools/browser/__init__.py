"""A real browser for the web envs: one Chromium per process through Playwright, a fresh context per episode."""

from agentrl.tools.browser.runtime import (ActionError, Browser, BrowserError, PageState, Session, Site,
                                           is_local,                                            shared_browser)

__all__ = ["ActionError", "Browser", "BrowserError", "PageState", "Session", "Site", "is_local", "shared_browser"]
