"""Attention over the KV arena, registered with transformers' `AttentionInterface` as
"agentrl_arena": each layer writes the step's new K/V into the arena in place, then attends over
each sequence's slot, with FlashAttention-2 as bundled in torch (varlen, `seqused_k`) on CUDA in
bf16/fp16 (a step where every sequence decodes one token: the Triton split-K kernel of
`decode_attention.py`, where triton is installed) and SDPA elsewhere. A forward without an `arena_step` (a plain call of the model, as
`generate()` or a teacher-forced check makes) is transformers' own SDPA attention.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

ATTENTION_NAME = "agentrl_arena"
_MODULES = ("embed_tokens", "rotary_emb", "layers", "norm")


@dataclass
class ArenaStep:
    """Where one packed step's tokens go in the arena and what each of them attends to.

    The step's N new tokens belong to B sequences; sequence b has `q_lens[b]` new tokens and,
    after this step, `kv_lens[b]` tokens in its slot starting at buffer row `kv_starts[b]`.
    """

    keys: list[torch.Tensor]  # per layer [rows, kv_heads, head_dim]
    values: list[torch.Tensor]
    write_index: torch.Tensor  # [N] buffer row of each new token
    use_flash: bool
    max_q: int
    max_k: int
    # FlashAttention varlen: queries packed by cu_q, keys read from row cu_k[b], seqused_k[b] long.
    cu_q: torch.Tensor | None = None  # [B + 1] int32
    cu_k: torch.Tensor | None = None  # [B + 1] int32 (the last entry is not read)
    seqused_k: torch.Tensor | None = None  # [B] int32
    split_k: bool = False
    """FlashAttention's layout, every sequence one query: run the split-K decode kernel instead."""
    # SDPA: queries padded to [B, max_q], keys gathered to [B, max_k] under a causal mask.
    gather_index: torch.Tensor | None = None  # [B * max_k] buffer rows
    slot_rows: tuple[int, int, int] | None = None
    """SDPA, instead of `gather_index` when the sequences' slots are evenly spaced (a batch admitted
    together holds slots 0, 1, 2, ...): (first slot, slot step, slot length). Keys are then read
    through a strided view of the arena, with no copy."""
    mask: torch.Tensor | None = None  # [B, 1, max_q, max_k] True = attend
    pad_index: torch.Tensor | None = None  # [B * max_q] packed query of each padded one
    unpad_index: torch.Tensor | None = None  # [N] padded position of each packed query
    is_fresh: bool = False
    """SDPA: every sequence starts in this step (a plain prefill): attend causally over the new
    keys themselves, no arena read and no mask."""
    groups: list[tuple[torch.Tensor, ArenaStep]] | None = None
    """SDPA, a step that mixes decodes with (continued) prefills: padding every sequence to the
    longest query would compute B x max_q queries (20 decodes beside one 700-token observation:
    14,000 for 720). Instead the one-token sequences attend together and each longer one alone,
    each group a step of its own over the arena written once: (its packed queries, its step)."""

    @classmethod
    def build(
        cls,
        arena: Any,
        *,
        write_index: torch.Tensor,
        q_lens: list[int],
        kv_lens: list[int],
        kv_starts: list[int],
        cu_q: list[int],
        device: torch.device | str,
        use_flash: bool,
        split_k: bool = False,
    ) -> ArenaStep:
        step = cls(arena.keys, arena.values, write_index, use_flash, max(q_lens), max(kv_lens))
        if use_flash:
            step.split_k = split_k and step.max_q == 1
            int32: dict[str, Any] = dict(dtype=torch.int32, device=device)
            step.cu_q = torch.tensor(cu_q, **int32)
            step.cu_k = torch.tensor(kv_starts + [kv_starts[-1]], **int32)
            step.seqused_k = torch.tensor(kv_lens, **int32)
            return step
        if len(set(q_lens)) > 1 and q_lens != kv_lens:
            step.groups = [
                _group_step(arena, rows, write_index, q_lens, kv_lens, kv_starts, cu_q, device)
                for rows in _row_groups(q_lens)
            ]
            return step
        q_len = torch.tensor(q_lens)[:, None]  # [B, 1]
        q_pos = torch.arange(step.max_q)[None, :]  # [1, max_q]
        step.is_fresh = q_lens == kv_lens
        if not step.is_fresh:
            query_at = torch.tensor(kv_lens)[:, None] - q_len + q_pos  # [B, max_q] positions
            key_at = torch.arange(step.max_k)
            if len(q_lens) > 1 or step.max_q > 1:  # one row decoding sees all its keys: no mask
                step.mask = (key_at[None, None, :] <= query_at[:, :, None])[:, None].to(device)
            step.slot_rows = _evenly_spaced(kv_starts, arena.max_len)
            if step.slot_rows is None:
                step.gather_index = (torch.tensor(kv_starts)[:, None] + key_at).view(-1).to(device)
        pad_index = torch.tensor(cu_q[:-1])[:, None] + torch.minimum(q_pos, q_len - 1)
        step.pad_index = pad_index.view(-1).to(device)
        rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
        within = torch.arange(len(rows)) - torch.tensor(cu_q[:-1])[rows]
        step.unpad_index = (rows * step.max_q + within).to(device)
        return step

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """`query` [1, H, N, D], `key`/`value` [1, KVH, N, D] (rotated). Returns [1, N, H, D]."""
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return self.attend_packed(layer, q, k, v, scale)[None]

    def attend_packed(
        self,
        layer: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        *,
        written: bool = False,
    ) -> torch.Tensor:
        """`q` [N, H, D], `key`/`value` [N, KVH, D] (rotated; any strides with a unit last one).
        Writes the keys and values into the arena (unless the caller did: `written`), then
        attends. Returns [N, H, D]."""
        keys = self.keys[layer]
        values = self.values[layer]
        if not written:
            keys.index_copy_(0, self.write_index, key.to(keys.dtype))
            values.index_copy_(0, self.write_index, value.to(values.dtype))
        if self.groups is not None:
            out = q.new_empty(q.shape)
            for packed, group in self.groups:
                gq, gk, gv = (t.index_select(0, packed) for t in (q, key, value))
                out.index_copy_(
                    0, packed, group.attend_packed(layer, gq, gk, gv, scale, written=True)
                )
            return out
        if self.split_k:
            assert self.cu_k is not None and self.seqused_k is not None
            from agentrl.engine.local.decode_attention import num_splits, split_k_decode

            splits = num_splits(q.shape[0], keys.shape[1], _num_sms(q.device))
            return split_k_decode(q, keys, values, self.cu_k[:-1], self.seqused_k, scale, splits)
        if self.use_flash:
            # Each row reads only its own seqused_k keys: the slot's unwritten tail is never read.
            return torch.ops.aten._flash_attention_forward(
                q,
                keys,
                values,
                self.cu_q,
                self.cu_k,
                self.max_q,
                self.max_k,
                0.0,
                True,
                False,
                scale=scale,
                seqused_k=self.seqused_k,
            )[0]
        assert self.pad_index is not None and self.unpad_index is not None
        b = self.pad_index.numel() // self.max_q
        (_, num_heads, head_dim) = q.shape
        # index_select, not advanced indexing: several times faster on CPU
        padded_q = q.index_select(0, self.pad_index).view(b, self.max_q, num_heads, head_dim)
        if self.is_fresh:  # padded keys sit after each row's real ones: causal hides them
            k = key.index_select(0, self.pad_index).view(b, self.max_q, -1, head_dim)
            v = value.index_select(0, self.pad_index).view(b, self.max_q, -1, head_dim)
        elif self.slot_rows is not None:  # [b, max_k, KVH, D] views into the slots
            first, every, slot_len = self.slot_rows
            rows = slice(first, first + every * (b - 1) + 1, every)
            k = keys.view(-1, slot_len, *keys.shape[1:])[rows, : self.max_k]
            v = values.view(-1, slot_len, *values.shape[1:])[rows, : self.max_k]
        else:
            assert self.gather_index is not None
            k = keys.index_select(0, self.gather_index).view(b, self.max_k, -1, head_dim)
            v = values.index_select(0, self.gather_index).view(b, self.max_k, -1, head_dim)
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=self.mask,
            is_causal=self.is_fresh,
            scale=scale,
            enable_gqa=True,
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
        return out.index_select(0, self.unpad_index)


def _row_groups(q_lens: list[int]) -> list[list[int]]:
    """The sequences of a mixed SDPA step: the one-token ones together, every longer one alone."""
    ones = [b for b, n in enumerate(q_lens) if n == 1]
    return ([ones] if ones else []) + [[b] for b, n in enumerate(q_lens) if n > 1]


def _group_step(
    arena: Any,
    rows: list[int],
    write_index: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    kv_starts: list[int],
    cu_q: list[int],
    device: torch.device | str,
) -> tuple[torch.Tensor, ArenaStep]:
    """One group of a mixed step: its queries' packed positions and the step over its rows."""
    lens = [q_lens[b] for b in rows]
    packed = torch.cat([torch.arange(cu_q[b], cu_q[b] + q_lens[b]) for b in rows]).to(device)
    step = ArenaStep.build(
        arena,
        write_index=write_index,
        q_lens=lens,
        kv_lens=[kv_lens[b] for b in rows],
        kv_starts=[kv_starts[b] for b in rows],
        cu_q=[0, *itertools.accumulate(lens)],
        device=device,
        use_flash=False,
    )
    return packed, step


def _evenly_spaced(kv_starts: list[int], slot_len: int) -> tuple[int, int, int] | None:
    """(first slot, step, slot_len) when the slots starting at `kv_starts` are s0, s0 + d, ..."""
    first = kv_starts[0]
    every = kv_starts[1] - kv_starts[0] if len(kv_starts) > 1 else slot_len
    if first % slot_len or every <= 0 or every % slot_len:
        return None
    if any(start != first + i * every for i, start in enumerate(kv_starts)):
        return None
    return first // slot_len, every // slot_len, slot_len


def arena_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    arena_step: ArenaStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if arena_step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = cast(int, module.layer_idx)  # set by every transformers attention module
    return arena_step.attend(layer, query, key, value, scale), None


@torch.inference_mode()
def forward_over_arena(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    step: ArenaStep,
    last_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's own modules, run over one packed row `input_ids` [1, N]. Returns logits
    [B, V] at `last_index` (or [N, V] for every token). Skips the model's `forward`, whose mask
    building would read the packed positions back from the device (a sync, and under a CUDA
    graph an error); the arena step already says who attends to what."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)  # [1, N, hidden]
    position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        out = layer(
            hidden,
            attention_mask=None,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=None,
            use_cache=False,
            arena_step=step,
        )
        hidden = out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple
    hidden = inner.norm(hidden)[0]  # [N, hidden]
    if last_index is not None:
        hidden = hidden[last_index]  # [B, hidden]
    return model.lm_head(hidden)


def use_arena_attention(model: Any) -> None:
    """Route the model's attention through the arena (masks as for SDPA when called plainly)."""
    if not all(hasattr(getattr(model, "model", None), m) for m in _MODULES) or not hasattr(
        model, "lm_head"
    ):
        raise ValueError(
            f"{type(model).__name__} is not a decoder LocalEngine can run: it needs "
            f"model.{{{', '.join(_MODULES)}}} and lm_head, as transformers' Llama/Qwen/Mistral have"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, arena_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise RuntimeError(
            f"{type(model).__name__} did not take attention implementation {ATTENTION_NAME!r}; "
            "LocalEngine needs a transformers model built on AttentionInterface"
        )


def flash_attention_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """torch's bundled FlashAttention-2 runs on CUDA in half precision only."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)


@functools.cache
def split_k_supported(device: str) -> bool:
    """Whether the split-K decode kernel runs here: CUDA, with triton installed."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import agentrl.engine.local.decode_attention  # noqa: F401  (compiles nothing yet)
    except ImportError:
        return False
    return True


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def flash_reads_head_major(device: str, dtype: torch.dtype) -> bool:
    """Whether FlashAttention, called as the arena calls it, takes keys and values stored head
    major (heads a whole buffer apart, rows one head_dim apart) and gives what it gives on
    row-major ones: probed once per device and dtype, so an engine never depends on it blindly."""
    if not flash_attention_supported(device, dtype):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(n, h, 64, generator=g).to(device, dtype)
            for n, h in ((3, 4), (12, 2), (12, 2))
        )
        k_hm, v_hm = (t.permute(1, 0, 2).contiguous().permute(1, 0, 2) for t in (k, v))
        int32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        cu_q = torch.tensor([0, 1, 2, 3], **int32)
        cu_k = torch.tensor([0, 4, 8, 8], **int32)
        seqused = torch.tensor([3, 4, 2], **int32)
        out = [
            torch.ops.aten._flash_attention_forward(
                q,
                keys,
                values,
                cu_q,
                cu_k,
                1,
                4,
                0.0,
                True,
                False,
                scale=0.125,
                seqused_k=seqused,
            )[0]
            for keys, values in ((k, v), (k_hm, v_hm))
        ]
        return bool(torch.equal(out[0], out[1]))
    except (RuntimeError, TypeError):  # a build whose kernel refuses the strides: row major
        return False
