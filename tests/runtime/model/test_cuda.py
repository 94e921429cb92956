"""CUDA against the CPU: the built-in engine and the shared fp8 numerics give the same answers.

Deselected where no GPU is visible (conftest). What this pins down: the engine's claim "any torch
device" (continuous batching, KV slots, per-request generators, routing capture all on CUDA), and
that the block-scaled fp8 casts the trainer runs on the CPU produce the same bits on a GPU, where
torch's plain e4m3 cast does not saturate.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import SamplingParams
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.fp8 import fp8_linear, per_block_cast_to_fp8, per_token_cast_to_fp8
from reel.runtime.model.model import MoEModel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model() -> MoEModel:
    torch.manual_seed(0)
    # init 0.1, as in test_engine: logits and router scores far from ties, so greedy paths agree
    return MoEModel(MoEConfig(vocab_size=49, initializer_range=0.1)).eval()


async def _greedy(model: MoEModel, prompts: list[list[int]], max_tokens: int):
    async with BuiltinEngine(model, max_batch=3, max_seq_len=64) as engine:  # 3 slots, 5 requests
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return [c for (c,) in await asyncio.gather(*(engine.generate(p, params) for p in prompts))]


async def test_engine_on_cuda_matches_the_cpu_engine(model: MoEModel) -> None:
    prompts = [[1, 5, 9], [1, 20, 21, 22, 23, 24, 25], [3], [1, 30, 31, 32], [1, 40, 41]]
    cpu = await _greedy(model, prompts, 20)
    gpu = await _greedy(copy.deepcopy(model).cuda(), prompts, 20)
    for c, g in zip(cpu, gpu):
        assert g.tokens == c.tokens and g.spans == c.spans == [(0, 0)]
        np.testing.assert_allclose(g.logprobs, c.logprobs, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(g.routing, c.routing)


async def test_seeded_sampling_on_cuda_is_reproducible(model: MoEModel) -> None:
    gpu_model = copy.deepcopy(model).cuda()
    runs = []
    for _ in range(2):
        async with BuiltinEngine(gpu_model, max_batch=4, max_seq_len=64) as engine:
            runs.append(await engine.generate([1, 2, 3], SamplingParams(n=4, max_tokens=16, seed=7)))
    assert [s.tokens for s in runs[0]] == [s.tokens for s in runs[1]]
    assert len({tuple(s.tokens) for s in runs[0]}) > 1  # the seeds differ per sample


def test_fp8_casts_give_the_same_bits_on_cuda_and_cpu() -> None:
    x = torch.randn(512, 1024) * 300  # past +-464 after scaling would be NaN without the clamp
    x[0, :3] = torch.tensor([1e6, -1e6, 0.0])
    w = torch.randn(4, 512, 1000)
    for cast, value in ((per_token_cast_to_fp8, x), (per_block_cast_to_fp8, w)):
        q_cpu, s_cpu = cast(value)
        q_gpu, s_gpu = cast(value.cuda())
        assert not torch.isnan(q_gpu.float()).any()
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
        assert torch.equal(s_gpu.cpu(), s_cpu)


def test_fp8_linear_on_cuda_matches_the_cpu_reference() -> None:
    x, w = torch.randn(128, 512), torch.randn(256, 512)
    cpu = fp8_linear(x, w)
    gpu = fp8_linear(x.cuda(), w.cuda()).cpu()
    # DeepGEMM (if importable) accumulates in its own order; the reference path differs by rounding only
    assert torch.allclose(gpu, cpu, rtol=1e-3, atol=1e-2)
