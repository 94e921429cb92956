"""The engine's sampling: the C kernel and the torch ops compute the same draw; seeded streams."""

from __future__ import annotations

import pytest
import torch

from reel.producers import sampling
from reel.producers.sampling import Uniforms, sample_tokens
from reel.runtime import cbuild


def _rows(B: int = 96, V: int = 49, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.arange(B) % 4]
    top_p = torch.tensor([1.0, 0.9, 0.5])[torch.arange(B) % 3]
    return logits, temperature, top_p, torch.rand(B, generator=gen)


def test_the_c_kernel_draws_what_the_torch_ops_draw() -> None:
    assert cbuild.load(sampling._SOURCE) is not None, "sampling.c did not build (see the log)"
    for seed in range(5):
        logits, temperature, top_p, u = _rows(seed=seed)
        want_tokens, want_logp = sample_tokens(logits, temperature, top_p, u)
        tokens, logp = sampling._sample_c(logits, temperature, top_p, u)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("draw", ["C", "torch"])
def test_greedy_rows_ignore_their_uniform_and_sampled_rows_stay_in_the_nucleus(draw: str) -> None:
    logits, temperature, top_p, u = _rows()
    run = sampling._sample_c if draw == "C" else sample_tokens
    tokens, logp = run(logits, temperature, top_p, u)
    again, _ = run(logits, temperature, top_p, torch.rand(len(u)))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1)) and torch.equal(again[greedy], tokens[greedy])
    torch.testing.assert_close(logp[greedy], torch.log_softmax(logits[greedy], -1).max(-1).values)
    for b in torch.nonzero(~greedy)[:, 0].tolist():
        p = torch.softmax(logits[b] / temperature[b], -1)
        ranked = p.sort(descending=True)
        nucleus = ranked.indices[(ranked.values.cumsum(0) - ranked.values) < top_p[b]]
        assert int(tokens[b]) in nucleus.tolist()
        torch.testing.assert_close(logp[b], (p[tokens[b]] / p[nucleus].sum()).log(), atol=1e-5, rtol=0)
    # a uniform just below 1 draws the last token with mass, never one cut from the nucleus
    edge, edge_logp = run(logits, temperature, top_p, torch.full((len(u),), 1 - 2 ** -24))
    assert torch.isfinite(edge_logp).all()


def test_uniforms_follow_the_generator_stream_whatever_the_burst_lengths() -> None:
    stream = torch.rand(200, generator=torch.Generator().manual_seed(9))
    u = Uniforms(9, torch.device("cpu"))
    used = []
    for burst in (3, 70, 1, 64, 5):
        used.append(u.peek(burst).clone())
        u.consume(burst)
    assert torch.equal(torch.cat(used), stream[:143])
