"""The tensor sampler: greedy = argmax, Gumbel draws follow the filtered distribution, seeds and
positions decide the noise, logprobs are log_softmax(logits / T) without renormalisation."""

from __future__ import annotations

import torch

from agentrl.engine.local.sampling import (
    SamplingRows,
    filter_top_k_top_p,
    filter_top_k_top_p_radix,
    sample,
    uniform_from_bits,
)


def rows(n: int, temperature: float, top_p: float = 1.0, top_k: int = 10**9, seed: int = 0):
    r = SamplingRows.empty(n, "cpu")
    r.fill([(temperature, top_p, top_k, seed + i, 0) for i in range(n)], num_vocab=10**9)
    return r


def test_greedy_rows_take_the_argmax_with_its_logprob() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    ids, logprobs = sample(logits, rows(4, 0.0))
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4)
    ids, logprobs = sample(logits, rows(4000, 0.7))  # 4000 rows, 4000 different seeds
    expected = torch.softmax(logits[0] / 0.7, -1)
    observed = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(observed, expected, atol=0.03)
    assert torch.allclose(logprobs, expected.log()[ids])


def test_seed_and_position_decide_the_draw() -> None:
    logits = torch.zeros(1, 1000)
    same = [sample(logits, rows(1, 1.0, seed=5))[0].item() for _ in range(3)]
    assert len(set(same)) == 1
    other = sample(logits, rows(1, 1.0, seed=6))[0].item()
    later = SamplingRows.empty(1, "cpu")
    later.fill([(1.0, 1.0, -1, 5, 1)], num_vocab=1000)
    assert len({same[0], other, sample(logits, later)[0].item()}) > 1


def test_top_k_and_top_p_filter_per_row() -> None:
    scaled = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_top_k_top_p(scaled, torch.tensor([2, 4]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True, True, False, False]]
    ids, logprobs = sample(scaled, rows(2, 1.0, top_k=1))
    # top-k 1 is greedy, and the logprob is of the distribution sampled from: one token, log 1
    assert ids.tolist() == [0, 0] and logprobs.tolist() == [0.0, 0.0]
    _, logprobs = sample(scaled, rows(2, 0.0, top_k=2))
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.5, 0.5]) / 0.8))  # renormalised


def test_radix_filter_keeps_the_tokens_the_sorted_filter_keeps() -> None:
    """Per-row top-k (off, 1, up to V and past it) and top-p (off, tiny, any): the radix-select
    filter, with no sort, keeps exactly the sorted filter's tokens on untied logits."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        scaled = torch.randn(16, 3000, generator=g) * (1 + 3 * torch.rand(16, 1, generator=g))
        top_k = torch.randint(1, 3050, (16,), generator=g)
        top_k[::3], top_k[1] = 10**9, 1
        top_p = torch.rand(16, generator=g)
        top_p[::4], top_p[2] = 1.0, 1e-6
        want = torch.isfinite(filter_top_k_top_p(scaled, top_k, top_p))
        got = torch.isfinite(filter_top_k_top_p_radix(scaled, top_k, top_p))
        assert torch.equal(got, want)
    negative = -torch.rand(2, 500, generator=g) - 1.0  # all logits negative: the key order flips
    k, p = torch.tensor([7, 500]), torch.tensor([1.0, 0.3])
    assert torch.equal(
        torch.isfinite(filter_top_k_top_p_radix(negative, k, p)),
        torch.isfinite(filter_top_k_top_p(negative, k, p)),
    )


def test_radix_filtered_sampling_equals_sorted_filtered_sampling() -> None:
    logits = torch.randn(6, 800, generator=torch.Generator().manual_seed(1))
    r = SamplingRows.empty(6, "cpu")
    r.fill([(1.0, 0.9, 20, 7, 3), (0.0, 1.0, -1, 1, 0), (0.7, 0.5, -1, 2, 5),
            (1.3, 1.0, 100, 3, 1), (1.0, 1e-6, -1, 4, 2), (2.0, 0.95, 1, 5, 9)], 800)  # fmt: skip
    want = sample(logits, r)
    got = sample(logits, r, radix_filter=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_every_noise_bucket_is_finite() -> None:
    """The top bucket of 24 bits rounded to 1.0 in float32: its noise was +inf, so that id won the
    draw whatever its probability, even where top-k/top-p had dropped it (found by the sampling-
    mask replay test: a sampled token whose logprob under the filter was -inf)."""
    bits = torch.tensor([0, 1, (1 << 23), (1 << 24) - 2, (1 << 24) - 1])
    uniform = uniform_from_bits(bits)
    assert bool(((uniform > 0) & (uniform < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(uniform))).all())
