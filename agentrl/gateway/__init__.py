"""The gateway: an OpenAI-compatible server in front of the policy that records agent programs' calls as
exact-token trajectories (`sessions`, `segments`), served over HTTP by `app`, trained through `agents`."""

from agentrl.gateway.app import create_app
from agentrl.gateway.sessions import Gateway, GatewayConfig, GatewayError

__all__ = ["Gateway", "GatewayConfig", "GatewayError", "create_app"]
