"""Retrieval: batching, caching, the on-disk BM25 index, and Search-R1's HTTP API end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from agentrl_envs.search_r1 import bm25
from agentrl_envs.search_r1.bm25 import BM25Index, BM25Retriever
from agentrl_envs.search_r1.env import SearchR1Env
from agentrl_envs.search_r1.http_client import (
    HTTPRetriever,
    RetrieverUnavailableError,
    parse_response,
)
from agentrl_envs.search_r1.retrieval import Document, LRUCache, QueryBatcher, Retriever

from agentrl.types import Task


async def test_batcher_sends_concurrent_queries_as_one_call() -> None:
    calls: list[list[str]] = []

    async def backend(queries: list[str], topk: int) -> list[list[Document]]:
        calls.append(queries)
        return [[Document(id=q, contents=f'"{q}"\ntext')] * topk for q in queries]

    batcher = QueryBatcher(backend, window_s=0.01)
    results = await asyncio.gather(*(batcher.search_one(f"q{i % 5}", 2) for i in range(20)))
    assert len(calls) == 1 and sorted(calls[0]) == [f"q{i}" for i in range(5)]  # deduplicated
    assert [r[0].id for r in results] == [f"q{i % 5}" for i in range(20)]
    await batcher.search_one("q1", 2)
    assert len(calls) == 1  # answered from the cache


async def test_batcher_error_reaches_every_waiter() -> None:
    async def backend(queries: list[str], topk: int) -> list[list[Document]]:
        raise RetrieverUnavailableError("down")

    batcher = QueryBatcher(backend, window_s=0.001)
    outcomes = await asyncio.gather(
        *(batcher.search_one(f"q{i}", 3) for i in range(4)), return_exceptions=True
    )
    assert all(isinstance(o, RetrieverUnavailableError) for o in outcomes)


def test_lru_cache_forgets_least_recent() -> None:
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)
    assert list(cache) == ["a", "c"]


def test_bm25_index_is_built_once_and_cached_on_disk(
    corpus_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = BM25Index.load_or_build(corpus_path, show_progress=False)
    assert first.search(["capital of France"], 1)[0][0].title == "Paris"
    cached = list((bm25.cache_root() / "bm25").iterdir())
    assert len(cached) == 1 and (cached[0] / "params.index.json").exists()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("index rebuilt although it was cached")

    monkeypatch.setattr(bm25, "_build", no_rebuild)
    second = BM25Index.load_or_build(corpus_path)
    assert second.search(["Dravidian language"], 1)[0][0].title == "Kannada"
    corpus_path.write_text(
        corpus_path.read_text().replace("Paris", "Lutetia")
    )  # new hash: new index
    with pytest.raises(AssertionError, match="rebuilt"):
        BM25Index.load_or_build(corpus_path)


def test_bad_corpus_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"id": "0", "contents": "\\"A\\"\\ntext"}\n{"id": "1", "text": "no contents"}\n'
    )
    with pytest.raises(ValueError, match="line 2: expected a JSON object with 'id' and 'contents'"):
        bm25.read_corpus(path)


async def test_bm25_retriever_is_a_retriever(corpus_path: Path) -> None:
    retriever = BM25Retriever(corpus_path)
    assert isinstance(retriever, Retriever)
    results = await retriever.search(["young star molecular cloud", "Mali Niger"], 2)
    assert [docs[0].title for docs in results] == ["Protostar", "Timbuktu"]
    assert all(len(docs) == 2 and docs[0].score is not None for docs in results)


def test_parse_response_reads_both_result_shapes() -> None:
    scored = {"result": [[{"document": {"id": "1", "contents": '"A"\nx'}, "score": 2.5}]]}
    bare = {"result": [[{"id": "1", "contents": '"A"\nx'}]]}
    pyserini = {"result": [[{"title": "A", "text": "x"}]]}
    assert parse_response(scored, num_queries=1)[0][0] == Document("1", '"A"\nx', 2.5)
    assert parse_response(bare, num_queries=1)[0][0] == Document("1", '"A"\nx', None)
    assert parse_response(pyserini, num_queries=1)[0][0].contents == '"A"\nx'
    with pytest.raises(RuntimeError, match="2 lists"):
        parse_response(scored, num_queries=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(corpus_path: Path):
    """`agentrl retriever serve` in a child process on a free 127.0.0.1 port."""
    port = free_port()
    cmd = [sys.executable, "-c", "from agentrl.cli import main; main()", "retriever", "serve",
           "--corpus", str(corpus_path), "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"retriever server did not start:\n{proc.communicate()[0] if proc.poll() is not None else ''}"
                )
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
async def test_http_round_trip_against_agentrl_retriever_serve(served: str) -> None:
    async with httpx.AsyncClient() as client:
        raw = await client.post(
            f"{served}/retrieve",
            json={"queries": ["capital of France"], "topk": 2, "return_scores": True},
        )
    body = raw.json()
    assert body["result"][0][0]["document"] == {
        "id": "0",
        "contents": '"Paris"\nParis is the capital and largest city of France.',
    }
    assert isinstance(body["result"][0][0]["score"], float) and len(body["result"][0]) == 2

    retriever = HTTPRetriever(served, window_s=0.01)
    queries = ["capital of France", "Dravidian language", "edible berry", "head covering"]
    results = await asyncio.gather(*(retriever.search([q], 3) for q in queries))
    assert [docs[0][0].title for docs in results] == ["Paris", "Kannada", "Tomato", "Hat"]
    assert retriever.batcher.num_backend_calls == 1  # four concurrent searches, one request
    await retriever.close()

    env = SearchR1Env(retriever_url=served)
    task = Task(
        id="t",
        data={"question": "which city is the capital of France", "golden_answers": ["Paris"]},
    )
    await env.reset(options={"task": task})
    result = await env.step(
        __import__("agentrl.types").types.Message(
            role="assistant", content="<search>capital of France</search>"
        )
    )
    assert result.observation[0].content.startswith('\n\n<information>Doc 1(Title: "Paris")')


async def test_server_down_says_how_to_start_one() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = SearchR1Env(retriever_url=url)
    task = Task(id="t", data={"question": "q", "golden_answers": ["a"]})
    with pytest.raises(RetrieverUnavailableError, match="agentrl retriever serve --corpus"):
        await env.reset(options={"task": task})
    retriever = HTTPRetriever(url, max_retries=1)
    with pytest.raises(
        RetrieverUnavailableError,
        match=r"unreachable after 2 tries.*agentrl retriever serve --corpus",
    ):
        await retriever.search(["q"], 3)


def test_bm25s_is_imported_with_jax_kept_off_the_gpu():
    # bm25s imports jax when installed and runs a top-k at import; on a GPU machine JAX would
    # then pre-allocate 75% of the device. A fresh process: the index's import sets the
    # platform first, and a user's own JAX_PLATFORMS is left alone.
    code = (
        "import os; from agentrl_envs.search_r1 import bm25; bm25._bm25s(); "
        "print(os.environ.get('JAX_PLATFORMS'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "cpu", out.stderr[-1000:]
    env["JAX_PLATFORMS"] = "cuda"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "cuda", out.stderr[-1000:]
