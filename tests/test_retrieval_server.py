"""The retrieval server speaks Search-R1's /retrieve API over the real index, and our client talks to it.

A real uvicorn server on a loopback port; the client is `RemoteRetriever` (httpx)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from agentrl.envs.search.bm25 import BM25Index
from agentrl.envs.search.retriever import MAX_RESULTS, RemoteRetriever, RetrieverError, format_passages
from agentrl.envs.search.server import MAX_BODY_BYTES, create_app
from agentrl.envs.search.world import build_world


@pytest.fixture(scope="module")
def index():
    return BM25Index.build(build_world(0).documents())


@pytest.fixture(scope="module")
def server_url(index):
    server = uvicorn.Server(uvicorn.Config(create_app(index), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the retrieval server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def queries(index):
    docs = build_world(0).documents()
    titles = [d["contents"].partition("\n")[0].strip('"') for d in docs[:: max(1, len(docs) // 40)]]
    return titles + ["capital of the country", "zzzz unknown words", ""]


def test_server_and_in_process_index_return_identical_results(index, server_url, queries):
    remote = RemoteRetriever(server_url)
    assert remote.search(queries, 5) == index.search(queries, 5)
    assert len(remote) == len(index)
    some_id = index.search(queries[:1], 1)[0][0].id
    assert remote.document(some_id) == index.document(some_id)
    with pytest.raises(KeyError, match="no document"):
        remote.document("no-such-id")


def test_wire_format_is_search_r1s(index, server_url, queries):
    with_scores = httpx.post(f"{server_url}/retrieve",
                             json={"queries": queries[:2], "topk": 3, "return_scores": True}).json()
    assert list(with_scores) == ["result"] and len(with_scores["result"]) == 2
    item = with_scores["result"][0][0]
    assert set(item) == {"document", "score"} and set(item["document"]) == {"id", "contents"}
    bare = httpx.post(f"{server_url}/retrieve", json={"queries": queries[:1]}).json()
    assert bare["result"][0] == [i["document"] for i in with_scores["result"][0]]  # default topk 3
    # Search-R1's client formats passages from ['document']['contents']: the same text as ours
    expected = format_passages(index.search(queries[:1], 3)[0])
    lines = []
    for i, doc in enumerate(bare["result"][0]):
        title, text = doc["contents"].split("\n")[0], "\n".join(doc["contents"].split("\n")[1:])
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    assert "\n".join(lines) == expected


def test_concurrent_batched_requests(index, server_url, queries):
    expected = index.search(queries, 3)
    remote = RemoteRetriever(server_url, batch_size=7)  # several requests per call

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: remote.search(queries, 3), range(32)))
    assert all(r == expected for r in results)


@pytest.mark.parametrize("body, headers", [
    (b'{"queries": ["a"', {"content-type": "application/json"}),  # truncated JSON
    (b'{"queries": "not a list"}', {"content-type": "application/json"}),
    (b'{"queries": ["a"], "topk": 0}', {"content-type": "application/json"}),
    (b'{"queries": ["a"], "topk": "three"}', {"content-type": "application/json"}),
    (b'{"queries": ["a"], "top_k": 3}', {"content-type": "application/json"}),  # a misspelled field is not ignored
    (b'{"queries": [1, null]}', {"content-type": "application/json"}),
    (b"\xff\xfe", {"content-type": "application/json"}),
])
def test_bad_requests_get_422_and_the_server_keeps_serving(server_url, body, headers):
    response = httpx.post(f"{server_url}/retrieve", content=body, headers=headers)
    assert response.status_code == 422, response.text
    assert "detail" in response.json()
    assert httpx.get(f"{server_url}/health").json()["status"] == "ok"


def test_a_request_for_too_many_results_gets_422_saying_how_to_split_it(index, server_url):
    """queries × topk is bounded (4096 × 1000 would be gigabytes): each alone is allowed, the product is not."""
    response = httpx.post(f"{server_url}/retrieve", json={"queries": ["capital"] * 4096, "topk": 1000})
    assert response.status_code == 422
    assert response.json()["detail"] == (f"4096 queries × topk 1000 = 4,096,000 results; at most {MAX_RESULTS:,} "
                                         f"per request: send at most {MAX_RESULTS // 1000} queries per request at "
                                         "topk 1000")
    split = httpx.post(f"{server_url}/retrieve", json={"queries": ["capital"] * (MAX_RESULTS // 1000), "topk": 1000})
    assert split.status_code == 200 and len(split.json()["result"]) == MAX_RESULTS // 1000
    # the server's default topk counts too
    response = TestClient(create_app(index, default_topk=100)).post("/retrieve", json={"queries": ["a"] * 1000})
    assert response.status_code == 422 and "1000 queries × topk 100" in response.json()["detail"]
    with pytest.raises(ValueError, match="default_topk must be between 1 and 1000"):
        create_app(None, default_topk=5000)


def test_the_client_splits_its_batches_to_stay_within_the_limit(index, server_url):
    queries = [f"capital {i}" for i in range(70)]
    remote = RemoteRetriever(server_url, retries=0)  # 64 per batch × topk 1000 would pass the limit
    assert remote.search(queries, 1000) == index.search(queries, 1000)


def test_huge_bodies_are_refused_before_they_are_read(server_url):
    """A request's body is bounded too (huge query strings, or many of them): 413 by its declared length, 411
    when it declares none; one long query under the limit is still searched."""
    huge = json.dumps({"queries": ["capital " * (MAX_BODY_BYTES // 8 + 1)]}).encode()
    response = httpx.post(f"{server_url}/retrieve", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and f"at most {MAX_BODY_BYTES:,}" in response.json()["detail"]

    def chunked():
        yield b'{"queries": ["capital"]}'

    response = httpx.post(f"{server_url}/retrieve", content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 411 and "Content-Length" in response.json()["detail"]
    long_query = httpx.post(f"{server_url}/retrieve", json={"queries": ["capital of the river " * 100_000]})
    assert long_query.status_code == 200 and len(long_query.json()["result"][0]) == 3
    assert httpx.get(f"{server_url}/health").json()["status"] == "ok"


def test_client_retries_then_says_how_to_fix():
    remote = RemoteRetriever("http://127.0.0.1:9", timeout=0.5, retries=2, backoff=0.01)  # nothing listens
    start = time.monotonic()
    with pytest.raises(RetrieverError, match=r"failed 3 times.*agentrl serve retriever"):
        remote.search(["a"])
    assert time.monotonic() - start < 5


def test_serve_retriever_command(tmp_path, index):
    """`agentrl serve retriever` on a user's corpus file: starts, answers, and stops on SIGTERM."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in [
        {"id": "1", "contents": '"Aaron"\nAaron is a prophet.'}, {"id": "2", "contents": '"Abba"\nAbba is a band.'}]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "agentrl.cli.main", "serve", "retriever", "--corpus", str(corpus),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "HOME": str(tmp_path)})  # the index cache goes here
    try:
        remote, deadline = RemoteRetriever(f"http://127.0.0.1:{port}", retries=0), time.monotonic() + 60
        while True:
            try:
                assert len(remote) == 2
                break
            except RetrieverError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read().decode()
                time.sleep(0.2)
        [[hit]] = remote.search(["band"], 1)
        assert (hit.id, hit.contents) == ("2", '"Abba"\nAbba is a band.')
    finally:
        server.terminate()
        server.wait(10)


def test_env_over_the_server_sees_what_the_in_process_env_sees(server_url):
    from agentrl.env.registry import make

    local, remote = make("search/tools-v0"), make("search/tools-v0", retriever_url=server_url)
    for env in (local, remote):
        env.reset(seed=0)
    hop = local.task.data["chain"][0]
    for action in [f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{hop["query"]}"}}}}\n</tool_call>',
                   f'<tool_call>\n{{"name": "open", "arguments": {{"doc_id": "{hop["doc_id"]}"}}}}\n</tool_call>']:
        assert remote.step(action)[0] == local.step(action)[0]
