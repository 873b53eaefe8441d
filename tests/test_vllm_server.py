"""VLLMServer's start, with a small HTTP server in vLLM's place (a process that binds its port and answers
`/v1/models`): a port chosen for the server and taken by another process before the server binds it is chosen
again (CI lost a run to this); a port the user set is not."""

import socket
import sys

import httpx
import pytest

from agentrl.policy import vllm_server
from agentrl.policy.vllm_server import ServerConfig, ServerError, VLLMServer

# Binds its port as vLLM does (an OSError "Address already in use" and exit code 1 when it is taken).
STAND_IN = """
import http.server, sys
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(vllm_server, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_server, "server_command", lambda config, port: [sys.executable, "-c", STAND_IN, str(port)])


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # bound, not listening: a connection to it is refused at once, not left waiting
        yield holder.getsockname()[1]


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(stand_in, taken_port, tmp_path):
    server = VLLMServer(ServerConfig(model="m", log_file=str(tmp_path / "log")))
    server.port = taken_port  # the race: free when chosen, taken by another process before the server bound it
    with server:
        assert server.port != taken_port and server.starts == 2
        assert httpx.get(f"{server.url}/v1/models").status_code == 200
        assert "Address already in use" in server.log_path.read_text()


def test_a_port_the_user_set_is_not_moved(stand_in, taken_port, tmp_path):
    server = VLLMServer(ServerConfig(model="m", port=taken_port, log_file=str(tmp_path / "log")))
    with pytest.raises(ServerError, match="Address already in use"):
        server.start()
    assert server.port == taken_port and server.starts == 1 and not server.alive()
