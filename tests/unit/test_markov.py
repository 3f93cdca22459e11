"""The demo corpus: its entropy rate is exact (checked against counts from samples)."""

from __future__ import annotations

import math

import torch

from trainkit.demo.markov import MarkovChain


def test_stationary_distribution_is_fixed_by_the_chain():
    chain = MarkovChain(8, 0.5, seed=0)
    pi = chain.pair_stationary
    assert math.isclose(float(pi.sum()), 1.0, abs_tol=1e-12)
    torch.testing.assert_close(torch.einsum("ab,abc->bc", pi, chain.transition), pi, rtol=0, atol=1e-12)


def test_entropy_rate_matches_the_empirical_conditional_entropy():
    chain = MarkovChain(6, 0.5, seed=1)
    seqs = chain.sample(4000, 60, seed=2)
    v = chain.vocab_size
    ctx = (seqs[:, :-2] * v + seqs[:, 1:-1]).flatten() * v + seqs[:, 2:].flatten()
    counts = torch.bincount(ctx, minlength=v**3).double().view(v * v, v)
    p = counts / counts.sum(1, keepdim=True).clamp(min=1)
    empirical = float(-(counts * p.clamp_min(1e-300).log()).sum() / counts.sum())
    assert abs(empirical - chain.entropy_rate) < 0.01
    assert chain.entropy_rate < math.log(v) - 0.2  # the chain is far from uniform: there is something to learn


def test_same_seed_same_chain_and_samples():
    a, b = MarkovChain(16, 0.5, seed=5), MarkovChain(16, 0.5, seed=5)
    assert a.entropy_rate == b.entropy_rate
    assert torch.equal(a.sample(3, 10, seed=1), b.sample(3, 10, seed=1))
