"""TextArena's single-player games as agentrl envs: `textarena/GuessTheNumber-v0`, or any id with `game=...`.

Each task is a seed; the game's own prompt is the first user message, and each turn's new game messages (the
transcript's growth, without the echo of the player's move) are the observation. The reward is the game's,
from `close()` at the end. TextArena seeds Python's global `random` in `reset`, so episodes of games that draw
random numbers after reset are reproducible only one at a time. Games that download data (Wordle needs
nltk's word list) or call an LLM (TwentyQuestions) do not work offline; multi-player games are not adapted.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from agentrl.env.adapters.seeded import SeededEnv
from agentrl.types import Message, Task


class TextArenaEnv(SeededEnv):
    """A single-player TextArena game; tasks are seeds, the solver defaults to ours for the game (if any)."""

    solver_signature = "(transcript) -> move"

    def __init__(self, game: str = "GuessTheNumber-v0", split: str = "train", n_tasks: int = 1000,
                 max_turns: int = 30, solver: Callable[[str], str] | None = None):
        try:
            import textarena
        except ImportError as e:
            raise ImportError("the TextArena adapter needs `pip install textarena`") from e
        super().__init__(split, max_turns, n_tasks, solver or SOLVERS.get(game.removesuffix("-raw")))
        self.game, self._ta = game, textarena
        self.task_prefix = f"textarena/{game}"
        self.inner, self._transcript = None, ""

    def on_reset(self, task: Task) -> None:
        self.close()
        self.inner = self._ta.make(self.game)
        self.inner.reset(num_players=1, seed=task.data["seed"])
        self._transcript = self.inner.get_observation()[1]

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The game's transcript at reset (its prompt) as one user message."""
        return (Message("user", self._transcript.strip()),)

    def act(self, action: str):
        done, info = self.inner.step(action)
        if done:
            rewards, game_info = self.inner.close()
            self.inner = None
            reward = float(rewards[0]) if rewards else 0.0
            detail = (game_info or {}).get(0, {}).get("reason", "")
            return [], reward, True, {"reward_components": {"game": reward}, "detail": detail}
        transcript = self.inner.get_observation()[1]
        new, self._transcript = transcript[len(self._transcript):], transcript
        lines = [line for line in new.strip().splitlines() if not line.startswith("[Player]")]
        return [Message("user", "\n".join(lines).strip())], 0.0, False, {}

    def solver_inputs(self) -> tuple:
        return (self._transcript,)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None


def guess_the_number(transcript: str) -> str:
    """Binary search over GuessTheNumber's range, from the hints in the transcript."""
    low, high = map(int, re.search(r"between (\d+) and (\d+)", transcript).groups())
    for guess, hint in re.findall(r"\[Player\] \[(\d+)\]\n\[GAME\] The target number is (higher|lower)", transcript):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return f"[{(low + high) // 2}]"


SOLVERS: dict[str, Callable[[str], str]] = {"GuessTheNumber-v0": guess_the_number}
