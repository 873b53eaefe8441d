"""Web envs: a real Chromium through Playwright. MiniWoB++ tasks (`web/miniwob-*`) and a local shop (`web/shop-v0`)."""

from agentrl.envs.web.env import WebEnv
from agentrl.envs.web.miniwob import MiniWoBEnv

__all__ = ["MiniWoBEnv", "WebEnv"]
