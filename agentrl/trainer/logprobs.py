"""Token logprobs and entropies from final hidden states, a chunk of tokens at a time, so the
[tokens, vocab] logits never exist whole (not in the forward pass, not saved for backward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from agentrl.trainer.packing import PACKED_ATTENTION, packed_attention_kwargs
from agentrl.trainer.sampling_mask import truncate_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target_ids: Tensor,
    temperature: float,
    is_entropy_trained: bool,
    matmul_dtype: torch.dtype | None,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """[C, H] -> logprob of target [C] and entropy [C] of softmax(logits / T), in float32; the
    vocab projection runs in `matmul_dtype` (None = the weight's), as the engine's LM head does.
    With `top_k` / `top_p` ([C] each), of the distribution their filter leaves (replay)."""
    dtype = matmul_dtype or weight.dtype
    logits = F.linear(
        hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    ).float()
    if temperature != 1.0:
        logits = logits / temperature  # [C, V]
    if top_k is not None and top_p is not None:
        logits = truncate_logits(logits, target_ids, top_k, top_p)  # dropped tokens at -inf
    # Only log_softmax's output is kept for backward; the logits themselves can be freed.
    all_logprobs = torch.log_softmax(logits, dim=-1)  # [C, V]
    logprobs = all_logprobs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(is_entropy_trained and torch.is_grad_enabled()):
        finite = all_logprobs.clamp_min(torch.finfo(all_logprobs.dtype).min)  # 0 * -inf: 0
        entropy = -(finite.exp() * finite).sum(-1)
    return logprobs, entropy


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    is_entropy_trained: bool = True,
    matmul_dtype: torch.dtype | None = None,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """log_softmax(hidden @ weight.T / T)[target] and the entropy, for hidden [M, H] -> [M], [M],
    the softmax in float32 over logits from a `matmul_dtype` projection (None = weight's dtype).

    With gradients on, each chunk is recomputed in backward (activation checkpointing), so only
    one chunk of logits is alive at any time; the engine's logprobs use the same definition.
    With `is_entropy_trained` False the entropy carries no gradient (cheaper; a metric only).
    `top_k` / `top_p` ([M] each, the turn's sampling of each target): sampling-mask replay."""
    logprob_parts = []
    entropy_parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]
        chunk = slice(start, start + chunk_size)
        args = (
            h,
            weight,
            bias,
            target_ids[chunk],
            temperature,
            is_entropy_trained,
            matmul_dtype,
            None if top_k is None else top_k[chunk],
            None if top_p is None else top_p[chunk],
        )
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logprob_parts.append(lp)
        entropy_parts.append(ent)
    if not logprob_parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprob_parts), torch.cat(entropy_parts)


class CausalLMLogprobs(torch.nn.Module):
    """A causal LM whose forward returns token logprobs and entropies, [R, T] each, instead of
    logits. FSDP2 shards it as the root module, so the embedding, final norm and (tied) output
    head are gathered for the whole forward, vocab projection included, and their gradients
    reduced after backward."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        chunk_size: int,
        temperature: float,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        """bf16 on CUDA with fp32 weights; None = no autocast."""

    def forward(
        self,
        input_ids: Tensor,  # [R, T]
        position_ids: Tensor,  # [R, T], restarting at 0 for every packed sequence
        target_ids: Tensor,  # [R, T]
        loss_mask: Tensor,  # [R, T]
        is_entropy_trained: bool = False,
        top_k: Tensor | None = None,  # [R, T] long, the turn's top-k per target (-1: off)
        top_p: Tensor | None = None,  # [R, T] float, its top-p (1: off)
    ) -> tuple[Tensor, Tensor]:
        """Logprob of each target and the entropy, 0 off the loss mask; with top_k / top_p, under
        the truncated distribution the turn was sampled from (sampling-mask replay)."""
        device_type = input_ids.device.type
        with torch.autocast(
            device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            # No attention mask: transformers reads packed-sequence boundaries from position_ids,
            # or packed attention takes them precomputed.
            is_packed_attention = self.model.config._attn_implementation == PACKED_ATTENTION
            bounds = packed_attention_kwargs(position_ids) if is_packed_attention else {}
            out = self.model.base_model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **bounds
            )
        hidden = out.last_hidden_state  # [R, T, H]
        is_loss = loss_mask > 0  # [R, T]
        is_empty = not bool(is_loss.any())
        if is_empty:
            # One position goes through the head anyway, times 0 below: every parameter then gets
            # a (zero) gradient, as the other ranks' FSDP reduce-scatters expect.
            is_loss = torch.zeros_like(is_loss)
            is_loss[0, 0] = True
        head = self.model.get_output_embeddings()
        assert head is not None  # the lm_head of the AutoModelForCausalLM the backend loads
        logprobs, entropy = chunked_logprobs(
            hidden[is_loss],  # [M, H]: only trained positions reach the vocab projection
            head.weight,
            target_ids[is_loss],
            bias=getattr(head, "bias", None),
            chunk_size=self.chunk_size,
            temperature=self.temperature,
            is_entropy_trained=is_entropy_trained,
            matmul_dtype=self.autocast_dtype,
            top_k=None if top_k is None else top_k[is_loss],
            top_p=None if top_p is None else top_p[is_loss],
        )
        if is_empty:
            logprobs, entropy = logprobs * 0.0, entropy * 0.0
        zeros = torch.zeros(is_loss.shape, dtype=torch.float32, device=hidden.device)
        return zeros.index_put((is_loss,), logprobs), zeros.index_put((is_loss,), entropy)
