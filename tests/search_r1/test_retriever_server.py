"""`agentrl retriever serve`'s bounds and key: `topk` and queries per call are bounded (400 naming
the field, never a 500 or the whole corpus), bodies over the limit are a 413, and with an API key
every route but /health wants `Authorization: Bearer`, which HTTPRetriever sends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentrl_envs.search_r1.bm25 import BM25Index
from agentrl_envs.search_r1.http_client import HTTPRetriever
from agentrl_envs.search_r1.server import RetrieverLimits, make_app
from typer.testing import CliRunner

from agentrl.cli import app as cli_app
from tests.support.servers import run_app_in_thread

KEY = "retriever-key"
LIMITS = RetrieverLimits(max_topk=5, max_queries=3, max_body_bytes=2000)


@pytest.fixture
def served(corpus_path: Path) -> Iterator[str]:
    index = BM25Index.load_or_build(corpus_path)
    thread = run_app_in_thread(make_app(index, api_key=KEY, limits=LIMITS))
    yield thread.url
    thread.stop()


def _retrieve(url: str, body: Any, key: str | None = KEY, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/retrieve", json=body, headers=headers, timeout=30, **kw)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"queries": ["paris"], "topk": -5}, "topk: Input should be greater than or equal to 1"),
        ({"queries": ["paris"], "topk": 1e9}, "topk=1000000000 is over this server's limit of 5"),
        ({"queries": ["paris"], "topk": 6}, "topk=6 is over this server's limit of 5"),
        (
            {"queries": ["a", "b", "c", "d"]},
            "queries: 4 in one call, over this server's limit of 3",
        ),
        ({"queries": "paris"}, "queries: Input should be a valid list"),
        ({"topk": 2}, "queries: Field required"),
    ],
)
def test_a_bad_retrieve_is_a_400_naming_the_field(served: str, body: Any, named: str) -> None:
    r = _retrieve(served, body)
    assert r.status_code == 400 and named in r.json()["detail"], r.text


def test_a_body_over_the_limit_is_a_413(served: str) -> None:
    r = _retrieve(served, {"queries": ["x" * 3000]})
    assert r.status_code == 413 and "over this server's limit of 2000" in r.json()["detail"]


def test_every_route_but_health_wants_the_key(served: str) -> None:
    assert _retrieve(served, {"queries": ["paris"]}, key=None).status_code == 401
    wrong = _retrieve(served, {"queries": ["paris"]}, key="nope")
    assert wrong.status_code == 401 and wrong.json() == {"error": "Unauthorized"}
    assert httpx.get(f"{served}/docs").status_code == 401
    assert httpx.get(f"{served}/health").status_code == 200
    ok = _retrieve(served, {"queries": ["capital of France"], "topk": 5})
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 5


async def test_http_retriever_sends_the_key(served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_API_KEY", KEY)
    retriever = HTTPRetriever(served, max_retries=0)
    docs = await retriever.search(["capital of France"], 2)
    assert docs[0][0].title == "Paris"
    await retriever.close()
    keyless = HTTPRetriever(served, max_retries=0, api_key="")
    with pytest.raises(RuntimeError, match="HTTP 401"):
        await keyless.search(["capital of France"], 2)
    await keyless.close()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--topk", "9", "--max-topk", "5"], "--topk 9 is over --max-topk 5"),
        (["--max-body-mb", "nan"], "'--max-body-mb'"),
        (["--max-topk", "0"], "'--max-topk'"),
    ],
)
def test_serve_refuses_inconsistent_bounds(corpus_path: Path, flags: list[str], named: str) -> None:
    result = CliRunner().invoke(
        cli_app, ["retriever", "serve", "--corpus", str(corpus_path), *flags]
    )
    assert result.exit_code == 2 and named in result.output, result.output
