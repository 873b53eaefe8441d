"""The start-up check of the envs whose episodes run in Docker (code, SWE, Harbor)."""

from agentrl.env.api import EnvNotReady
from agentrl.tools.sandbox import SandboxError, docker_runtime


def require_docker(what: str) -> None:
    """`EnvNotReady` naming `what` needs Docker, with the fix, unless a Docker daemon answers."""
    try:
        docker_runtime.client()
    except SandboxError as e:
        raise EnvNotReady(f"{what}: {e}") from e
