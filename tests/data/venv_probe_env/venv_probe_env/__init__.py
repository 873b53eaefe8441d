"""An env that says where it runs: its first message names its Python and numpy; answering the task's word wins.
The action `crash` kills its own process (a server dying mid-episode); `delay` makes the constructor sleep (a server
that hangs at start)."""

from __future__ import annotations

import os
import sys
import time

import numpy

from agentrl.env.api import TextEnv
from agentrl.types import Message, Task

WORDS = ("apple", "birch", "cedar", "delta")


class ProbeEnv(TextEnv):
    def __init__(self, split: str = "train", max_turns: int = 2, words: tuple[str, ...] = WORDS, delay: float = 0):
        super().__init__(split=split, max_turns=max_turns)
        self.words = words
        time.sleep(delay)

    @property
    def tool_schemas(self):
        return [{"type": "function", "function": {"name": "say", "description": "Say a word.",
                                                  "parameters": {"type": "object", "properties": {}}}}]

    def load_tasks(self, split):
        return [Task(f"probe/{split}/{word}", {"word": word}, split) for word in self.words]

    def first_messages(self, task):
        where = f"python {sys.version_info.major}.{sys.version_info.minor}, numpy {numpy.__version__}, pid {os.getpid()}"
        return [Message("user", f"[{where}] Say {task.data['word']!r}.")]

    def act(self, action):
        if action == "crash":
            os._exit(3)
        solved = action.strip() == self.task.data["word"]
        feedback = [] if solved else [Message("user", "No.")]
        return feedback, float(solved), solved, {"answer": action.strip()}

    def gold_actions(self, task):
        return [task.data["word"]]

    def difficulty(self, task):
        return {"letters": len(task.data["word"])}
