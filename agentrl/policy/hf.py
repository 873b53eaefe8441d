"""In-process transformers backend of the `Policy` protocol, batched across concurrent requests.

Every sample (one of a request's `n`) is a row. Rows wait in a queue; one worker task takes everything pending
(up to `max_batch_size` rows) and decodes it as one left-padded batch with a KV cache, in a thread so that
the event loop stays free for environments. Rows that arrive during a round wait for the next one; an idle worker
first waits while requests keep arriving (`_gather`), so that calls spread over a few milliseconds share a batch.

Each row samples with its own `torch.Generator` seeded from `sampling.seed + sample index`, on the model's
device (a decode step draws no noise on the CPU to copy over), so a seeded request gives the same tokens whatever
else shares its batch (on one device type: CUDA's generator draws other numbers than the CPU's). Logprobs are the raw (temperature 1, unfiltered)
log-softmax at the sampled token: what the trainer's forward pass computes (under the trainer's autocast when
the model is marked for mixed precision, `agentrl.policy.precision`).
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from agentrl.policy.parity import Probe
from agentrl.policy.protocol import PolicyError, Sample, SamplingParams
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.precision import autocast
from agentrl.policy.weights import export_state_dict
from agentrl.types import FinishReason


GATHER_QUIET_S = 0.005  # an idle worker starts a batch once no request arrived for this long,
GATHER_MAX_S = 0.1  # or after this long in all


@dataclass
class _Row:
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    future: asyncio.Future  # resolves to a Sample


class HFPolicy:
    """A `Policy` on a local transformers causal LM.

    The context is the model's `max_position_embeddings`: a prompt that fills it is an error, and a sample
    that reaches it ends with finish_reason "length".
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 64):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_len: int = model.config.max_position_embeddings
        self.vocab_size: int = model.get_input_embeddings().num_embeddings
        self.eos_ids = _eos_ids(model, tokenizer)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self._pending: list[_Row] = []
        self._running: list[_Row] = []  # the batch being decoded now
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._unseeded = random.Random()  # seeds for requests that bring none
        self._closed = False
        self.weight_version = 0

    @classmethod
    def load(cls, model_dir_or_name: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
             max_batch_size: int = 64) -> HFPolicy:
        """An `HFPolicy` on the model and tokenizer at `model_dir_or_name` (a directory or a hub name), on `device`."""
        from transformers import AutoModelForCausalLM

        model_dir_or_name = os.path.expanduser(str(model_dir_or_name))
        tokenizer = load_tokenizer(model_dir_or_name)  # raises with a hint if the model is missing
        model = AutoModelForCausalLM.from_pretrained(model_dir_or_name, dtype=dtype).to(device)
        return cls(model, tokenizer, max_batch_size)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """Return `sampling.n` samples continuing `prompt_ids`, decoded in the next batch.

        Raises `PolicyError` when the policy is closed, or the prompt is empty, fills the context or has ids outside
        the vocabulary."""
        if self._closed:
            raise PolicyError("HFPolicy is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise PolicyError("empty prompt: the policy needs at least one token to continue")
        if len(prompt) >= self.max_len:
            raise PolicyError(f"prompt has {len(prompt)} tokens but the model's context is {self.max_len} "
                              "(max_position_embeddings): no room left to generate")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise PolicyError(f"prompt has token ids outside the model's vocabulary [0, {self.vocab_size})")
        loop = asyncio.get_running_loop()
        base_seed = sampling.seed if sampling.seed is not None else self._unseeded.getrandbits(62)
        rows = [_Row(prompt, sampling, base_seed + i, loop.create_future()) for i in range(sampling.n)]
        self._pending.extend(rows)
        self._ensure_worker(loop)
        return list(await asyncio.gather(*(row.future for row in rows)))

    async def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams, top_k: int) -> Probe:
        """A parity check's view of this engine (`agentrl.policy.parity`): one sample, its logprobs as sampled; the
        prompt's tokens and the `top_k` most likely tokens at every position from a forward pass over the whole."""
        sample = (await self.generate(prompt_ids, replace(sampling, n=1)))[0]
        ids, P = [int(t) for t in prompt_ids] + list(sample.token_ids), len(prompt_ids)
        logprobs, top = await asyncio.to_thread(self._score, ids, top_k)
        return Probe(tuple(ids), P, (*logprobs[:P - 1], *sample.logprobs), top)

    @torch.no_grad()
    def _score(self, ids: list[int], top_k: int) -> tuple[list[float], tuple[dict[int, float], ...]]:
        """Each next token's logprob along `ids`, and the `top_k` most likely tokens at each position."""
        device = next(self.model.parameters()).device
        with autocast(self.model):
            logits_TV = self.model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1]
        logp_TV = logits_TV.float().log_softmax(-1)
        logprobs = logp_TV.gather(1, torch.tensor(ids[1:], device=device)[:, None]).squeeze(1).tolist()
        values, indices = logp_TV.topk(top_k, -1)
        return logprobs, tuple(dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist()))

    async def sync_weights(self, model, version: int) -> None:
        """In-process: the trainer's model is usually this very object; otherwise copy its weights."""
        if model is not self.model:
            await asyncio.to_thread(self.model.load_state_dict, export_state_dict(model))
        self.weight_version = version

    async def close(self) -> None:
        """Stop the worker; requests still waiting fail with `PolicyError`, and later ones too."""
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
        for row in self._pending + self._running:
            if not row.future.done():
                row.future.set_exception(PolicyError("HFPolicy closed before this request finished"))
        self._pending.clear()

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        # A new event loop (e.g. one per test) gets a new worker; the old one died with its loop.
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._serve())
        self._wakeup.set()

    async def _serve(self) -> None:
        try:
            await self._serve_batches()
        finally:  # a cancelled worker (its loop is closing) must not leave requests waiting forever
            for row in self._pending + self._running:
                if not row.future.done():
                    row.future.set_exception(PolicyError("the HFPolicy worker stopped before this request finished"))
            self._pending.clear()

    async def _serve_batches(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self._gather()
            while self._pending:
                batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]  # done: cancelled
                del self._pending[: self.max_batch_size]
                if not batch:
                    continue
                self._running = batch
                try:
                    samples = await asyncio.to_thread(self._decode, batch)
                except Exception as e:  # noqa: BLE001 -- the backend boundary: its failure fails this batch only
                    for row in batch:
                        if not row.future.done():
                            row.future.set_exception(PolicyError(f"transformers decode failed: {e!r}"))
                    continue
                for row, sample in zip(batch, samples):
                    if not row.future.done():
                        row.future.set_result(sample)

    async def _gather(self) -> None:
        """Wait while requests keep arriving (each within `GATHER_QUIET_S` of the last, `GATHER_MAX_S` in all), so that
        calls that arrive spread out (agents behind the gateway, env steps of different lengths) share one batch
        instead of the first few starting one that the rest then wait out."""
        loop = asyncio.get_running_loop()
        deadline, seen = loop.time() + GATHER_MAX_S, -1
        while len(self._pending) != seen and len(self._pending) < self.max_batch_size and loop.time() < deadline:
            seen = len(self._pending)
            await asyncio.sleep(GATHER_QUIET_S)

    @torch.inference_mode()
    def _decode(self, rows: list[_Row]) -> list[Sample]:
        """One batched decode of all `rows` until each has stopped. Runs in a worker thread. A model marked for
        mixed precision (the trainer's, shared) decodes under the same autocast as the trainer's forward, so
        the sampler's logprobs come from the trainer's numerics."""
        with autocast(self.model):  # autocast's state is per thread: entered here, in the worker thread
            return self._decode_rows(rows)

    def _decode_rows(self, rows: list[_Row]) -> list[Sample]:
        from transformers import DynamicCache

        device, B = self.model.device, len(rows)
        # Rows of a batch usually share a long prefix (system prompt, tools, a group's task): its KV is
        # computed once and copied to every row. Each row keeps at least one token of its own.
        L = _shared_prefix_len([r.prompt_ids for r in rows]) if B > 1 else 0
        cache = DynamicCache(config=self.model.config)
        if L:
            self.model(input_ids=torch.tensor([rows[0].prompt_ids[:L]], device=device), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)
            cache.batch_repeat_interleave(B)
        P = max(len(r.prompt_ids) for r in rows) - L
        input_ids_BP = torch.full((B, P), self._pad_id, dtype=torch.long)
        mask_BP = torch.zeros((B, P), dtype=torch.long)
        for b, row in enumerate(rows):  # left padding: every row's next token goes in the last column
            suffix = row.prompt_ids[L:]
            input_ids_BP[b, P - len(suffix):] = torch.tensor(suffix)
            mask_BP[b, P - len(suffix):] = 1
        pos_BP = L + (mask_BP.cumsum(-1) - 1).clamp(min=0)
        temp_B = torch.tensor([r.sampling.temperature for r in rows], device=device)
        top_p_B = torch.tensor([r.sampling.top_p for r in rows], device=device)
        top_k_B = torch.tensor([r.sampling.top_k for r in rows], device=device)
        budgets = [min(r.sampling.max_tokens, self.max_len - len(r.prompt_ids)) for r in rows]
        gens = [torch.Generator(device=device).manual_seed(r.seed) for r in rows]  # noise drawn where the logits are
        out_ids: list[list[int]] = [[] for _ in rows]
        out_logps: list[list[float]] = [[] for _ in rows]
        finish: list[FinishReason] = ["length"] * B

        mask_BT = torch.cat([torch.ones((B, L), dtype=torch.long), mask_BP], dim=1).to(device)  # [B, L + P]
        logits_BV = self.model(input_ids=input_ids_BP.to(device), attention_mask=mask_BT,
                               position_ids=pos_BP.to(device), past_key_values=cache, use_cache=True,
                               logits_to_keep=1).logits[:, -1].float()
        next_pos_B = pos_BP[:, -1].to(device) + 1
        alive = list(range(B))  # batch position -> index into rows
        while True:
            idx = torch.tensor(alive, device=device)
            tokens_B, logps_B = _sample(logits_BV, temp_B[idx], top_p_B[idx], top_k_B[idx], [gens[i] for i in alive])
            keep: list[int] = []  # batch positions that go on
            for b, (i, tok, logp) in enumerate(zip(alive, tokens_B.tolist(), logps_B.tolist())):
                out_ids[i].append(tok)
                out_logps[i].append(logp)
                if self._stops(rows[i].sampling, out_ids[i]):
                    finish[i] = "stop"
                elif len(out_ids[i]) < budgets[i]:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(alive):  # compact: finished rows leave the batch and its cache
                keep_t = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_t)
                mask_BT, next_pos_B, tokens_B = mask_BT[keep_t], next_pos_B[keep_t], tokens_B[keep_t]
                alive = [alive[b] for b in keep]
            mask_BT = torch.cat([mask_BT, mask_BT.new_ones((len(alive), 1))], dim=1)
            logits_BV = self.model(input_ids=tokens_B[:, None], attention_mask=mask_BT,
                                   position_ids=next_pos_B[:, None], past_key_values=cache,
                                   use_cache=True).logits[:, -1].float()
            next_pos_B = next_pos_B + 1
        return [Sample(tuple(out_ids[i]), tuple(out_logps[i]), finish[i]) for i in range(B)]

    def _stops(self, sampling: SamplingParams, ids: list[int]) -> bool:
        """Whether the last sampled token ends the sample (it is kept either way)."""
        if ids[-1] in self.eos_ids or ids[-1] in sampling.stop_token_ids:
            return True
        if not sampling.stop:
            return False
        # A stop string of L chars spans at most 4L bytes, so at most 4L tokens (each token is >= 1 byte).
        # Earlier tokens were checked at their own step, so a match in this tail was completed by the last token.
        window = 4 * max(len(s) for s in sampling.stop) + 1
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        return any(s in tail for s in sampling.stop)


def _sample(logits_BV: torch.Tensor, temp_B: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor,
            gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (temperature 0: greedy) and its raw logprob. Returns tokens_B, logps_B."""
    V = logits_BV.shape[-1]
    logp_BV = logits_BV.log_softmax(-1)  # temperature 1, before top-p/top-k: what the trainer computes
    probs_BV = (logits_BV / temp_B.clamp(min=1e-6)[:, None]).softmax(-1)
    if bool((top_p_B < 1).any() or (top_k_B > 0).any()):
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True, stable=True)
        k_B = torch.where(top_k_B > 0, top_k_B, V)  # -1 or 0: no top-k
        rank_V = torch.arange(V, device=logits_BV.device)
        # top-p keeps the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
        drop_sorted_BV = (rank_V[None] >= k_B[:, None]) | (sorted_BV.cumsum(-1) - sorted_BV >= top_p_B[:, None])
        probs_BV = probs_BV.masked_fill(torch.zeros_like(drop_sorted_BV).scatter(1, order_BV, drop_sorted_BV), 0.0)
    # Exponential race (= Gumbel-max, as vLLM samples): argmax p_i / E_i is distributed as p. Each row draws
    # its noise from its own generator, and the winner's margin dwarfs float noise from batching, so a seeded
    # row picks the same token whatever its batch (inverse-CDF sampling flips on ~1e-6 logit differences).
    # E = -log U, U uniform on [0, 1): E > 0, and U = 0 gives E = inf, a token that cannot win. Uniforms per row,
    # then one batched log: 3x faster than a row-by-row `exponential_` (75 against 22 ms a step for 64 rows of
    # SmolLM2's 49,152 tokens on 2 cores).
    noise_BV = torch.empty_like(probs_BV)
    for row_V, g in zip(noise_BV, gens):
        torch.rand(V, generator=g, device=logits_BV.device, out=row_V)
    tokens_B = (probs_BV / noise_BV.log_().neg_()).argmax(-1)
    tokens_B = torch.where(temp_B == 0, logits_BV.argmax(-1), tokens_B)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None]).squeeze(1)


def _shared_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the common prefix of all prompts, leaving every prompt at least one token after it."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(limit):
        if any(p[i] != first[i] for p in prompts):
            return i
    return max(limit, 0)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config (an int or a list) and the tokenizer."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    ids.add(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)
