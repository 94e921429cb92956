"""Block-scaled FP8: saturating casts, scale shapes, GEMM accuracy (DeepGEMM's metric), straight-through grads."""

from __future__ import annotations

import pytest
import torch

from reel.runtime.model import fp8
from reel.runtime.model.fp8 import (
    cast_to_e4m3,
    dequant_blocks,
    dequant_tokens,
    fake_quant_blocks,
    fp8_linear,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
)

torch.set_num_threads(2)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's test metric: 1 - cosine-like similarity, 0 for identical tensors."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def test_cast_saturates():
    edge = torch.tensor([448.0, 460.0, 470.0, -470.0, 0.0, 1e6])
    got = cast_to_e4m3(edge).float()
    assert torch.equal(got, torch.tensor([448.0, 448.0, 448.0, -448.0, 0.0, 448.0]))


def test_edge_values_and_zero_blocks_never_give_nan():
    x = torch.zeros(3, 256)
    x[0, :5] = torch.tensor([448.0, 460.0, 470.0, -470.0, 0.0])
    x[1, 128:] = 1e-9  # a tiny tile: amax clamps to 1e-4
    q, s = per_token_cast_to_fp8(x)  # row 2 and tile (0, 1) are all zeros
    assert not torch.isnan(q.float()).any() and torch.isfinite(s).all()
    assert s[2, 0] == pytest.approx(1e-4 / 448) and s[0, 0] == pytest.approx(470.0 / 448)
    back = dequant_tokens(q, s)
    assert torch.equal(back[2], torch.zeros(256)) and back[0, 2] == pytest.approx(470.0, rel=1e-6)
    wq, ws = per_block_cast_to_fp8(x)
    assert not torch.isnan(wq.float()).any() and torch.isfinite(dequant_blocks(wq, ws)).all()


@pytest.mark.parametrize("shape", [(4, 256), (3, 300), (130, 1), (260, 129)])
def test_scale_shapes_follow_128_blocks(shape):
    M, K = shape
    x = torch.randn(M, K)
    q, s = per_token_cast_to_fp8(x)
    assert q.shape == (M, K) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (M, -(-K // 128)) and s.dtype == torch.float32
    wq, ws = per_block_cast_to_fp8(x)
    assert wq.shape == (M, K) and ws.shape == (-(-M // 128), -(-K // 128))
    assert calc_diff(dequant_blocks(wq, ws), x) < 1e-3 and calc_diff(dequant_tokens(q, s), x) < 1e-3


def test_scale_is_amax_over_448_per_tile_and_block():
    x = torch.randn(256, 384)
    _, s = per_token_cast_to_fp8(x)
    torch.testing.assert_close(s, x.abs().view(256, 3, 128).amax(-1) / 448)
    _, ws = per_block_cast_to_fp8(x)
    torch.testing.assert_close(ws, x.abs().view(2, 128, 3, 128).amax((1, 3)) / 448)


def test_blockwise_gemm_matches_fp32_on_gaussian_k4096():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g)
    w = torch.randn(256, 4096, generator=g)
    assert calc_diff(fp8_linear(x, w), x @ w.T) < 1e-3


def test_odd_dims_are_padded():
    x, w = torch.randn(5, 200), torch.randn(70, 200)
    y = fp8_linear(x.view(5, 1, 200), w)
    assert y.shape == (5, 1, 70) and calc_diff(y.view(5, 70), x @ w.T) < 1e-3


def test_batched_block_quantisation_equals_per_matrix():
    w_ENK = torch.randn(3, 200, 150)
    q, s = per_block_cast_to_fp8(w_ENK)
    assert s.shape == (3, 2, 2)
    for e in range(3):
        qe, se = per_block_cast_to_fp8(w_ENK[e])
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)


def test_backward_is_straight_through():
    x = torch.randn(6, 256, requires_grad=True)
    w = torch.randn(40, 256, requires_grad=True)
    g = torch.randn(6, 40)
    (fp8_linear(x, w) * g).sum().backward()
    x_q, w_q = dequant_tokens(*per_token_cast_to_fp8(x.detach())), fake_quant_blocks(w.detach())
    torch.testing.assert_close(x.grad, g @ w_q)
    torch.testing.assert_close(w.grad, g.T @ x_q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fp8.deep_gemm is None, reason="needs CUDA and deep_gemm")
def test_deep_gemm_matches_cpu_reference():
    x, w = torch.randn(128, 4096), torch.randn(512, 4096)
    cpu = fp8_linear(x, w)
    gpu = fp8_linear(x.cuda(), w.cuda()).cpu()
    assert calc_diff(gpu, cpu) < 1e-4 and calc_diff(gpu, x @ w.T) < 1e-3
