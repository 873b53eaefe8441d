"""The search envs over the real BM25 index: formats, rewards by hand, held-out suites, user data."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.envs.search.env import SearchEnv
from agentrl.envs.search.questions import SUITES
from agentrl.env.registry import check, make
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.job.recipe import TrainJob
from agentrl.types import Task

SEARCH_ENVS = ["search/r1-v0", "search/tools-v0", "search/react-v0"]
RECIPES = Path(__file__).parents[1] / "recipes"


@pytest.mark.parametrize("env_id", SEARCH_ENVS)
def test_envs_check_passes_and_gold_gets_the_maximum_reward(env_id):
    assert check(env_id, n_tasks=16) == []


@pytest.mark.parametrize("suite", SUITES)
def test_gold_solutions_of_held_out_suites_get_the_maximum_reward(suite):
    env = make("search/r1-v0", split=suite, n_tasks=40)
    assert env.validate(n_tasks=40) == []


def test_search_r1_format_returns_information_blocks():
    env = make("search/r1-v0")
    obs, _ = env.reset(seed=0)
    assert len(obs) == 1 and obs[0].role == "user" and obs[0].content.endswith(
        f"Question: {env.task.data['question']}\n")
    query = env.task.data["chain"][0]["query"]
    obs, reward, terminated, _, info = env.step(f"<think>I need {query}.</think>\n<search> {query} </search>")
    assert (reward, terminated, info["tool_calls"]) == (0.0, False, 1)
    [message] = obs
    assert message.role == "tool"
    assert message.content.startswith(f'<information>Doc 1(Title: "{query}") {query}')
    assert message.content.endswith("</information>") and "Doc 3(" in message.content


def test_tool_format_shows_ids_and_open_reads_a_document():
    env = make("search/tools-v0")
    env.reset(seed=0)
    hop = env.task.data["chain"][0]
    obs, *_ = env.step(f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{hop["query"]}"}}}}\n</tool_call>')
    assert obs[0].content.startswith(f'Doc 1(id: {hop["doc_id"]}, Title: "{hop["query"]}")')
    obs, *_ = env.step(f'<tool_call>\n{{"name": "open", "arguments": {{"doc_id": "{hop["doc_id"]}"}}}}\n</tool_call>')
    assert obs[0].content.startswith(f'"{hop["query"]}"\n')
    obs, reward, terminated, _, info = env.step('<tool_call>\n{"name": "open", "arguments": {"doc_id": "x"}}\n</tool_call>')
    assert obs[0].content == "No document with id 'x'." and not terminated


def test_malformed_actions_get_corrective_messages():
    env = make("search/r1-v0")
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("<search>unclosed")
    assert (reward, terminated) == (0.0, False)
    assert obs[0].role == "user" and "Unclosed <search>" in obs[0].content
    env = make("search/tools-v0")
    env.reset(seed=0)
    obs, *_ = env.step('<tool_call>\n{"name": "answer", "arguments": {"text": "a"}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>')
    assert "Only 1 tool call is allowed" in obs[0].content


def one_hop_task(env):
    return next(t for t in env.tasks if t.data["hops"] == 1)


def test_reward_components_combine_with_their_weights():
    env = make("search/r1-v0", citation_weight=0.5, search_cost_weight=0.1, unsupported_weight=0.2)
    task = one_hop_task(env)
    env.reset(options={"task": task})
    for query in ["unrelated words", "more unrelated words", task.data["chain"][0]["query"]]:
        env.step(f"<search>{query}</search>")
    *_, info = env.step("<answer>Atlantis</answer>")
    c = info["reward_components"]
    assert c == {"answer": 0.0, "f1": 0.0, "format": 1.0, "citation": 1.0, "search_cost": 2.0,
                 "unsupported_answer": 1.0}
    # R = answer + 0.5 citation - 0.1 search_cost - 0.2 unsupported = 0 + 0.5 - 0.2 - 0.2
    env.reset(options={"task": task})
    for query in ["unrelated words", "more unrelated words", task.data["chain"][0]["query"]]:
        env.step(f"<search>{query}</search>")
    assert env.step("<answer>Atlantis</answer>")[1] == pytest.approx(0.1)
    assert env.max_reward == 1.5


def test_only_the_final_answer_counts_and_f1_metric():
    env = make("search/r1-v0", answer_metric="f1")
    task = one_hop_task(env)
    gold = task.data["answers"][0]
    env.reset(options={"task": task})
    env.step(f"<think>It is {gold}.</think>")  # no action: corrective message, not an answer
    _, reward, terminated, _, info = env.step(f"<answer>{gold} indeed</answer>")
    c = info["reward_components"]
    n = len(gold.split())
    assert c["answer"] == c["f1"] == pytest.approx(2 * n / (2 * n + 1))  # precision n/(n+1), recall 1
    assert c["format"] == 0.0 and c["citation"] == 0.0 and terminated


def test_observations_are_truncated_to_the_word_budget():
    env = make("search/r1-v0", max_obs_words=12)
    env.reset(seed=0)
    obs, *_ = env.step(f"<search>{env.task.data['chain'][0]['query']}</search>")
    body = obs[0].content.removeprefix("<information>").removesuffix("</information>")
    assert body.endswith(" ...") and len(body.removesuffix(" ...").split()) == 12


def test_search_r1_queries_are_the_tokens_the_question_and_documents_name_them_with(tiny_model_dir):
    """A name written after a space, as Search-R1 spaces its tags, is the same tokens in the question, in the
    expert's search, in the document that search returns and in the next hop's search: a model copies token
    for token (without the space, the first token differs: "ĠVog" in the question, "V" "og" in the query)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    contains = lambda ids, part: any(ids[i:i + len(part)] == part for i in range(len(ids)))  # noqa: E731
    env = make("search/r1-v0", topk=1)
    for task in [t for t in env.tasks if t.data["hops"] == 2][:20]:
        env.reset(options={"task": task})
        head, hop2 = (" " + hop["query"] for hop in task.data["chain"])
        first, second, _ = env.gold_actions(task)
        obs, *_ = env.step(first)
        assert contains(encode(task.data["question"]), encode(head)) and contains(encode(first), encode(head))
        assert contains(encode(obs[0].content), encode(hop2)) and contains(encode(second), encode(hop2))
        assert encode(second)[-len(encode(" </search>")):] == encode(" </search>")


def test_demonstrations_make_plausible_mistakes():
    env = make("search/r1-v0")
    rng = random.Random(0)
    two_hop = next(t for t in env.tasks if t.data["hops"] == 2)
    assert env.demonstration(two_hop, rng) == env.gold_actions(two_hop)
    wrong = env.demonstration(two_hop, rng, error_rate=1.0)
    assert wrong == [f"<search> {two_hop.data['chain'][0]['query']} </search>",
                     f"<answer> {two_hop.data['chain'][0]['answer']} </answer>"]


def play(env, task, actions_for):
    """Total reward of a scripted policy: `actions_for(task, last_observation_text)` gives the next action."""
    env.reset(options={"task": task})
    total, seen = 0.0, ""
    for _ in range(env.max_turns):
        obs, reward, terminated, truncated, _ = env.step(actions_for(task, seen))
        total += reward
        seen += "".join(m.content for m in obs)
        if terminated or truncated:
            break
    return total


def searcher(task, seen):
    """Searches each hop's name, then answers only with what the documents showed it."""
    searches = seen.count("<information>")
    if searches < task.data["hops"]:
        return f"<search>{task.data['chain'][searches]['query']}</search>"
    gold = task.data["answers"][0]
    return f"<answer>{gold if gold in seen else 'unknown'}</answer>"


def test_searching_beats_answering_from_memory_on_every_held_out_suite():
    """A policy that answers from what it memorized of the train split (the most frequent train answer for the
    question's last relation) against one that searches each hop's name and answers only with what the
    documents showed it. Held-out answers must not be guessable: the searcher must win clearly."""
    train = make("search/r1-v0", split="train")
    prior = {}
    for relation, answers in _answers_by_relation(train.tasks).items():
        prior[relation] = answers.most_common(1)[0][0]

    def from_memory(task, seen):
        return f"<answer>{prior.get(task.data['relations'][-1], 'unknown')}</answer>"

    for suite in SUITES:
        env = make("search/r1-v0", split=suite, n_tasks=100)
        memory = sum(play(env, t, from_memory) for t in env.tasks) / len(env.tasks)
        search = sum(play(env, t, searcher) for t in env.tasks) / len(env.tasks)
        assert search >= 0.95 and search - memory >= 0.5, (suite, memory, search)


def _answers_by_relation(tasks):
    by_relation = {}
    for t in tasks:
        by_relation.setdefault(t.data["relations"][-1], Counter())[t.data["answers"][0]] += 1
    return by_relation


def test_user_corpus_and_qa_files(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in [
        {"id": "1", "contents": '"Aaron"\nAaron is a prophet, the brother of Moses.'},
        {"id": "2", "contents": '"Abba"\nAbba is a Swedish pop band formed in Stockholm.'},
    ]))
    qa = tmp_path / "test.jsonl"
    qa.write_text(json.dumps({"id": "q1", "question": "Where was Abba formed?", "golden_answers": ["Stockholm"]}))
    env = SearchEnv(split="test", corpus=str(corpus), questions={"test": str(qa)})
    [task] = env.tasks
    assert isinstance(task, Task) and task.data["question"] == "Where was Abba formed?"
    env.reset(options={"task": task})
    obs, *_ = env.step("<search>Abba band</search>")
    assert obs[0].content.startswith('<information>Doc 1(Title: "Abba") Abba is a Swedish')
    assert env.step("<answer>stockholm</answer>")[1] == 1.0
    with pytest.raises(ValueError, match="no gold solution"):
        env.gold_actions(task)
    with pytest.raises(ValueError, match="Give both"):
        SearchEnv(corpus=str(corpus))


def test_a_query_that_matches_nothing_says_so():
    env = make("search/r1-v0")
    env.reset(seed=0)
    obs, *_ = env.step("<search>zzzqx vvvqx</search>")
    assert obs[0].content == "<information>No results for 'zzzqx vvvqx'.</information>"


def test_train_worlds_draw_train_questions_from_several_worlds_each_searched_in_its_own():
    one = make("search/r1-v0", n_tasks=20)
    env = make("search/r1-v0", n_tasks=20, train_worlds=3)
    tasks = list(env.tasks)
    assert len(tasks) == 60 and len({t.id for t in tasks}) == 60
    assert [t.data.get("world_seed", 0) for t in tasks[:6]] == [0, 1, 2, 0, 1, 2]  # interleaved
    assert [t.id for t in tasks[::3]] == [t.id for t in one.tasks]  # world 0's questions are the plain env's

    other_worlds = [t for t in tasks if t.data.get("world_seed", 0) > 0]  # right only if searched in their world
    assert sum(play(env, t, searcher) for t in other_worlds) / len(other_worlds) >= 0.95

    train_names = {hop["query"] for t in make("search/r1-v0", train_worlds=4).tasks for hop in t.data["chain"]}
    heldout_names = {t.data["chain"][0]["query"] for t in make("search/r1-v0", split="unseen_entities").tasks}
    assert not train_names & heldout_names  # held-out names stay unseen in every world
    assert make("search/r1-v0", split="unseen_entities", train_worlds=3).tasks == \
        make("search/r1-v0", split="unseen_entities").tasks

    with pytest.raises(ValueError, match="train_worlds must be >= 1"):
        make("search/r1-v0", train_worlds=0)
    with pytest.raises(ValueError, match="remove corpus/questions, index and retriever_url"):
        make("search/r1-v0", train_worlds=2, retriever_url="http://localhost:1")


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*search*train*.toml")))
def test_search_recipes_leave_turns_for_every_gold_chain_they_are_evaluated_on(recipe):
    """A question of h hops takes h searches and the answer: with fewer turns, it cannot be solved at all."""
    job = load_config(TrainJob, RECIPES / recipe)
    for split in [job.eval.split] if isinstance(job.eval.split, str) else job.eval.split:
        env = make(job.env, split=split, **job.env_kwargs)
        hops = max(t.data["hops"] for t in list(env.tasks)[:job.eval.n])
        assert env.max_turns >= hops + 1, f"{recipe}: {split} asks {hops} hops in {env.max_turns} turns"


@pytest.mark.parametrize("mode", ["direct", "rag"])
def test_baseline_modes_ask_for_the_answer_at_once_without_the_search_tool(mode):
    env = make("search/r1-v0", split="unseen_entities", mode=mode, topk=2)
    assert env.validate(n_tasks=8) == []  # gold, the answer alone, gets the maximum reward
    obs, info = env.reset(seed=0)
    question, first_hop = env.task.data["question"], env.task.data["chain"][0]
    prompt = obs[0].content
    assert info["tools"] == [] and env.max_turns == 1 and "<search>" not in prompt
    assert prompt.endswith(f"Question: {question}\n")
    if mode == "rag":  # the question's own top 2 documents, counted as shown
        assert prompt.count("Doc ") == 2 and f'(Title: "{first_hop["query"]}")' in prompt
        assert set(env.task.data["supporting_docs"]) & set(env._shown)
    else:
        assert "<information>" not in prompt
    _, reward, terminated, truncated, info = env.step(f"<search> {first_hop['query']} </search>")
    assert (reward, terminated, truncated) == (0.0, False, True) and "search" in info["invalid"]


def test_baseline_modes_are_written_for_search_r1_tags():
    with pytest.raises(ValueError, match="Search-R1's tags"):
        make("search/tools-v0", mode="rag")
    with pytest.raises(ValueError, match="mode must be one of"):
        make("search/r1-v0", mode="closed_book")
