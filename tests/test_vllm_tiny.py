"""The real vLLM OpenAI server on CPU serves the tiny model, and its logprobs equal transformers' forward pass."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.tiny_model import load_tokenizer

pytestmark = pytest.mark.vllm

STARTUP_DEADLINE_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Start `vllm.entrypoints.openai.api_server` on the tiny model; yield its base URL; kill it afterwards."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vllm is not installed ({e}); install it with `make setup-vllm`")
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--dtype", "float32"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with code {proc.returncode}; log tail:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up after {STARTUP_DEADLINE_S} s; log tail:\n{_tail(log_path)}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield url
    finally:
        _kill_group(proc, signal.SIGTERM)  # the server's own session: its engine-core child goes too
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            proc.wait(timeout=30)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def test_vllm_logprobs_match_transformers(vllm_server: str, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    questions = ["What is 3 * (4 + 5)?", "Find the capital of Velkamor."]
    for seed, question in enumerate(questions):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False)
        body = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 32, "temperature": 1.0,
                "seed": seed, "logprobs": 0, "return_tokens_as_token_ids": True}
        response = httpx.post(f"{vllm_server}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        sampled = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        assert 1 <= len(sampled) <= 32

        ids_T = torch.tensor(prompt + sampled)
        with torch.no_grad():
            logp_TV = model(ids_T[None]).logits[0].log_softmax(-1)
        expected = logp_TV[len(prompt) - 1 : -1].gather(1, torch.tensor(sampled)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"]), expected, atol=1e-3, rtol=0)
