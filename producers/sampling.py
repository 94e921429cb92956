"""Sampling for the built-in engine: one token and its log mu per row, from the row's own stream.

Row b is greedy when its temperature is 0 (logprob = log softmax of the raw logits). Otherwise
mu = softmax(logits / temperature) restricted to the smallest top-p nucleus (tokens by descending
probability until their mass reaches top_p) and renormalised; the token is drawn by inverse CDF
from one uniform of the row's own seeded stream (`Uniforms`), so a draw depends only on its row.

`Sampler` serves the steps of one engine burst: in fp32 on the CPU each step is one C call
(sampling.c, built by runtime/cbuild.py), elsewhere `sample_tokens`' torch ops; both compute the
same function up to float rounding (tests hold both to the model's own logprobs).
"""

from __future__ import annotations

import ctypes

import torch

from reel.producers.engine import SamplingParams
from reel.runtime import cbuild
from reel.runtime.package_files import package_file

__all__ = ["Sampler", "Uniforms", "sample_tokens"]

_SOURCE = package_file(__package__, "sampling.c")


class Uniforms:
    """A sequence's seeded stream of uniforms, drawn ahead in blocks of a fixed size (one generator
    call per block, not one per token) and kept until used: the sequence consumes its generator's
    stream in order and in the same blocks whatever its engine bursts were, so a sample does not
    depend on its batch, on any device."""

    BLOCK = 64

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device).manual_seed(seed)
        self.unused = torch.empty(0, device=device)

    def peek(self, n: int) -> torch.Tensor:
        """The next n uniforms, without using them up."""
        if len(self.unused) < n:
            blocks = -(-(n - len(self.unused)) // self.BLOCK)
            fresh = torch.rand(blocks * self.BLOCK, device=self.unused.device, generator=self.generator)
            self.unused = torch.cat([self.unused, fresh])
        return self.unused[:n]

    def consume(self, n: int) -> None:
        self.unused = self.unused[n:]


class Sampler:
    """Samples the fixed rows of one engine burst, step after step, and says whether a row drew one
    of its stop tokens. `draws`: the most steps the burst can take; `settle()` once it is over."""

    def __init__(self, params: list[SamplingParams], uniforms: list[Uniforms], vocab: int,
                 device: torch.device, draws: int):
        temperature = [p.temperature for p in params]
        self.uniforms = uniforms
        self.sampled = [b for b, t in enumerate(temperature) if t]  # rows that draw (not greedy)
        self.greedy = not self.sampled
        self.native = device.type == "cpu" and cbuild.enabled() and cbuild.load(_SOURCE) is not None
        self.temperature_B = torch.tensor(temperature, device=device, dtype=torch.float32)
        self.top_p_B = torch.tensor([p.top_p if t else 1.0 for p, t in zip(params, temperature)], device=device)
        self.nucleus = any(p.top_p < 1 for p, t in zip(params, temperature) if t)
        # [draws, B]: step t's uniforms are one contiguous row; greedy rows draw none (zeros)
        self.u_DB = torch.zeros(draws, len(params), device=device)
        for b in self.sampled:
            self.u_DB[:, b] = uniforms[b].peek(draws)
        self.step = 0
        self.stop_BV: torch.Tensor | None = None
        if any(p.stop_token_ids for p in params):
            self.stop_BV = torch.zeros(len(params), vocab, dtype=torch.bool, device=device)
            for b, p in enumerate(params):
                self.stop_BV[b, [t for t in p.stop_token_ids if 0 <= t < vocab]] = True

    def __call__(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        logits_BV = logits_BV.float()
        u_B = self.u_DB[self.step]
        if self.native:
            tokens_B, logprobs_B = _sample_c(logits_BV, self.temperature_B, self.top_p_B, u_B)
        elif self.greedy:  # sample_tokens for all-greedy rows, in fewer ops
            top_B, tokens_B = logits_BV.max(-1)
            logprobs_B = top_B - logits_BV.logsumexp(-1)
        else:
            tokens_B, logprobs_B = sample_tokens(logits_BV, self.temperature_B, self.top_p_B, u_B,
                                                 nucleus=self.nucleus)
        self.step += 1
        stopped = self.stop_BV is not None and bool(self.stop_BV.gather(1, tokens_B[:, None]).any())
        return tokens_B, logprobs_B, stopped

    def settle(self) -> None:
        """The burst is over: its steps used one uniform of each sampled row."""
        for b in self.sampled:
            self.uniforms[b].consume(self.step)


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor, u_B: torch.Tensor,
                  *, nucleus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_B, logprobs_B) as the module says; u_B is ignored for greedy rows. nucleus=False
    promises that no sampled row has top_p < 1 (skips the sort)."""
    greedy_B = temperature_B == 0
    logp_BV = torch.log_softmax(logits_BV / torch.where(greedy_B, 1.0, temperature_B)[:, None], dim=-1)
    if nucleus:
        sorted_BV, order_BV = logp_BV.sort(dim=-1, descending=True, stable=True)
        p_BV = sorted_BV.exp()
        top_p_B = torch.where(greedy_B, 1.0, top_p_B)
        outside_BV = (p_BV.cumsum(-1) - p_BV) >= top_p_B[:, None]  # mass before the token already >= top_p
        sorted_BV = sorted_BV.masked_fill(outside_BV, float("-inf"))
        logp_BV = torch.empty_like(logp_BV).scatter_(-1, order_BV, sorted_BV)
        logp_BV = logp_BV - logp_BV.logsumexp(-1, keepdim=True)
    cdf_BV = logp_BV.exp().cumsum(-1)
    drawn_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    tokens_B = torch.where(greedy_B, logits_BV.argmax(-1), drawn_B.clamp_(max=logits_BV.shape[-1] - 1))
    return tokens_B, logp_BV.gather(-1, tokens_B[:, None])[:, 0]


def _sample_c(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
              u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, V = logits_BV.shape
    logits_BV = logits_BV.contiguous()
    tokens_B, logprobs_B = torch.empty(B, dtype=torch.int64), torch.empty(B)
    scratch_V, ranked_V2 = torch.empty(V), torch.empty(V, 2, dtype=torch.int64)  # sampling.c's Ranked: 16 bytes
    f32, i64 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)
    cbuild.load(_SOURCE).reel_sample(
        ctypes.c_int64(B), ctypes.c_int64(V),
        *(ctypes.cast(t.data_ptr(), f32) for t in (logits_BV, temperature_B, top_p_B, u_B.contiguous())),
        ctypes.cast(tokens_B.data_ptr(), i64), ctypes.cast(logprobs_B.data_ptr(), f32),
        ctypes.cast(scratch_V.data_ptr(), f32), ctypes.cast(ranked_V2.data_ptr(), i64))
    return tokens_B, logprobs_B
