"""Search environments: answer questions by searching a corpus through a real BM25 index (or a server).

Action formats (the `parser` argument):
- `search_r1`: Search-R1's tags. `<search> q </search>` returns `<information>Doc 1(Title: ..) ..</information>`
  as the observation; `<answer> a </answer>` ends the episode. The prompt is Search-R1's.
- `hermes` / `react`: tool calls through the chat template: `search(query)`, `open(doc_id)` (the whole
  document) and `answer(text)` (a final answer; the parser's own answer syntax works too).

Reward components (the weights are arguments; the default is plain EM, as Search-R1):
    R = answer + citation_weight * citation - search_cost_weight * search_cost
        - unsupported_weight * unsupported_answer
- `answer`: exact match after SQuAD normalization (`answer_metric="f1"`: token F1 instead);
- `f1`, `format` (1 if every action of the episode was well-formed): reported, weight 0;
- `citation`: 1 if a supporting document was shown to the model (retrieval hit);
- `search_cost`: searches beyond the question's hop count (every search when the hop count is unknown);
- `unsupported_answer`: 1 if the answer occurs in no document the model was shown.
Only the text inside the final answer action is scored.

Baselines (`mode`, Search-R1's table): `direct` asks for the answer without retrieval, `rag` shows the top `topk`
documents for the question itself and asks for the answer; both in one turn by default, with no search tool.

Data: a generated knowledge world by default (`world.py`: train and held-out suites); or the user's own
corpus JSONL and QA files (`corpus=`, `questions={split: path}`).
"""

from __future__ import annotations

import functools
import random
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from agentrl.env.api import Score, ToolEnv
from agentrl.envs.search.bm25 import BM25Index, SearchHit
from agentrl.envs.search.data import cached_index, load_index, load_qa, read_corpus
from agentrl.envs.search.retriever import RemoteRetriever, Retriever, format_passages
from agentrl.envs.search.rewards import exact_match, is_supported, token_f1
from agentrl.envs.search.questions import make_questions
from agentrl.envs.search.world import build_world
from agentrl.tools import PARSERS, ParsedAction, ToolSet, tool
from agentrl.types import Message, Task, ToolCall

T = TypeVar("T")

# Search-R1's prompt (Jin et al., 2025), verbatim but for the question's placement.
SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
TOOLS_PROMPT = ("Answer the question by searching. Search for the names in the question, read the documents, "
                "search again for names you find there if needed, and answer with a short phrase copied from "
                "the documents.")
# The baselines' prompts, in Search-R1's words where they apply: no search, the answer in the same tags.
_ANSWER_FORMAT = ("Provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
                  "<answer> Beijing </answer>.")
DIRECT_PROMPT = "Answer the given question directly. " + _ANSWER_FORMAT + " Question: {question}\n"
RAG_PROMPT = ("Answer the given question with the help of the documents below. " + _ANSWER_FORMAT +
              "\n{documents}\nQuestion: {question}\n")
MODES = ("search", "rag", "direct")
_WORD = re.compile(r"\S+")


class SearchEnv(ToolEnv):
    """Answer questions by searching a corpus (`search/r1-v0`, `search/tools-v0`, `search/react-v0`).

    The data is the generated world unless `corpus` and `questions` are given (both or neither); searches go to
    the server at `retriever_url`, else the index saved at `index`, else an in-process BM25 index.

    `train_worlds` > 1 draws the train split from that many generated worlds (seeds `world_seed`, `world_seed + 1`,
    ...; each task searches its own world's corpus): more distinct invented names and facts to train on, like
    Procgen's number of training levels. Held-out suites stay in world `world_seed`; an entity's split follows a
    hash of its name, so no held-out name is a train entity in any world.

    `mode` = `direct` or `rag` (Search-R1's tags only) plays the baselines: no search tool, the answer asked for at
    once, with the question's top `topk` documents shown (`rag`) or none (`direct`); `max_turns` 1 unless given.
    """

    def __init__(self, split: str = "train", n_tasks: int | None = None, seed: int = 0, world_seed: int = 0,
                 train_worlds: int = 1, parser: str = "search_r1", mode: str = "search", topk: int = 3,
                 max_obs_words: int = 300, max_turns: int | None = None, max_invalid: int = 3,
                 answer_metric: str = "em", answer_weight: float = 1.0,
                 citation_weight: float = 0.0, search_cost_weight: float = 0.0, unsupported_weight: float = 0.0,
                 corpus: str | None = None, questions: dict[str, str] | None = None,
                 index: str | None = None, retriever_url: str | None = None, tool_timeout: float = 10.0):
        if parser not in ("search_r1", "hermes", "react"):
            raise ValueError(f"parser must be 'search_r1', 'hermes' or 'react', got {parser!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "search" and parser != "search_r1":
            raise ValueError(f"mode={mode!r} (a baseline without the search tool) is written for Search-R1's tags: "
                             f"use search/r1-v0 (parser='search_r1'), or mode='search' with parser={parser!r}")
        if answer_metric not in ("em", "f1"):
            raise ValueError(f"answer_metric must be 'em' or 'f1', got {answer_metric!r}")
        if (corpus is None) != (questions is None):
            raise ValueError("Give both `corpus` (a JSONL corpus) and `questions` ({split: QA file}), or neither "
                             "(the generated world).")
        if train_worlds < 1:
            raise ValueError(f"train_worlds must be >= 1, got {train_worlds}")
        if train_worlds > 1 and (corpus or index or retriever_url):
            raise ValueError("train_worlds > 1 draws questions from several generated worlds, each searched through "
                             "its own in-process index: remove corpus/questions, index and retriever_url, or set "
                             "train_worlds = 1")
        self.n_tasks, self.task_seed, self.world_seed, self.train_worlds = n_tasks, seed, world_seed, train_worlds
        self.topk, self.max_obs_words, self.answer_metric = topk, max_obs_words, answer_metric
        self.corpus, self.questions, self.index_path, self.retriever_url = corpus, questions, index, retriever_url
        self.parser_name, self.mode = parser, mode
        tools = [self._search_tool(tool_timeout)] if mode == "search" else []
        if parser == "search_r1":
            parser_obj = PARSERS[parser]()
        else:
            tools += [self._open_tool(tool_timeout), _answer]
            parser_obj = PARSERS[parser]() if parser == "hermes" else \
                PARSERS[parser](default_args={"search": "query", "open": "doc_id", "answer": "text"})
        if max_turns is None:
            max_turns = 6 if mode == "search" else 1
        super().__init__(ToolSet(tools), parser_obj, split=split, max_turns=max_turns, max_invalid=max_invalid,
                         answer_tool=None if parser == "search_r1" else "answer",
                         reward_weights={"answer": answer_weight, "citation": citation_weight,
                                         "search_cost": -search_cost_weight,
                                         "unsupported_answer": -unsupported_weight})
        self._shown: dict[str, str] = {}  # doc id -> contents of every document the model was shown
        self._searches = 0
        self._task_world = world_seed  # the world whose corpus this episode searches

    # ---- data ----
    @property
    def retriever(self) -> Retriever:
        """Where searches go, opened on first use (so `make` stays cheap for `envs list/show`) and shared by the env
        instances of this process: the server at `retriever_url`, the index at `index`, or a BM25 index of the
        corpus (of this episode's world, for the generated one)."""
        if self.retriever_url:
            return _remote(self.retriever_url)
        if self.index_path:
            return _load_index(self.index_path)
        return _corpus_index(self.corpus, self._task_world)

    def load_tasks(self, split: str) -> Sequence[Task]:
        """The questions of `split`: the first `n_tasks` of the user's QA file for it, or `n_tasks` questions of the
        world's suite `split` (default 2000 for train, 200 otherwise; from each world with `train_worlds`)."""
        if self.questions is not None:
            if split not in self.questions:
                raise ValueError(f"no questions file for split {split!r}; `questions` has {sorted(self.questions)}")
            tasks = load_qa(self.questions[split], split)
            return tasks[: self.n_tasks] if self.n_tasks else tasks
        n = self.n_tasks or (2000 if split == "train" else 200)
        if split != "train" or self.train_worlds == 1:
            return make_questions(_world(self.world_seed), split, n, self.task_seed)
        worlds = range(self.world_seed, self.world_seed + self.train_worlds)
        per_world = [[t if w == self.world_seed else Task(f"{t.id}-w{w}", {**t.data, "world_seed": w}, t.split)
                      for t in make_questions(_world(w), split, n, self.task_seed)] for w in worlds]
        return [t for round_ in zip(*per_world) for t in round_]  # interleaved: any prefix spans every world

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """Search-R1's tags are explained by its prompt; its template renders no tool schemas."""
        return [] if self.parser_name == "search_r1" else super().tool_schemas

    # ---- tools ----
    def _search_tool(self, timeout: float):
        @tool(timeout=timeout)
        def search(query: str) -> str:
            """Search the corpus with BM25 and return the top documents.

            Args:
                query: Keywords, e.g. a name from the question.
            """
            # A document that shares no word with the query (score 0) is not a result: say so instead.
            hits = [h for h in self.retriever.search([query], self.topk)[0] if h.score > 0]
            self._searches += 1
            if not hits:
                return self._observation(f"No results for {query!r}.", [])
            return self._observation(format_passages(hits, with_ids=self.parser_name != "search_r1"), hits)

        return search

    def _open_tool(self, timeout: float):
        @tool(name="open", timeout=timeout)
        def open_document(doc_id: str) -> str:
            """Read a whole document by its id.

            Args:
                doc_id: The id of a document that a search returned.
            """
            try:
                doc = self.retriever.document(doc_id)
            except KeyError:
                return f"No document with id {doc_id!r}."
            return self._observation(doc["contents"], [SearchHit(doc["id"], doc["contents"], 0.0)])

        return open_document

    def _observation(self, text: str, hits: Sequence[SearchHit]) -> str:
        for hit in hits:
            self._shown[hit.id] = hit.contents
        text = _truncate_words(text, self.max_obs_words)
        return f"<information>{text}</information>" if self.parser_name == "search_r1" else text

    # ---- episode ----
    def on_reset(self, task: Task) -> None:
        super().on_reset(task)
        self._shown, self._searches = {}, 0
        self._task_world = task.data.get("world_seed", self.world_seed)
        self.retriever  # opened here, under the env call's timeout, so that the first search has its own 10 s

    def first_messages(self, task: Task) -> Sequence[Message]:
        """Search-R1's prompt holding the question (`search_r1`), else a system prompt and the question."""
        question = task.data["question"]
        if self.mode == "direct":
            return (Message("user", DIRECT_PROMPT.format(question=question)),)
        if self.mode == "rag":
            hits = [h for h in self.retriever.search([question], self.topk)[0] if h.score > 0]
            documents = self._observation(format_passages(hits), hits)
            return (Message("user", RAG_PROMPT.format(documents=documents, question=question)),)
        if self.parser_name == "search_r1":
            return (Message("user", SEARCH_R1_PROMPT.format(question=question)),)
        prompt = TOOLS_PROMPT + (f" {self.parser.instructions}" if self.parser_name == "react" else "")
        return (Message("system", prompt), Message("user", question))

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        golds = task.data["answers"]
        em, f1 = exact_match(answer, golds), token_f1(answer, golds)
        hops = task.data.get("hops")
        components = {
            "answer": f1 if self.answer_metric == "f1" else em,
            "f1": f1,
            "format": float(all(p.error is None for p in transcript)),
            "citation": float(any(d in self._shown for d in task.data.get("supporting_docs", ()))),
            "search_cost": float(max(0, self._searches - hops) if hops else self._searches),
            "unsupported_answer": float(not is_supported(answer, list(self._shown.values()))),
        }
        return Score(components, detail=f"gold={golds[0]!r} searches={self._searches}")

    def difficulty(self, task: Task) -> dict[str, Any]:
        return {"hops": task.data["hops"]} if task.data.get("hops") else {}

    def gold_actions(self, task: Task) -> list[str]:
        chain = task.data.get("chain")
        if self.mode != "search":  # the baselines answer at once
            return [self._format_answer(task.data["answers"][0])]
        if not chain:
            raise ValueError(f"task {task.id} has no search chain (user QA data): it has no gold solution")
        searches = [self._format_search(hop["query"]) for hop in chain]
        return [*searches, self._format_answer(task.data["answers"][0])]

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        """The gold chain; with probability `error_rate`, a plausible mistake: stop one hop early and answer
        the intermediate entity, or (1-hop questions) answer without searching."""
        if rng.random() >= error_rate:
            return self.gold_actions(task)
        chain = task.data["chain"]
        if len(chain) == 1:
            return [self._format_answer(chain[0]["query"])]
        early = rng.randrange(1, len(chain))
        return [*(self._format_search(hop["query"]) for hop in chain[:early]),
                self._format_answer(chain[early - 1]["answer"])]

    def _format_search(self, query: str) -> str:
        return self.parser.format_call(ToolCall("search", {"query": query}))

    def _format_answer(self, answer: str) -> str:
        if self.parser_name == "hermes":
            return self.parser.format_call(ToolCall("answer", {"text": answer}))
        return self.parser.format_answer(answer)


@tool(name="answer")
def _answer(text: str) -> str:
    """Give the final answer and end the episode.

    Args:
        text: The answer, a short phrase.
    """
    raise AssertionError("the env ends the episode on an answer call; it never runs")  # see ToolEnv.answer_tool



def _truncate_words(text: str, max_words: int) -> str:
    """The text up to its `max_words`-th word, whitespace kept (a model-independent token budget)."""
    words = list(_WORD.finditer(text))
    if len(words) <= max_words:
        return text
    return text[: words[max_words - 1].end()] + " ..."


def _once_per_process(fn: Callable[..., T]) -> Callable[..., T]:
    """`functools.lru_cache`, except that threads asking for a value at once wait for one computation instead of
    each computing it: a Ray env worker's episodes start at once, and with each of their threads building the world
    and its index, the first searches outlasted the tool's 10 s timeout on a loaded machine (32 of 64 episodes)."""
    cached, lock = functools.lru_cache(maxsize=64)(fn), threading.Lock()

    @functools.wraps(fn)
    def call(*args: Any) -> T:
        with lock:
            return cached(*args)

    return call


@_once_per_process  # several worlds when `train_worlds` > 1
def _world(seed: int):
    return build_world(seed)


def tokenizer_documents(world_seed: int = 0) -> list[str]:
    """What the tiny model's tokenizer learns for the search envs (`agentrl model init --corpus search`): the
    documents training shows, so that invented names get tokens of their own. Not the documents that name
    held-out entities: fit to those, the tokenizer gave held-out names tokens that training barely uses (the
    model copied held-out name tokens trained on < 10 times right 22% of the time, those trained on 100+ 85%)."""
    return [d["contents"] for d in _world(world_seed).train_documents()]


@_once_per_process
def _corpus_index(corpus: str | None, world_seed: int) -> BM25Index:
    """One index per corpus per process, shared by every env instance of a rollout."""
    docs = list(read_corpus(corpus)) if corpus else _world(world_seed).documents()
    return cached_index(docs)


@functools.lru_cache(maxsize=4)
def _remote(url: str) -> RemoteRetriever:
    """One client (one connection pool) per server, shared by every env instance."""
    return RemoteRetriever(url)


@functools.lru_cache(maxsize=4)
def _load_index(path: str) -> Retriever:
    return load_index(path)
