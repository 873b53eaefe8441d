"""The policy: one async protocol, its backends, and keeping the engine's weights equal to the trainer's.

- `protocol`: `Policy.generate(prompt_ids, sampling)`, `SamplingParams`, `Sample`
- `backends`: `EngineConfig` and `open_policy` (in-process transformers, or vLLM)
- `hf`, `vllm_client`, `vllm_server`: the two backends, and the vLLM server they start or attach to
- `router`: several engines behind one policy, an episode sticking to one
- `scripted`: a policy that plays fixed texts (env validation, tests)
- `weights`, `weight_transfer`: the trainer's weights as the engine loads them, by checkpoint or broadcast
- `logprobs`, `parity`: the trainer's logprobs of sampled ids, compared with the engine's after a sync
"""
