"""Token logprobs and entropies from logits split over the vocabulary (Megatron's tensor-parallel
output layer): each rank holds [tokens, vocab / TP] and only per-token scalars cross ranks, so
the full-vocabulary logits never exist on one rank. Gradients are computed locally (softmax
minus one-hot for the logprob, -p (log p + H) for the entropy), as Megatron's vocab-parallel
cross entropy does, so no collective runs in backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce(tensor: Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_ids, vocab_start, vocab_size, group):  # type: ignore[override]
        logits = logits.float()  # [N, V/tp]
        local_vocab = logits.shape[-1]
        num_padded = max(0, vocab_start + local_vocab - vocab_size)
        if num_padded:  # TP padding rows of the output layer: not tokens, never in the softmax
            is_pad = torch.arange(local_vocab, device=logits.device) >= local_vocab - num_padded
            logits = logits.masked_fill(is_pad, -torch.inf)
        row_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)  # [N]
        exp = (logits - row_max[:, None]).exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)  # [N]
        log_z = sum_exp.log() + row_max  # logsumexp over the whole vocabulary
        local_ids = target_ids - vocab_start
        is_here = (local_ids >= 0) & (local_ids < local_vocab)
        picked = logits.gather(-1, local_ids.clamp(0, local_vocab - 1)[:, None])[:, 0]
        target_logit = _all_reduce(torch.where(is_here, picked, torch.zeros_like(picked)), group)
        logprobs = target_logit - log_z
        probs = exp / sum_exp[:, None]  # [N, V/tp]
        expected_logit = _all_reduce((probs * logits.nan_to_num(neginf=0.0)).sum(dim=-1), group)
        entropy = log_z - expected_logit
        ctx.save_for_backward(probs, entropy, local_ids, is_here)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        probs, entropy, local_ids, is_here = ctx.saved_tensors
        grad = torch.zeros_like(probs)
        if grad_logprobs is not None:  # d log p_t / dx_j = [j = t] - p_j
            grad -= probs * grad_logprobs[:, None]
            # Rows whose target is on another rank add 0 (no nonzero(): no device sync).
            picked = torch.where(is_here, grad_logprobs, torch.zeros_like(grad_logprobs))
            grad.scatter_add_(1, local_ids.clamp(0, grad.shape[-1] - 1)[:, None], picked[:, None])
        if grad_entropy is not None:  # dH / dx_j = -p_j (log p_j + H)
            d_entropy = torch.special.xlogy(probs, probs) + probs * entropy[:, None]
            grad -= d_entropy * grad_entropy[:, None]
        return grad, None, None, None, None


def _whole_vocab_stats(logits: Tensor, target_ids: Tensor, temperature: float):
    """log p(target), entropy and log Z over [N, V] logits, in float32."""
    x = logits.float() / temperature
    log_z = torch.logsumexp(x, dim=-1)
    target = x.gather(-1, target_ids[:, None])[:, 0]
    probs = (x - log_z[:, None]).exp()
    entropy = log_z - (probs * x).sum(dim=-1)
    return target - log_z, entropy, log_z


def _whole_vocab_grad(
    logits: Tensor,
    target_ids: Tensor,
    log_z: Tensor,
    entropy: Tensor,
    grad_logprobs: Tensor,
    grad_entropy: Tensor,
    temperature: float,
) -> Tensor:
    """d/d logits of sum(g_lp * log p_t + g_ent * H), from the logits again (not a saved
    [N, V] softmax): ([j = t] - p_j) g_lp - p_j (log p_j + H) g_ent, over T, in logits' dtype."""
    log_p = logits.float() / temperature - log_z[:, None]
    probs = log_p.exp()
    is_target = torch.arange(logits.shape[-1], device=logits.device) == target_ids[:, None]
    grad = (is_target.float() - probs) * grad_logprobs[:, None]
    grad = grad - probs * (log_p + entropy[:, None]) * grad_entropy[:, None]
    return (grad / temperature).to(logits.dtype)


# On CUDA each way is a couple of compiled kernels that read the [N, V] logits in their own
# dtype, where eager torch makes about ten float32 passes (and keeps a float32 softmax for
# backward). A new token count makes the token dimension dynamic: a recompilation or two (dynamo
# specialises counts 0 and 1 apart).
_whole_vocab_stats_fused = torch.compile(_whole_vocab_stats)
_whole_vocab_grad_fused = torch.compile(_whole_vocab_grad)


class _WholeVocabLogprobs(torch.autograd.Function):
    """The vocabulary on one rank (TP = 1): keeps the logits, not a softmax, for backward."""

    @staticmethod
    def forward(ctx, logits, target_ids, temperature):  # type: ignore[override]
        stats = _whole_vocab_stats_fused if logits.is_cuda else _whole_vocab_stats
        logprobs, entropy, log_z = stats(logits, target_ids, temperature)
        ctx.save_for_backward(logits, target_ids, log_z, entropy)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        logits, target_ids, log_z, entropy = ctx.saved_tensors  # gradients arrive as zeros
        grad = _whole_vocab_grad_fused if logits.is_cuda else _whole_vocab_grad
        return (
            grad(logits, target_ids, log_z, entropy, grad_logprobs, grad_entropy, ctx.temperature),
            None,
            None,
        )


def vocab_parallel_logprobs(
    logits: Tensor,
    target_ids: Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """log_softmax(logits / T)[target] and the entropy, [N] each, float32, from this rank's
    columns `vocab_start : vocab_start + logits.shape[-1]` of the [N, vocab] logits. Columns at
    or past `vocab_size` (padding) are left out of the softmax. Collective over `group` (None =
    the whole vocabulary is here)."""
    is_whole = group is None or dist.get_world_size(group) == 1
    if is_whole and vocab_start == 0:
        real = vocab_size if vocab_size is not None else logits.shape[-1]
        return _WholeVocabLogprobs.apply(logits[:, :real], target_ids, float(temperature))
    if temperature != 1.0:
        logits = logits.float() / temperature
    total = vocab_size if vocab_size is not None else vocab_start + logits.shape[-1]
    return _VocabParallelLogprobs.apply(logits, target_ids, vocab_start, total, group)
