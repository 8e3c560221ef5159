"""`agentrl serve`'s bounds and validation: every client error is a 400 naming the field (no
silent drops, truncations or 500s), bodies over the limit are a 413, `max_new_tokens` is capped to
the context, a 10 MB body does not block /health, a client that disconnects has its generation
aborted, and weight-group rendezvous neither open rank 0's store nor starve the thread pool."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentrl.engine.local import LocalEngine
from agentrl.engine.serve.requests import ServerLimits
from tests.support.servers import start_server_thread

CONTEXT = 48
LIMITS = ServerLimits(max_body_bytes=200_000, max_prompts=8, max_n=4, context_len=CONTEXT,
                      group_timeout_s=5.0)  # fmt: skip
PROMPT = [1, 9690, 198, 2683, 314]


@pytest.fixture(scope="module")
def server_limits() -> ServerLimits:
    return LIMITS


NAN = float("nan")


def _message(body: dict[str, Any]) -> str:
    """SGLang 0.5.23's two 400 bodies: ErrorResponse (a malformed body) and
    `{"error": {"message"}}` (a request /generate refused)."""
    return body["message"] if body.get("object") == "error" else body["error"]["message"]


def _post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    """Python's JSON, which writes NaN as a client may (httpx refuses to)."""
    headers = {"Content-Type": "application/json"}
    return httpx.post(url, content=json.dumps(body), headers=headers, timeout=60)


BAD_GENERATE = {
    "fewer sampling_params than prompts": (
        {"input_ids": [PROMPT, PROMPT, PROMPT], "sampling_params": [{}, {}]},
        "sampling_params is a list of 2 for 3 prompt(s)",
    ),
    "fewer rids than prompts": (
        {"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, "rid is a list of 1 for 2 prompt(s)"),
    "NaN temperature": ({"input_ids": PROMPT, "sampling_params": {"temperature": NAN}},
                        "temperature: Input should be a finite number"),
    "float id": ({"input_ids": [1, 2.0, 3]}, "input_ids.list[int].1: Input should be a valid integer"),
    "float max_new_tokens": ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1e30}},
                             "max_new_tokens: Input should be a valid integer"),
    "n = 0": ({"input_ids": PROMPT, "sampling_params": {"n": 0}}, "n: Input should be greater"),
    "prompt longer than the context": (
        {"input_ids": [1] * CONTEXT}, f"longer than the model's context length ({CONTEXT} tokens)"),
    "ids of the wrong type": ({"input_ids": "1 2 3"}, "input_ids"),
    "sampling_params of the wrong type": ({"input_ids": PROMPT, "sampling_params": 7}, "sampling_params"),
    "text and ids": ({"input_ids": PROMPT, "text": "hi"}, "cannot be provided at the same time"),
    "an empty prompt in a batch": ({"input_ids": [PROMPT, []]}, "the prompt is empty"),
    "too many prompts": ({"input_ids": [PROMPT] * 9}, "9 prompts in one request, over this server's limit of 8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_a_bad_generate_request_is_a_400_naming_the_field(served, case: str) -> None:
    url, _ = served
    body, named = BAD_GENERATE[case]
    r = _post_json(f"{url}/generate", body)
    assert r.status_code == 400, r.text
    assert named in _message(r.json()), r.json()


BAD_OPENAI = {
    "n = 0": ({"n": 0}, "n: Input should be greater than or equal to 1"),
    "n over the limit": ({"n": 2000}, "n=2000 is over this server's limit of 4"),
    "NaN temperature": ({"temperature": NAN}, "temperature: Input should be a finite number"),
    "prompt longer than the context": (
        {"prompt": [1] * CONTEXT}, f"longer than the model's context length ({CONTEXT} tokens)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OPENAI))
def test_a_bad_openai_request_is_a_400_naming_the_field(served, case: str) -> None:
    url, _ = served
    fields, named = BAD_OPENAI[case]
    r = _post_json(f"{url}/v1/completions", {"prompt": PROMPT, **fields})
    assert r.status_code == 400 and named in r.json()["message"], r.text


def test_max_new_tokens_is_capped_to_the_context(served) -> None:
    url, _ = served
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**30, "temperature": 0}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= CONTEXT - len(PROMPT)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).status_code == 200


def test_a_batch_keeps_every_prompt_with_its_own_params(served) -> None:
    url, _ = served
    params = [{"max_new_tokens": k, "temperature": 0, "stop_token_ids": []} for k in (1, 2, 3)]
    body = {"input_ids": [PROMPT] * 3, "sampling_params": params, "rid": ["a", "b", "c"]}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["id"] for o in r.json()] == ["a", "b", "c"]
    assert all(
        o["meta_info"]["completion_tokens"] <= k for o, k in zip(r.json(), (1, 2, 3), strict=True)
    )


def test_a_body_over_the_limit_is_a_413(served) -> None:
    url, _ = served
    big = {"input_ids": [1] * 100_000}  # ~300 kB of JSON
    r = httpx.post(f"{url}/generate", json=big, timeout=60)
    assert r.status_code == 413 and "limit of 200000 bytes" in r.json()["message"], r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"input_ids": [1'
        for _ in range(50_000):
            yield b", 1, 1"
        yield b"]}"

    r = httpx.post(f"{url}/generate", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413, r.text


class _GatedTokenizer:
    """The real tokenizer, whose `encode` first waits for the test to let it go: while it waits,
    the server must still answer (it would not, were encoding on the event loop)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self.started, self.release = (
            tokenizer,
            threading.Event(),
            threading.Event(),
        )

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.started.set()
        self.release.wait(60)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


async def test_a_10mb_body_does_not_block_health(tiny_model_path: str) -> None:
    engine = LocalEngine.load(tiny_model_path, device="cpu", seed=0)
    tokenizer = _GatedTokenizer(engine.tokenizer)
    thread = start_server_thread(engine, tokenizer=tokenizer)
    try:
        async with httpx.AsyncClient(base_url=thread.url, timeout=60) as client:
            body = {"text": "hello world " * 875_000, "sampling_params": {"max_new_tokens": 1}}
            big = asyncio.create_task(client.post("/generate", json=body))
            assert await asyncio.to_thread(tokenizer.started.wait, 60)
            try:
                health = await client.get("/health", timeout=30)
            finally:
                tokenizer.release.set()
            assert health.status_code == 200
            r = await big
        assert r.status_code == 400 and "longer than the model's context length" in r.text
    finally:
        thread.stop()
        await engine.close()


async def test_a_client_that_disconnects_has_its_generation_aborted(served) -> None:
    _, engine = served
    thread = start_server_thread(engine)  # the engine's own context: a long generation
    url, before = thread.url, engine.stats.num_generated_tokens
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4000, "sampling_seed": 3}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        request = asyncio.create_task(client.post("/generate", json=long))
        while engine.stats.num_generated_tokens == before:  # running in the engine
            await asyncio.sleep(0.01)
        request.cancel()  # httpx closes the connection: the client is gone
        await asyncio.gather(request, return_exceptions=True)
        for _ in range(2000):
            loads = (await client.get("/v1/loads")).json()["loads"][0]
            if loads["num_running_reqs"] == 0 and not engine._scheduler.running:
                break
            await asyncio.sleep(0.01)
    thread.stop()
    assert loads["num_running_reqs"] == 0 and not engine._scheduler.running
    assert engine.stats.num_generated_tokens - before < 4000


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once it is closed


def test_rank_0_is_refused_it_is_the_trainers(served) -> None:
    url, _ = served
    body = {"master_address": "127.0.0.1", "master_port": _closed_port(), "rank_offset": 0,
            "world_size": 2, "backend": "gloo"}  # fmt: skip
    r = httpx.post(f"{url}/init_weights_update_group", json=body, timeout=60)
    assert r.status_code == 400 and "rank 0 of a weight update group is the trainer's" in r.text


async def test_rendezvous_parked_on_a_closed_port_starve_nothing(served) -> None:
    """As many calls as asyncio's default thread pool has threads wait on a port nobody serves;
    meanwhile a text /generate (tokenized in that pool) and a disk update still answer."""
    url, _ = served
    pool_size = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        parked = [
            asyncio.create_task(client.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": _closed_port(), "rank_offset": 1,
                "world_size": 2, "backend": "gloo", "group_name": f"parked-{i}"}))
            for i in range(pool_size)
        ]  # fmt: skip
        await asyncio.sleep(0.2)  # let them reach the server
        text = await client.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        )
        disk = await client.post("/update_weights_from_disk", json={"model_path": "/nope"})
        assert not all(t.done() for t in parked)
        assert text.status_code == 200 and disk.status_code == 400 and "/nope" in disk.text
        answers = await asyncio.gather(*parked)
    assert all(a.status_code == 400 and "Failed to initialize" in a.text for a in answers)
