"""Loaders for the corpora and QA files users bring (Search-R1 parquet, FlashRAG JSONL), and the index cache."""

import gzip
import json

import pandas as pd
import pytest

from agentrl.envs.search.data import cached_index, load_qa, read_corpus


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_corpus_accepts_search_r1_and_wiki_rows(tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", [
        {"id": "0", "contents": '"Aaron"\nAaron is a prophet.'},
        {"id": 7, "title": "Abba", "text": "Abba is a band."},
    ])
    assert list(read_corpus(path)) == [{"id": "0", "contents": '"Aaron"\nAaron is a prophet.'},
                                       {"id": "7", "contents": '"Abba"\nAbba is a band.'}]


def test_read_corpus_reads_gzip(tmp_path):
    path = tmp_path / "corpus.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"id": "a", "contents": '"A"\ntext'}) + "\n\n")
    assert list(read_corpus(path)) == [{"id": "a", "contents": '"A"\ntext'}]


def test_read_corpus_names_the_bad_line(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"id": "a", "contents": "x"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: not a corpus row"):
        list(read_corpus(path))


def test_load_qa_reads_search_r1_parquet(tmp_path):
    # The columns of Search-R1's nq_search/train.parquet (prompt and ability left out: we build our own prompt).
    frame = pd.DataFrame([{
        "id": "train_0", "question": "who got the first nobel prize in physics?", "golden_answers": ["Wilhelm Conrad Röntgen"],
        "data_source": "nq", "reward_model": {"ground_truth": {"target": ["Wilhelm Conrad Röntgen"]}, "style": "rule"},
        "extra_info": {"index": 0, "split": "train"},
    }])
    frame.to_parquet(tmp_path / "train.parquet")
    [task] = load_qa(tmp_path / "train.parquet")
    assert task.id == "train-train_0" and task.split == "train"
    assert task.data == {"question": "who got the first nobel prize in physics?",
                         "answers": ["Wilhelm Conrad Röntgen"], "supporting_docs": [], "suite": "train"}


def test_load_qa_reads_flashrag_jsonl_and_target_only_rows(tmp_path):
    path = write_jsonl(tmp_path / "hotpotqa_dev.jsonl", [
        {"id": "h1", "question": " Which band? ", "golden_answers": ["Abba", "ABBA"], "metadata": {}},
        {"question": "Who?", "reward_model": {"ground_truth": {"target": "Aaron"}}},
    ])
    first, second = load_qa(path, split="dev")
    assert (first.id, first.data["question"], first.data["answers"]) == ("dev-h1", "Which band?", ["Abba", "ABBA"])
    assert (second.id, second.data["answers"], second.split) == ("dev-1", ["Aaron"], "dev")


def test_load_qa_rejects_rows_without_answers(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Who?"}])
    with pytest.raises(ValueError, match="gold answers"):
        load_qa(path)
    with pytest.raises(ValueError, match="parquet"):
        load_qa(tmp_path / "qa.csv")


def test_cached_index_builds_once_and_reloads(tmp_path):
    docs = [{"id": "a", "contents": '"Alpha"\nalpha beta'}, {"id": "b", "contents": '"Beta"\nbeta gamma'}]
    first = cached_index(docs, tmp_path)
    [built] = list(tmp_path.iterdir())
    again = cached_index(docs, tmp_path)
    assert list(tmp_path.iterdir()) == [built]
    assert [h.id for h in again.search(["gamma"], 1)[0]] == [h.id for h in first.search(["gamma"], 1)[0]] == ["b"]
    cached_index(docs[:1], tmp_path)  # another corpus, another directory
    assert len(list(tmp_path.iterdir())) == 2
