"""SDPA attention over the KV arena (CPU and fp32 path): reading evenly spaced slots through a
strided view gives what reading them by gathered rows gives, and both match per-sequence attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrl.engine.local.attention import ArenaStep
from agentrl.engine.local.kv_arena import KVArena

HEADS, KV_HEADS, HEAD_DIM, SLOT_LEN = 4, 2, 8, 32


def filled_arena() -> KVArena:
    arena = KVArena(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_slots=6,
                    max_len=SLOT_LEN, dtype=torch.float32)  # fmt: skip
    arena.allocate("cpu")
    torch.manual_seed(0)
    arena.keys[0].normal_()
    arena.values[0].normal_()
    return arena


def attend(arena: KVArena, slots: list[int], q_lens: list[int], kv_lens: list[int]):
    """The step's output, and per sequence the reference over its own slot's rows."""
    n = sum(q_lens)
    cu_q = [0]
    for q_len in q_lens:
        cu_q.append(cu_q[-1] + q_len)
    starts = [arena.offset(s) for s in slots]
    write_index = torch.tensor(  # each sequence's new tokens: the last q_len rows of its K/V
        [st + k - q + i for st, q, k in zip(starts, q_lens, kv_lens, strict=True) for i in range(q)]
    )
    step = ArenaStep.build(arena, write_index=write_index, q_lens=q_lens, kv_lens=kv_lens,
                           kv_starts=starts, cu_q=cu_q, device="cpu", use_flash=False)  # fmt: skip
    query = torch.randn(1, HEADS, n, HEAD_DIM)
    key, value = torch.randn(1, KV_HEADS, n, HEAD_DIM), torch.randn(1, KV_HEADS, n, HEAD_DIM)
    out = step.attend(0, query, key, value, HEAD_DIM**-0.5)[0]  # [N, H, D]
    expected = []
    for b, (start, q_len, kv_len) in enumerate(zip(starts, q_lens, kv_lens, strict=True)):
        k = arena.keys[0][start : start + kv_len].transpose(0, 1)  # [KVH, kv_len, D]
        v = arena.values[0][start : start + kv_len].transpose(0, 1)
        q = query[0, :, cu_q[b] : cu_q[b + 1]]  # [H, q_len, D]
        mask = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        expected.append(ref.transpose(0, 1))  # [q_len, H, D]
    return step, out, torch.cat(expected)


@pytest.mark.parametrize(
    ("slots", "strided"),
    [([0, 1, 2], True), ([1, 3, 5], True), ([4], True), ([2, 0, 5], False), ([0, 1, 3], False)],
)
def test_decode_and_continued_prefill_read_the_right_rows(slots: list[int], strided: bool) -> None:
    arena = filled_arena()
    q_lens = [1, 2, 1][: len(slots)]  # one length: no groups (a mixed step: the test below)
    kv_lens = [17, 9, 30][: len(slots)]
    step, out, expected = attend(arena, slots, [2] * len(slots), kv_lens)
    assert step.groups is None
    assert (step.slot_rows is not None) == strided
    assert (step.gather_index is None) == strided
    assert torch.allclose(out, expected, atol=1e-5)
    step, out, expected = attend(arena, slots, q_lens, kv_lens)
    assert torch.allclose(out, expected, atol=1e-5)


def test_a_mixed_step_attends_in_groups_not_padded_to_its_longest_query() -> None:
    """Decodes beside continued prefills: the one-token sequences attend together, each longer
    one alone (no sequence padded to another's length), and every output is per-sequence
    attention over its own slot."""
    q_lens, kv_lens = [1, 5, 1, 3, 1], [17, 9, 30, 12, 4]
    step, out, expected = attend(filled_arena(), [0, 1, 2, 3, 4], q_lens, kv_lens)
    assert step.groups is not None
    assert [p.tolist() for p, _ in step.groups] == [[0, 6, 10], [1, 2, 3, 4, 5], [7, 8, 9]]
    assert [g.max_q for _, g in step.groups] == [1, 5, 3]
    assert [g.max_k for _, g in step.groups] == [30, 9, 12]
    assert torch.allclose(out, expected, atol=1e-5)


def test_strided_view_equals_gathered_rows_exactly() -> None:
    """Same arena contents, same inputs: the view path and the gather path agree bit for bit."""
    step, _, _ = attend(filled_arena(), [1, 2, 3], [1, 1, 1], [12, 20, 7])
    assert step.slot_rows == (1, 1, SLOT_LEN)
    by_view, by_gather = filled_arena(), filled_arena()
    view_step = ArenaStep(**{**vars(step), "keys": by_view.keys, "values": by_view.values})
    gather_step = ArenaStep(**{**vars(step), "keys": by_gather.keys, "values": by_gather.values})
    gather_step.slot_rows = None
    starts = torch.tensor([1, 2, 3])[:, None] * SLOT_LEN
    gather_step.gather_index = (starts + torch.arange(step.max_k)).view(-1)
    query, key, value = (torch.randn(1, h, 3, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    assert torch.equal(
        view_step.attend(0, query, key, value, 0.3), gather_step.attend(0, query, key, value, 0.3)
    )
