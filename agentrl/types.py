"""Core data types: one episode as data (DESIGN.md, "One episode, as data").

Everything here is a frozen dataclass. A `Trajectory` is one token sequence with its loss mask; batches,
advantages and metrics are derived from trajectories by pure functions, never stored back into them.

Token-level fields are tuples of length T (the trajectory length): `token_ids`, `loss_mask`, `logprobs`.

Shapes in names, everywhere in the project (the one statement of the legend): a tensor's name ends with its
dimensions, `logp_BT` is [B, T]. B: rows of a batch (trajectories); T: token positions; P: prompt positions; G:
the trajectories of one group; S: the samples of a batch (a trajectory, or an agent session's segments); K: turns
of a trajectory, or samples per task in an evaluation; R: rows of a minibatch; N: selected rows or tokens (a
gather); W: a window of positions; C: a chunk; V: the vocabulary; H: the hidden size; X: any trailing dimensions.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]  # why the policy stopped a turn: its stop token, or max_tokens


class Status(str, enum.Enum):
    """How an episode ended. Errors are excluded from group baselines and counted, never scored 0."""

    OK = "ok"
    TRUNCATED = "truncated"  # hit max turns / max tokens / context length; reason says which
    ERROR = "error"  # an exception in a tool, the env or the policy; reason holds it


class StopReason(str, enum.Enum):
    """Why an episode stopped, kept on the `Trajectory` beside its status and its free-text reason."""

    TERMINATED = "terminated"
    """The env ended the episode: the task is over, solved or not. Status ok."""
    ENV_TRUNCATED = "env_truncated"
    """The env cut the episode short (its own turn, step or invalid-action limit). Status truncated."""
    MAX_TURNS = "max_turns"
    """The rollout's `max_turns` ran out before the env ended the episode. Status truncated."""
    MAX_TOKENS = "max_tokens"
    """A turn's sample reached `sampling.max_tokens` before the turn ended. Status truncated."""
    MAX_TOTAL_TOKENS = "max_total_tokens"
    """The episode's `max_total_tokens` (prompt included) ran out, between turns or mid-turn. Status truncated."""
    ENV_ERROR = "env_error"
    """The env or one of its tools raised, or an env call (make_env, reset, step) took longer than `step_timeout`.
    Status error."""
    POLICY_ERROR = "policy_error"
    """The policy's `generate` raised (a crashed or unreachable server, a prompt it refuses) or took longer than
    `generate_timeout`. Status error."""
    RENDER_ERROR = "render_error"
    """The chat template cannot express the conversation (`RendererError`). Status error."""

    @property
    def status(self) -> Status:
        """The trajectory status this stop gives: ok, truncated or error."""
        if self is StopReason.TERMINATED:
            return Status.OK
        return Status.ERROR if self.value.endswith("_error") else Status.TRUNCATED


@dataclass(frozen=True)
class Task:
    """One problem instance. `data` is env-specific (question, gold answer, supporting facts...)."""

    id: str
    data: dict[str, Any] = field(default_factory=dict)
    split: str = "train"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI / HF chat-template shape."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None  # tool name, for tool messages

    def to_dict(self) -> dict[str, Any]:
        """The dict that chat templates expect; optional keys are left out when unset."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        """The inverse of `to_dict`."""
        calls = tuple(
            ToolCall(c["function"]["name"], c["function"]["arguments"], c.get("id", "")) for c in d.get("tool_calls", ())
        )
        return cls(d["role"], d["content"], calls, d.get("tool_call_id"), d.get("name"))


# the numbers an episode reports (`Trajectory.metrics`): counted by the rollout engine, the gateway (`calls`,
# `failed_calls`, `parse_errors`), the eval runner (`success`) and the confidence rewards (`entropy`, ...)
EPISODE_METRICS = frozenset({
    "tool_calls", "invalid_actions", "seconds", "attempts", "untrained_tokens", "segments", "episode_turns",
    "episode_sampled_tokens", "summaries", "summary_tokens", "calls", "failed_calls", "parse_errors", "success",
    "entropy", "self_certainty"})

# the usual stop reason of each status: what a trajectory read from a file without stop reasons gets
TYPICAL_STOP = {"ok": StopReason.TERMINATED, "truncated": StopReason.MAX_TURNS, "error": StopReason.ENV_ERROR}


@dataclass(frozen=True)
class Turn:
    """One assistant turn inside a trajectory's token sequence.

    Tokens [start, end) were sampled by the policy (loss_mask 1, except the tokens a frozen partner wrote in
    a tandem rollout); tokens [end, obs_end) were written by the environment and the chat template
    (loss_mask 0). `obs_end == end` for the last turn of an episode.
    """

    start: int
    end: int
    obs_end: int
    reward: float = 0.0
    finish_reason: FinishReason = "stop"
    # the policy weights that sampled [start, end): in asynchronous training an episode's turns can differ
    weight_version: int = 0


@dataclass(frozen=True)
class Trajectory:
    """One episode: prompt ids + (sampled ids + observation ids) per turn, as one sequence."""

    task_id: str
    token_ids: tuple[int, ...]  # [T]
    loss_mask: tuple[int, ...]  # [T] 1 exactly on the tokens the trained policy sampled
    logprobs: tuple[float, ...]  # [T] sampler logprob on sampled tokens, 0.0 elsewhere
    prompt_len: int
    turns: tuple[Turn, ...]
    reward: float  # total: sum of per-turn rewards
    reward_components: dict[str, float] = field(default_factory=dict)  # e.g. outcome, process
    stop: StopReason = StopReason.TERMINATED  # why it stopped, which says its `status`
    reason: str = ""  # why truncated / the error, empty when ok
    messages: tuple[Message, ...] = ()  # the conversation as parsed messages, for viewers and SFT
    group: int = 0  # index of the group (task sample) this trajectory belongs to
    seed: int | None = None
    weight_version: int = 0  # the oldest policy weights that sampled it (each turn's: `Turn.weight_version`)
    answer: str | None = None  # the final answer the episode gave, if it gave one
    session: str | None = None  # the agent session (gateway) it is a segment of
    # numbers that are summed or averaged over trajectories: tool_calls, invalid_actions, seconds, attempts, ...
    # (`EPISODE_METRICS`); an episode of several segments has its totals on each of them
    metrics: dict[str, float] = field(default_factory=dict)
    # what is only shown or looked up: per-turn values, the segment's index, an evaluation's entry and sample
    logs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        T = len(self.token_ids)
        if len(self.loss_mask) != T or len(self.logprobs) != T:
            raise ValueError(f"token_ids, loss_mask, logprobs must have one length; got {T}, "
                             f"{len(self.loss_mask)}, {len(self.logprobs)}")

    @property
    def status(self) -> Status:
        """ok, truncated or error: what `stop` gives."""
        return self.stop.status

    @property
    def num_sampled(self) -> int:
        """How many tokens the trained policy sampled (the loss mask's ones)."""
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (one line of a rollout JSONL): the fields, status as its value, messages as `to_dict`s."""
        d = asdict(self)
        d["status"] = self.status.value
        d["stop"] = self.stop.value
        d["messages"] = [m.to_dict() for m in self.messages]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """The inverse of `to_dict`."""
        d = dict(d)
        for key in ("token_ids", "loss_mask", "logprobs"):
            d[key] = tuple(d[key])
        d["turns"] = tuple(Turn(**t) for t in d["turns"])
        status = d.pop("status")  # written for readers of the file; the stop reason says it
        if "info" in d:  # written before metrics and logs were apart
            info = d.pop("info")
            numbers = {k for k, v in info.items() if k in EPISODE_METRICS and isinstance(v, (int, float))}
            d["metrics"] = {k: info[k] for k in numbers}
            d["logs"] = {k: v for k, v in info.items() if k not in numbers}
        d["stop"] = StopReason(d["stop"]) if d.get("stop") else TYPICAL_STOP[status]
        d["messages"] = tuple(Message.from_dict(m) for m in d["messages"])
        return cls(**d)


@dataclass(frozen=True)
class Group:
    """G trajectories of one task, sampled with the same env seed. Advantages are computed per group."""

    task: Task
    trajectories: tuple[Trajectory, ...]

    @property
    def valid(self) -> tuple[Trajectory, ...]:
        """Trajectories that count towards baselines: everything but errors."""
        return tuple(t for t in self.trajectories if t.status is not Status.ERROR)
