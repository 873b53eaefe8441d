"""The vLLM server's entry point on CPU: vLLM's OpenAI API server, its workers' idle busy-polling cut short.

vLLM's worker waits for the engine's next batch on a shared-memory queue, busy-polling (`sched_yield`) for a second
after each read before it sleeps on a socket (`SpinCondition`'s `busy_loop_s = 1` in vLLM 0.32, not a setting). On a
GPU node that second costs an idle host core; on CPU it costs one of the cores the trainer and the envs use: 0.96
CPU-seconds after every batch, measured. Polling for `BUSY_LOOP_S` keeps it spinning between the decode steps of a
batch (milliseconds apart) and lets it sleep soon after the last one: 0.02-0.03 CPU-seconds after a batch, and
SmolLM2's sampling no slower (docs/vllm.md).

vLLM starts its CPU processes with `spawn`, and a spawned process imports its parent's main module before it runs:
this module (the API server runs in it without replacing it as `__main__`), so the patch is made in the engine core's
and the workers' processes too. Imported under its own name (the API reference), it changes nothing.
"""

import runpy

BUSY_LOOP_S = 0.05


def shorten_busy_loop() -> None:
    """Make vLLM's `SpinCondition` readers busy-poll for `BUSY_LOOP_S` at most (a vLLM without it is left as it is)."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is None:
        return
    init = spin.__init__

    def short(self, is_reader, context, notify_address, busy_loop_s=BUSY_LOOP_S):
        init(self, is_reader, context, notify_address, min(busy_loop_s, BUSY_LOOP_S))

    spin.__init__ = short


if __name__ in ("__main__", "__mp_main__"):  # the server, and each process it spawns (they import it as __mp_main__)
    shorten_busy_loop()
if __name__ == "__main__":
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
