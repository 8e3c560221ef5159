"""The engine's own forward of a Llama-family decoder (Llama, Qwen2, Mistral) over the KV arena, with
fused projections and, on CUDA, its pieces compiled by `torch.compile`.

Each layer reads one q/k/v weight and one gate/up weight instead of three and two. They are not
copies: the model's own q/k/v (and gate/up) parameters are views, back to back, of one storage, and
the fused weight is a view of all of it. `update_weights` copies into the parameters in place, so
the fused weights change with them (and CUDA graphs that read them stay valid); when the parameters
get new storage (a release that moves or drops them), `rebind` makes the views again.

A layer runs as two functions around the attention: `attention_inputs` (RMSNorm, the q/k/v product,
rotary, the K/V write into the arena) and `mlp_block` (output projection, residual, RMSNorm,
gate/up, SiLU, down, residual); one layer's `mlp_block` and the next one's `attention_inputs` run as
one function. The attention in between (FlashAttention, or SDPA) stays outside the compiled code.
The arithmetic is transformers' own (RMSNorm in fp32, then cast; rotate-half rotary), so logprobs
match a teacher-forced transformers forward as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.engine.local.attention import ArenaStep

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "qwen2", "mistral")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in fp32, cast back, then scaled."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    write_index: torch.Tensor,
    head_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hidden` [N, hidden], `cos`/`sin` [N, 1, D] -> rotated q [N, H, D], k [N, KVH, D], v; k and
    v are also written into the layer's arena rows `write_index` (compiled, in the same kernel
    as the rotary: inductor updates the arena in place). `keys`/`values` come as stored (see
    `stored_layout`): [rows, KVH, D], or [KVH, rows, D] when `head_major`."""
    qkv = F.linear(rms_norm(hidden, norm_weight, eps), qkv_weight, qkv_bias)
    qkv = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, -1)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if head_major:
        keys.index_copy_(1, write_index, k.transpose(0, 1).to(keys.dtype))
        values.index_copy_(1, write_index, v.transpose(0, 1).to(values.dtype))
    else:
        keys.index_copy_(0, write_index, k.to(keys.dtype))
        values.index_copy_(0, write_index, v.to(values.dtype))
    return q, k, v


def stored_layout(buffer: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """An arena buffer in its storage's own order, and whether it is head major ([KVH, rows, D]
    seen as [rows, KVH, D]). Compiled code must write the arena in this contiguous form: written
    through the permuted view, inductor copies the whole buffer back onto itself on every call (a
    1.7B model at batch 64 read and wrote 10 GB a decode step on an H100, 3x its step time)."""
    if buffer.stride(1) > buffer.stride(0):
        return buffer.permute(1, 0, 2), True
    return buffer, False


def mlp_block(
    hidden: torch.Tensor,
    attn: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The rest of a layer after attention (`attn` [N, H, D]); returns the new residual stream."""
    hidden = hidden + F.linear(attn.flatten(1), o_weight, o_bias)
    normed = rms_norm(hidden, norm_weight, eps)
    gate, up = F.linear(normed, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down_weight, down_bias)


def mlp_then_attention_inputs(
    hidden: torch.Tensor, attn: torch.Tensor, mlp: tuple[Any, ...], nxt: tuple[Any, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer i's `mlp_block`, then layer i + 1's `attention_inputs`: one compiled function, so
    the residual add and the next RMSNorm are one kernel."""
    hidden = mlp_block(hidden, attn, *mlp)
    return (hidden, *attention_inputs(hidden, *nxt))


@dataclass
class _Fused:
    """Parameters read as one weight (rows stacked in order) and that weight, once bound."""

    members: list[torch.Tensor]
    weight: torch.Tensor | None = None

    def bind(self) -> bool:
        """Make `weight` cover the members; True when they had to be moved together (a copy)."""
        first = self.members[0]
        rows = sum(m.shape[0] for m in self.members)
        shape = (rows, *first.shape[1:])
        if _back_to_back(self.members):
            self.weight = first.detach().as_strided(shape, _strides(shape), first.storage_offset())
            return False
        self.weight = torch.cat([m.detach() for m in self.members])
        start = 0
        for member in self.members:  # the parameters become views of the fused storage
            member.data = self.weight[start : start + member.shape[0]]
            start += member.shape[0]
        return True


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _back_to_back(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype for t in tensors):
        return False
    if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return False
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: _Fused
    qkv_bias: _Fused | None
    o_proj: torch.nn.Linear
    gate_up: _Fused
    gate_up_bias: _Fused | None
    down_proj: torch.nn.Linear

    def attention_args(self) -> tuple[Any, ...]:
        """`attention_inputs`' weight arguments."""
        bias = self.qkv_bias.weight if self.qkv_bias else None
        return (self.input_norm, self.eps, self.qkv.weight, bias)

    def mlp_args(self) -> tuple[Any, ...]:
        """`mlp_block`'s arguments after `hidden` and `attn`."""
        bias = self.gate_up_bias.weight if self.gate_up_bias else None
        return (
            self.o_proj.weight,
            self.o_proj.bias,
            self.post_norm,
            self.eps,
            self.gate_up.weight,
            bias,
            self.down_proj.weight,
            self.down_proj.bias,
        )


def unsupported_reason(model: Any) -> str | None:
    """Why the fused forward cannot run `model` (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None)
        names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(not isinstance(getattr(m, n, None), torch.nn.Linear) for m, n in names):
            return f"{type(layer).__name__} lacks Llama's q/k/v/o and gate/up/down linears"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "the attention normalises q and k (q_norm/k_norm)"
    return None


class FusedDecoder:
    """`forward` over the arena for a Llama-family model, with fused q/k/v and gate/up weights.
    `compile`: run the per-layer pieces through `torch.compile` (default mode: no CUDA graphs of
    its own, so the engine's graph capture records its kernels); falls back to eager, with a log
    line, where compilation fails."""

    def __init__(self, model: Any, *, compile: bool = False) -> None:
        self.model = model
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.layers = [self._layer(layer) for layer in model.model.layers]
        self._attention_inputs: Callable[..., Any] = attention_inputs
        self._mlp_block: Callable[..., Any] = mlp_block
        self._mlp_next: Callable[..., Any] = mlp_then_attention_inputs
        self._norm: Callable[..., Any] = rms_norm
        self.is_compiled = False
        if compile:
            self.set_compiled(True)
        self._bound_to = -1  # bound at the first forward, or by `rebind` once storage is final

    def _layer(self, layer: Any) -> _Layer:
        attn = layer.self_attn
        mlp = layer.mlp
        q = attn.q_proj
        k = attn.k_proj
        v = attn.v_proj
        biased = q.bias is not None
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            eps=float(getattr(layer.input_layernorm, "variance_epsilon", 1e-6)),
            qkv=_Fused([q.weight, k.weight, v.weight]),
            qkv_bias=_Fused([q.bias, k.bias, v.bias]) if biased else None,
            o_proj=attn.o_proj,
            gate_up=_Fused([mlp.gate_proj.weight, mlp.up_proj.weight]),
            gate_up_bias=(
                _Fused([mlp.gate_proj.bias, mlp.up_proj.bias])
                if mlp.gate_proj.bias is not None
                else None
            ),
            down_proj=mlp.down_proj,
        )

    @property
    def groups(self) -> list[list[torch.Tensor]]:
        """The parameters each fused weight covers (to be stored back to back)."""
        return [f.members for f in self._fused()]

    def _fused(self) -> list[_Fused]:
        out = []
        for layer in self.layers:
            out += [f for f in (layer.qkv, layer.qkv_bias, layer.gate_up, layer.gate_up_bias) if f]
        return out

    def rebind(self) -> None:
        """Point the fused weights at the parameters' current storage (after it moved)."""
        copied = sum(f.bind() for f in self._fused())
        if copied:
            logger.info(
                "LocalEngine: %d fused weights copied together (storage not adjacent)", copied
            )
        self._bound_to = self.layers[0].qkv.members[0].data_ptr()

    def unbind(self) -> None:
        """Let go of the fused weights (before the parameters' storage is freed or moved)."""
        for fused in self._fused():
            fused.weight = None

    def set_compiled(self, on: bool) -> None:
        if on and not self.is_compiled:
            self._attention_inputs = torch.compile(attention_inputs, fullgraph=True)
            self._mlp_block = torch.compile(mlp_block, fullgraph=True)
            self._mlp_next = torch.compile(mlp_then_attention_inputs, fullgraph=True)
            self._norm = torch.compile(rms_norm, fullgraph=True)
        elif not on:
            self._attention_inputs = attention_inputs
            self._mlp_block = mlp_block
            self._mlp_next = mlp_then_attention_inputs
            self._norm = rms_norm
        self.is_compiled = on

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step: ArenaStep,
        last_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as `attention.forward_over_arena`: logits [B, V] at `last_index`."""
        if self.is_compiled:
            try:
                return self._forward(input_ids, position_ids, step, last_index)
            except torch.OutOfMemoryError:  # not the compiler's fault: no fallback
                raise
            except Exception:  # no compiler, an unsupported op: eager stays correct
                logger.exception("LocalEngine: torch.compile failed; the engine runs eager")
                self.set_compiled(False)
        return self._forward(input_ids, position_ids, step, last_index)

    def _tokens(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Compiled: the token dimension of these inputs is symbolic (one graph for every N > 1,
        not one per CUDA-graph bucket or prefill length)."""
        if self.is_compiled:
            for t in tensors:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return tensors

    @torch.inference_mode()
    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step: ArenaStep,
        last_index: torch.Tensor | None,
    ) -> torch.Tensor:
        first = self.layers[0].qkv
        if first.weight is None or first.members[0].data_ptr() != self._bound_to:
            self.rebind()  # the parameters got new storage (released and resumed)
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)  # [1, N, hidden]
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)  # [1, N, D]
        hidden, cos, sin, index = self._tokens(
            hidden[0], cos[0][:, None], sin[0][:, None], step.write_index
        )
        layers = self.layers
        scale = self.head_dim**-0.5

        def inputs_of(i: int) -> tuple[Any, ...]:  # layer i's attention_inputs after `hidden`
            (keys, head_major), (values, _) = map(stored_layout, (step.keys[i], step.values[i]))
            return (
                *layers[i].attention_args(),
                cos,
                sin,
                self.num_heads,
                self.num_kv_heads,
                keys,
                values,
                index,
                head_major,
            )

        q, k, v = self._attention_inputs(hidden, *inputs_of(0))
        for i, layer in enumerate(layers):
            (attn,) = self._tokens(step.attend_packed(i, q, k, v, scale, written=True))
            if i + 1 < len(layers):
                hidden, q, k, v = self._mlp_next(hidden, attn, layer.mlp_args(), inputs_of(i + 1))
                (hidden,) = self._tokens(hidden)
            else:
                hidden = self._mlp_block(hidden, attn, *layer.mlp_args())
        if last_index is not None:  # the norm is per row: only the rows that sample
            (hidden,) = self._tokens(hidden[last_index])
        hidden = self._norm(hidden, inner.norm.weight, float(inner.norm.variance_epsilon))
        return self.model.lm_head(hidden)
