"""Dense retrieval over a sentence-transformers model that the tests build (none can be downloaded here):
a WordPiece tokenizer trained on the test corpus and a random-init 2-layer BERT with mean pooling.

Random weights make poor retrieval but real, distinct embeddings, which is all the index's contract is about:
its hits must be the brute-force cosine top-k of the model's own embeddings, prefixes included."""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from agentrl.envs.search.dense import DenseIndex

DEPS_REASON = "needs the dense extra: pip install 'agentrl[dense]'"

DOCS = [{"id": f"d{i:02d}", "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate([
    ("Paris", "Paris is the capital and largest city of France, on the Seine."),
    ("Berlin", "Berlin is the capital of Germany and its largest city."),
    ("Nile", "The Nile is a major north-flowing river in northeastern Africa."),
    ("Amazon River", "The Amazon in South America is the largest river by discharge volume."),
    ("Mount Everest", "Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("Marie Curie", "Marie Curie was a physicist and chemist who researched radioactivity."),
    ("Albert Einstein", "Einstein developed the theory of relativity."),
    ("Python", "Python is a high-level, general-purpose programming language."),
    ("Tokyo", "Tokyo is the capital of Japan and the seat of its government."),
    ("Sahara", "The Sahara is a desert on the African continent, the largest hot desert."),
    ("Jupiter", "Jupiter is the fifth planet from the Sun and the largest in the Solar System."),
    ("Photosynthesis", "Photosynthesis converts light energy into chemical energy in plants."),
    ("Mozart", "Wolfgang Amadeus Mozart was a prolific composer of the Classical period."),
    ("Great Wall", "The Great Wall of China is a series of fortifications in northern China."),
    ("Penicillin", "Penicillin, discovered by Alexander Fleming, was the first antibiotic."),
    ("Moon", "The Moon is Earth's only natural satellite."),
    ("Rome", "Rome is the capital city of Italy, founded according to legend in 753 BC."),
    ("Copper", "Copper is a chemical element with symbol Cu and atomic number 29."),
])] + [  # the same passage under three ids, out of id order: equal scores must come in corpus order
    {"id": doc_id, "contents": '"Lake Baikal"\nBaikal is the deepest lake in the world, in Siberia.'}
    for doc_id in ("dup-c", "dup-a", "dup-b")
]
QUERIES = ["capital of France", "largest river", "who discovered penicillin", "deepest lake in Siberia",
           "planet", "", "zzz unseen words qq"]


def build_sentence_transformer(directory: Path, texts: list[str], hidden: int = 64) -> Path:
    """A tiny sentence-transformers model, from scratch: WordPiece trained on `texts`, random BERT, mean pooling."""
    import tokenizers as tk
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, tk.trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    tok.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tok.decoder = tk.decoders.WordPiece()
    hf_dir = directory / "hf"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=128).save_pretrained(hf_dir)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=128)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertModel(config).save_pretrained(hf_dir)
    transformer = Transformer(str(hf_dir))
    pooling = Pooling(transformer.get_embedding_dimension(), "mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(directory / "st"))
    return directory / "st"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("faiss", reason=DEPS_REASON)
    pytest.importorskip("sentence_transformers", reason=DEPS_REASON)
    texts = [d["contents"] for d in DOCS] + QUERIES + ["query: passage:"]
    return build_sentence_transformer(tmp_path_factory.mktemp("dense_model"), texts)


@pytest.fixture(scope="module")
def encoder(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def index(model_dir: Path) -> DenseIndex:
    return DenseIndex.build(DOCS, model_dir, query_prefix="query: ", doc_prefix="passage: ")


def embed(encoder, texts: list[str]) -> np.ndarray:
    """Embeddings straight from the model, normalized in numpy: float32 [len(texts), dim]."""
    emb = encoder.encode(texts, convert_to_numpy=True, show_progress_bar=False).astype(np.float32)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True)


def assert_brute_force_top_k(hits_per_query, encoder, query_prefix: str, doc_prefix: str, k: int) -> None:
    """Each query's hits are the cosine top-k of the model's embeddings: same ids, scores within 1e-5."""
    docs_ND = embed(encoder, [doc_prefix + d["contents"] for d in DOCS])
    scores_QN = embed(encoder, [query_prefix + q for q in QUERIES]) @ docs_ND.T
    row = {d["id"]: i for i, d in enumerate(DOCS)}
    for q, hits in enumerate(hits_per_query):
        expected = np.lexsort((np.arange(len(DOCS)), -scores_QN[q]))[:k]
        assert [h.score for h in hits] == pytest.approx(scores_QN[q, expected].tolist(), abs=1e-5)
        # ids as brute force orders them, up to scores within 1e-5 of each other (float noise decides those)
        for hit, e in zip(hits, expected):
            assert hit.id == DOCS[e]["id"] or abs(scores_QN[q, row[hit.id]] - scores_QN[q, e]) < 1e-5
        assert len({h.id for h in hits}) == k
        assert all(h.contents == DOCS[row[h.id]]["contents"] for h in hits)


def test_search_is_brute_force_cosine_top_k(index, encoder):
    hits = index.search(QUERIES, k=5)
    assert len(hits) == len(QUERIES) and all(len(h) == 5 for h in hits)
    assert_brute_force_top_k(hits, encoder, "query: ", "passage: ", k=5)
    assert all(h[i].score >= h[i + 1].score for h in hits for i in range(4))


def test_prefixes_change_the_embeddings_and_are_used(model_dir, index, encoder):
    plain, prefixed = embed(encoder, ["capital of France", "query: capital of France"])
    assert np.abs(plain - prefixed).max() > 1e-3  # so the brute-force check above could tell them apart
    no_prefix = DenseIndex.build(DOCS, model_dir)
    assert no_prefix.params["query_prefix"] == no_prefix.params["doc_prefix"] == ""
    hits = no_prefix.search(QUERIES, k=5)
    assert_brute_force_top_k(hits, encoder, "", "", k=5)
    prefixed_scores = np.array([[h.score for h in q] for q in index.search(QUERIES, k=5)])
    assert np.abs(np.array([[h.score for h in q] for q in hits]) - prefixed_scores).max() > 1e-3


def test_equal_scores_come_in_corpus_order(index):
    hits = index.search(["Baikal is the deepest lake in the world, in Siberia."], k=len(DOCS))[0]
    dups = [h for h in hits if h.id.startswith("dup-")]
    assert len({h.score for h in dups}) == 1  # one passage, one embedding, one score
    assert [h.id for h in dups] == ["dup-c", "dup-a", "dup-b"]
    positions = [i for i, h in enumerate(hits) if h.id.startswith("dup-")]
    assert positions == list(range(positions[0], positions[0] + 3))


def test_k_beyond_the_corpus_and_bad_arguments(index):
    hits = index.search(["capital"], k=1000)[0]
    assert len(hits) == len(index) == len(DOCS)
    assert sorted(h.id for h in hits) == sorted(d["id"] for d in DOCS)
    assert index.search([], k=3) == []
    with pytest.raises(TypeError, match="batch of queries"):
        index.search("capital of France")
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(["x"], k=0)


def test_document_by_id(index):
    for doc in DOCS:
        assert index.document(doc["id"]) == doc
    with pytest.raises(KeyError, match="No document with id 'd99'"):
        index.document("d99")


def test_save_load_round_trip(index, model_dir, tmp_path):
    path = tmp_path / "dense"
    index.save(path)
    index.save(path)  # over an old index: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]  # no temporary directories left
    loaded = DenseIndex.load(path)
    assert loaded.params == index.params and loaded.params["model"] == str(model_dir.resolve())
    assert len(loaded) == len(index)
    assert loaded.search(QUERIES, k=4) == index.search(QUERIES, k=4)
    assert all(loaded.document(d["id"]) == d for d in DOCS)


def test_load_with_a_moved_or_different_model(model_dir, tmp_path):
    moved = tmp_path / "model"
    shutil.copytree(model_dir, moved)
    built = DenseIndex.build(DOCS[:5], moved, query_prefix="query: ")
    built.save(tmp_path / "dense")
    expected = built.search(QUERIES, k=3)
    shutil.rmtree(moved)
    with pytest.raises(FileNotFoundError, match=r"No sentence-transformers model at .*model=\.\.\."):
        DenseIndex.load(tmp_path / "dense")
    assert DenseIndex.load(tmp_path / "dense", model=model_dir).search(QUERIES, k=3) == expected
    narrow = build_sentence_transformer(tmp_path / "narrow", [d["contents"] for d in DOCS], hidden=32)
    with pytest.raises(ValueError, match="embeds into 32 dimensions but .* holds 64-dimensional"):
        DenseIndex.load(tmp_path / "dense", model=narrow)


def test_load_errors_say_what_is_wrong(index, tmp_path):
    with pytest.raises(FileNotFoundError, match="No dense index at .*Rebuild it with DenseIndex.build"):
        DenseIndex.load(tmp_path / "missing")
    path = tmp_path / "dense"
    index.save(path)
    params = json.loads((path / "params.json").read_text())
    (path / "params.json").write_text(json.dumps({**params, "format_version": 99}))
    with pytest.raises(ValueError, match="format 99; this code reads format 1"):
        DenseIndex.load(path)
    (path / "params.json").write_text(json.dumps({**params, "index_type": None}))
    with pytest.raises(ValueError, match="not a dense index .*BM25Index.load"):
        DenseIndex.load(path)
    (path / "params.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable dense index"):
        DenseIndex.load(path)
    (path / "params.json").write_text(json.dumps(params))
    blob = (path / "index.faiss").read_bytes()
    (path / "index.faiss").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="damaged dense index"):
        DenseIndex.load(path)
    (path / "index.faiss").write_bytes(blob)
    (path / "ids.sorted.npy").unlink()
    with pytest.raises(ValueError, match="damaged dense index"):
        DenseIndex.load(path)


def test_a_bm25_index_is_not_a_dense_index(tmp_path):
    from agentrl.envs.search.bm25 import BM25Index

    BM25Index.build(DOCS).save(tmp_path / "bm25")
    with pytest.raises(ValueError, match="not a dense index"):
        DenseIndex.load(tmp_path / "bm25")


def test_build_rejects_empty_corpus_and_repeated_ids(model_dir):
    with pytest.raises(ValueError, match="empty corpus"):
        DenseIndex.build([], model_dir)
    with pytest.raises(ValueError, match=r"unique; repeated: \['d00'\]"):
        DenseIndex.build(DOCS + DOCS[:1], model_dir)


def test_missing_packages_say_how_to_install(monkeypatch, tmp_path):
    for module in ("faiss", "sentence_transformers"):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
            with pytest.raises(ImportError, match=r"pip install 'agentrl\[dense\]'"):
                DenseIndex.build(DOCS, tmp_path)


def test_retrieval_server_serves_the_dense_index(index):
    from agentrl.envs.search.server import create_app
    from fastapi.testclient import TestClient

    client = TestClient(create_app(index))
    body = client.post("/retrieve", json={"queries": QUERIES, "topk": 4, "return_scores": True}).json()
    assert body == {"result": [[hit.to_dict() for hit in hits] for hits in index.search(QUERIES, 4)]}
    assert client.get("/documents/d03").json() == DOCS[3]
    assert client.get("/documents/nope").status_code == 404
    assert client.get("/health").json() == {"status": "ok", "documents": len(DOCS)}


def test_concurrent_searches_agree(index):
    expected = index.search(QUERIES, 3)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: index.search(QUERIES, 3), range(16)))
    assert all(r == expected for r in results)


def test_load_index_tells_dense_from_bm25(index, tmp_path):
    from agentrl.envs.search.bm25 import BM25Index
    from agentrl.envs.search.data import load_index

    index.save(tmp_path / "dense")
    BM25Index.build(DOCS).save(tmp_path / "bm25")
    assert isinstance(load_index(tmp_path / "dense"), DenseIndex)
    assert isinstance(load_index(tmp_path / "bm25"), BM25Index)
    assert load_index(tmp_path / "dense").search(QUERIES, 2) == index.search(QUERIES, 2)
