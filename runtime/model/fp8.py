"""Block-scaled FP8 (DeepSeek-V3 recipe): e4m3 values with fp32 scales per 128-wide block.

Activations get one scale per 1x128 tile of a row (token), weights one per 128x128 block.
scale = clamp(amax, 1e-4) / 448; values are clamped to +-448 before the cast because a plain
cast to e4m3 is not guaranteed to saturate (on some torch versions and devices values past
+-464 become NaN; torch 2.13 on CPU happens to saturate). Dims that are not multiples of 128
are zero-padded for the amax and cropped again, so scales have ceil(dim / 128) entries.

`fp8_linear` is the GEMM every fp8-mode linear layer uses. On CUDA with `deep_gemm` importable
it calls `deep_gemm.fp8_gemm_nt`; elsewhere the reference below. The reference dequantises the
e4m3 values (exact in fp32) and multiplies in fp32: because a scale is constant over each
128-wide K block, this equals DeepGEMM's per-block fp32 promotion up to fp32 rounding. The
backward is straight-through: each operand's gradient uses the other operand's quantised value.

Shape legend: M rows (tokens), N output features, K input features, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3_MAX = 448.0
AMAX_MIN = 1e-4

try:  # Hopper kernel library; built from source, never a PyPI dependency
    import deep_gemm
except ImportError:  # pragma: no cover - depends on the machine
    deep_gemm = None


def _ceil(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast: clamp to +-448 first, whatever the backend's cast does past +-464."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """clamp(amax, 1e-4) / 448, correctly rounded on every device. Dividing a CUDA tensor by a
    Python number multiplies by its reciprocal (1 ulp off, seen on an H200); by a tensor, it divides."""
    return amax.clamp(min=AMAX_MIN) / amax.new_tensor(E4M3_MAX)


def per_token_cast_to_fp8(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 [..., K], fp32 scales [..., ceil(K/128)]); one scale per 1x128 tile."""
    K = x_MK.shape[-1]
    x = F.pad(x_MK.float(), (0, _ceil(K) - K))
    x_tiles = x.unflatten(-1, (-1, BLOCK))
    scale = _scale(x_tiles.abs().amax(dim=-1))
    q = cast_to_e4m3(x_tiles / scale.unsqueeze(-1)).flatten(-2)
    return q[..., :K].contiguous(), scale


def per_block_cast_to_fp8(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 [..., N, K], fp32 scales [..., ceil(N/128), ceil(K/128)]); one per 128x128 block."""
    N, K = w_NK.shape[-2:]
    w = F.pad(w_NK.float(), (0, _ceil(K) - K, 0, _ceil(N) - N))
    w_blocks = w.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [..., N/128, 128, K/128, 128]
    scale = _scale(w_blocks.abs().amax(dim=(-3, -1)))
    q = cast_to_e4m3(w_blocks / scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)
    return q[..., :N, :K].contiguous(), scale


def dequant_tokens(q_MK: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    K = q_MK.shape[-1]
    return q_MK.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :K]


def dequant_blocks(q_NK: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, K = q_NK.shape[-2:]
    s = scale.repeat_interleave(BLOCK, dim=-1).repeat_interleave(BLOCK, dim=-2)
    return q_NK.float() * s[..., :N, :K]


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """Per-token fp8 round trip with a straight-through gradient (for grouped expert GEMMs)."""
    return x + (dequant_tokens(*per_token_cast_to_fp8(x.detach())) - x).detach()


def fake_quant_blocks(w: torch.Tensor) -> torch.Tensor:
    """Per-128x128-block fp8 round trip with a straight-through gradient."""
    return w + (dequant_blocks(*per_block_cast_to_fp8(w.detach())) - w).detach()


def _deep_gemm(xq, xs, wq, ws) -> torch.Tensor:  # pragma: no cover - needs a Hopper GPU
    M, K = xq.shape
    N = wq.shape[0]
    # The kernel wants K and N in whole 128-blocks; zero padding adds nothing to the products.
    xq = F.pad(xq.view(torch.uint8), (0, _ceil(K) - K)).view(torch.float8_e4m3fn)
    wq = F.pad(wq.view(torch.uint8), (0, _ceil(K) - K, 0, _ceil(N) - N)).view(torch.float8_e4m3fn)
    out = torch.empty(M, _ceil(N), dtype=torch.bfloat16, device=xq.device)
    # fp32 scales as computed (SM90 recipe), not rounded to powers of two
    deep_gemm.fp8_gemm_nt((xq, xs), (wq, ws), out, disable_ue8m0_cast=True)
    return out[:, :N].float()


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        xq, xs = per_token_cast_to_fp8(x_MK)
        wq, ws = per_block_cast_to_fp8(w_NK)
        ctx.save_for_backward(xq, xs, wq, ws)
        if deep_gemm is not None and x_MK.is_cuda:
            return _deep_gemm(xq, xs, wq, ws)
        return dequant_tokens(xq, xs) @ dequant_blocks(wq, ws).T

    @staticmethod
    def backward(ctx, g_MN: torch.Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        g = g_MN.float()
        return g @ dequant_blocks(wq, ws), g.T @ dequant_tokens(xq, xs)


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T with block-scaled e4m3 operands; x [..., K] -> fp32 [..., N]."""
    y_MN = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), w_NK)
    return y_MN.view(*x.shape[:-1], w_NK.shape[0])
