"""reverse-text, verifiers 0.4's own example environment (PrimeIntellect-ai/verifiers, environments/reverse_text,
Apache-2.0): its task and its LCS reward as the repository has them, its texts inline instead of a dataset download.

Reverse the text character by character, the answer in `<reversed_text>` tags; the reward is the LCS ratio between
the parsed answer and the reversal. Single-turn: a stop hook refuses a second turn.
"""

import re
from difflib import SequenceMatcher

import verifiers.v1 as vf

SYSTEM = (
    "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
)
_TAG = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)
TEXTS = {
    "train": ["hello world", "verifiers", "abc def", "reinforcement", "tool use", "gateway", "token ids", "agent"],
    "heldout": ["reverse me", "policy", "sandbox", "rollout"],
}


class ReverseTextData(vf.TaskData):
    answer: str
    """The ground-truth reversal of the prompt text."""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        # Reverse-text is single-turn: refuse a second turn so the model answers once.
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        completion = trace.last_reply
        match = _TAG.search(completion or "")
        response = match.group(1).strip() if match else ""
        return SequenceMatcher(None, response, self.data.answer).ratio()


class ReverseTextInlineConfig(vf.TasksetConfig):
    split: str = "train"


class ReverseTextInlineTaskset(vf.Taskset[ReverseTextTask, ReverseTextInlineConfig]):
    def load(self) -> list[ReverseTextTask]:
        return [ReverseTextTask(ReverseTextData(idx=i, prompt=text, system_prompt=SYSTEM, answer=text[::-1]),
                                self.config.task)
                for i, text in enumerate(TEXTS[self.config.split])]


__all__ = ["ReverseTextInlineTaskset"]
