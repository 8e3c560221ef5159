"""Next-token sampling for a batch of rows, each with its own temperature, top-k, top-p and seed,
in tensor ops only (no host sync), so the sampler runs inside a captured CUDA graph.

The logprob of a sampled id is that of the distribution it was drawn from: `log_softmax` of
logits / T (T = 1 when greedy) after the row's top-k/top-p filter, renormalised over the tokens
kept; the trainer replays the same filter from the turn's recorded top-k/top-p, so both sides
describe the policy that sampled (the whole softmax when the filter is off). A row samples by the
Gumbel-max trick with noise hashed from (its seed, its output position, the vocabulary id), so a
seeded request draws the same tokens whatever its batch mates are, on any batch layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_LOW_31 = (1 << 31) - 1
_LOW_33 = (1 << 33) - 1
_LOW_37 = (1 << 37) - 1


@dataclass
class SamplingRows:
    """Per-row sampling parameters as tensors, all `[B]` on the logits' device."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_p: torch.Tensor  # float32, 1 = off
    top_k: torch.Tensor  # int64, >= vocab size = off
    seed: torch.Tensor  # int64
    position: torch.Tensor  # int64, tokens the row generated before this one

    @classmethod
    def empty(cls, n: int, device: torch.device | str) -> SamplingRows:
        return cls(
            torch.zeros(n, device=device),
            torch.ones(n, device=device),
            torch.zeros(n, dtype=torch.long, device=device),
            torch.zeros(n, dtype=torch.long, device=device),
            torch.zeros(n, dtype=torch.long, device=device),
        )

    def fill(self, rows: list[tuple[float, float, int, int, int]], num_vocab: int) -> None:
        """Copy (temperature, top_p, top_k, seed, position) per row into rows [0, len(rows))."""
        n = len(rows)
        temperature, top_p, top_k, seed, position = zip(*rows, strict=True)
        top_k = tuple(num_vocab if k < 0 else k for k in top_k)
        self.temperature[:n].copy_(torch.tensor(temperature), non_blocking=True)
        self.top_p[:n].copy_(torch.tensor(top_p), non_blocking=True)
        self.top_k[:n].copy_(torch.tensor(top_k), non_blocking=True)
        self.seed[:n].copy_(torch.tensor(seed), non_blocking=True)
        self.position[:n].copy_(torch.tensor(position), non_blocking=True)

    def narrow(self, n: int) -> SamplingRows:
        return SamplingRows(*(t[:n] for t in vars(self).values()))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (products wrap; shifts masked to act as logical shifts)."""
    x = x ^ ((x >> 31) & _LOW_33)
    x = x * 0x7FB5D329728EA185
    x = x ^ ((x >> 27) & _LOW_37)
    x = x * 0x01A2B3C4D5E6F709
    return x ^ ((x >> 33) & _LOW_31)


def vocab_terms(num_vocab: int, device: torch.device | str) -> torch.Tensor:
    """id * odd constant (wrapping) per vocabulary id, the noise's per-id term. Compiled code gets
    it as an input: inductor folds `arange * constant` into index arithmetic, where the wrap-around
    came out wrong (inductor's CPU backend read out of bounds)."""
    return torch.arange(num_vocab, device=device, dtype=torch.long) * 0x5851F42D4C957F2D


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [B, V], a pure function of (seed, position, vocabulary id);
    `terms` = `vocab_terms(V, device)`."""
    base = _mix(seed * 0x2545F4914F6CDD1D + position)  # [B]
    bits = (_mix(base[:, None] + terms[None, :]) >> 40) & 0xFFFFFF  # [B, V]
    return -torch.log(-torch.log(uniform_from_bits(bits)))


_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """24 random bits -> float32 in (0, 1). The top bucket, (2^24 - 0.5) / 2^24, rounds to 1.0 in
    float32, whose noise is +inf: that vocabulary id then won every draw (~0.3% of steps at a 49k
    vocabulary), a token the top-k/top-p filter had dropped too (-inf + inf is NaN, which argmax
    picks). Clamped below 1, every bucket stays finite."""
    return ((bits.float() + 0.5) / float(1 << 24)).clamp(max=_BELOW_ONE)


def filter_top_k_top_p(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its nucleus, to -inf. `scaled`: [B, V]."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass before it already reaches top_p; the top token always stays.
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def filter_top_k_top_p_radix(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`filter_top_k_top_p` without a sort: each row's k-th largest logit and its nucleus
    threshold found by radix select (four 8-bit passes of a histogram over the vocabulary, no
    [B, V] sort). Keeps the same tokens as the sorted filter except on exact ties (all tokens tied
    at a threshold are kept) and where a nucleus sum differs in its last bit."""
    keys = _order_keys(scaled)
    ones = torch.ones_like(scaled)
    kth = _radix_threshold(keys, ones, top_k.clamp(1, scaled.shape[-1]).to(scaled.dtype))
    scaled = scaled.masked_fill(keys < kth[:, None], float("-inf"))
    nucleus = _radix_threshold(keys, torch.softmax(scaled, dim=-1), top_p)
    drop = (keys < nucleus[:, None]) & (top_p < 1.0)[:, None]
    return scaled.masked_fill(drop, float("-inf"))


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """float32 [B, V] -> int64 keys in [0, 2^32) in the same order (IEEE bits, negatives'
    magnitude bits flipped)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)


def _radix_threshold(
    keys: torch.Tensor, weights: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Per row, the largest key t whose elements at or above it weigh at least `target` (weights
    1: the target-th largest key; probabilities: where the descending mass first reaches it); the
    smallest possible key when no such t exists (nothing to cut). Four passes, 8 bits each."""
    rows = keys.shape[0]
    digits = torch.arange(256, device=keys.device)
    # above[d] = sum of hist[d'] over d' > d, as a product with a triangular matrix: no scan
    # (inductor's split scan over a symbolic batch failed to generate code on CUDA).
    higher = (digits[:, None] > digits[None, :]).to(weights.dtype)
    prefix = torch.zeros(rows, dtype=torch.long, device=keys.device)
    above_bucket = torch.zeros(rows, dtype=weights.dtype, device=keys.device)
    for shift in (24, 16, 8, 0):
        in_bucket = (keys >> (shift + 8)) == (prefix >> (shift + 8))[:, None]
        digit = (keys >> shift) & 255
        hist = torch.zeros(rows, 256, dtype=weights.dtype, device=keys.device)
        hist = hist.scatter_add(1, digit, weights * in_bucket)
        above = hist @ higher  # weight of this bucket's digits > d
        reach = (above_bucket[:, None] + above + hist >= target[:, None]) | (digits == 0)
        d = 255 - reach.flip(1).long().argmax(1)  # the highest digit whose bucket reaches it
        above_bucket = above_bucket + above.gather(1, d[:, None])[:, 0]
        prefix = prefix | (d << shift)
    return prefix


def sample(
    logits: torch.Tensor,
    rows: SamplingRows,
    *,
    use_filter: bool = True,
    use_noise: bool = True,
    terms: torch.Tensor | None = None,
    radix_filter: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. `logits`: [B, V]. Returns (ids [B] int64, logprobs [B] float32).

    `use_filter` / `use_noise` False skip work that no row needs (every top-k/top-p off, every
    row greedy); a captured graph keeps both on, since its rows change between replays. `terms`:
    `vocab_terms(V, device)`, made here when not given (compiled callers pass it).
    `radix_filter`: top-k/top-p by `filter_top_k_top_p_radix` (no sort; compiled, a few fused
    passes over [B, V]) instead of the sorted filter.
    """
    logits = logits.float()
    is_greedy = rows.temperature <= 0.0
    temperature = torch.where(is_greedy, torch.ones_like(rows.temperature), rows.temperature)
    scaled = logits / temperature[:, None]  # [B, V]
    if use_filter:
        filter_rows = filter_top_k_top_p_radix if radix_filter else filter_top_k_top_p
        scaled = filter_rows(scaled, rows.top_k, rows.top_p)
    logprobs = torch.log_softmax(scaled, dim=-1)  # of the truncated distribution
    if use_noise:
        if terms is None:
            terms = vocab_terms(logits.shape[-1], logits.device)
        noise = gumbel_noise(rows.seed, rows.position, terms)
        scaled = scaled + noise.masked_fill(is_greedy[:, None], 0.0)
    ids = torch.argmax(scaled, dim=-1)  # [B]
    return ids, logprobs.gather(1, ids[:, None])[:, 0]
