"""`/update_weights_from_tensor` refuses the allocation bombs built of allow-listed globals
(`bytearray(10**9)`, `deque(repeat(0, 10**10), 0)`) with a 400 that names the call, and the server
goes on answering."""

from __future__ import annotations

import httpx
import pytest

from agentrl.engine.local import LocalEngine
from tests.weights.test_payload import BYTEARRAY_BOMB, DEQUE_BOMB


@pytest.fixture(scope="module")
def served(served: tuple[str, LocalEngine]) -> tuple[str, LocalEngine]:
    assert httpx.post(f"{served[0]}/begin_weight_update", json={}).status_code == 200
    return served


@pytest.mark.parametrize(
    ("payload", "called"),
    [(BYTEARRAY_BOMB, "builtins.bytearray"), (DEQUE_BOMB, "itertools.repeat")],
    ids=["bytearray", "deque_repeat"],
)
def test_a_payload_bomb_is_a_400_naming_the_call(served, payload: str, called: str) -> None:
    url, _ = served
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"}
    r = httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert f"refusing to call {called}" in r.json()["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
