"""Building blocks: precision-dispatched (grouped) matmuls, RMSNorm, RoPE.

Precision modes change how matmuls compute, never the fp32 master parameters:
  fp32  plain fp32
  bf16  inputs and weights cast to bf16, output back to fp32
  fp8   block-scaled e4m3 (fp8.py) for the linear layers; layers kept out of fp8 (router,
        lm_head) pass "bf16" instead (see `unquantised`)
The residual stream, norms, softmaxes and attention stay fp32 in every mode.

Shape legend: N tokens (flat), A token-expert assignments (N * top_k, sorted by expert),
E experts, H hidden, I expert width, O output features, h query heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reel.runtime.model.fp8 import fake_quant_blocks, fake_quant_tokens, fp8_linear

PRECISIONS = ("fp32", "bf16", "fp8")


def unquantised(precision: str) -> str:
    """Precision for layers DeepSeek-V3 keeps out of fp8 (router, lm_head)."""
    return "fp32" if precision == "fp32" else "bf16"


def linear(x: torch.Tensor, w_OH: torch.Tensor, precision: str) -> torch.Tensor:
    if precision == "fp8":
        return fp8_linear(x, w_OH)
    if precision == "bf16":
        return F.linear(x.bfloat16(), w_OH.bfloat16()).float()
    return F.linear(x, w_OH)


def grouped_linear(x_AH: torch.Tensor, w_EOH: torch.Tensor, offs_E: torch.Tensor, precision: str) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x go through expert e's w: one grouped GEMM, no python loop."""
    if precision == "fp8":  # per-token quantisation is row-wise, so it commutes with the grouping
        x_AH, w_EOH = fake_quant_tokens(x_AH), fake_quant_blocks(w_EOH)
    elif precision == "bf16":
        x_AH, w_EOH = x_AH.bfloat16(), w_EOH.bfloat16()
    if x_AH.is_cuda and x_AH.dtype == torch.float32:  # CUDA grouped GEMM is bf16-only
        starts = [0, *offs_E[:-1].tolist()]
        return torch.cat([x_AH[a:b] @ w_EOH[e].T for e, (a, b) in enumerate(zip(starts, offs_E.tolist()))])
    return torch._grouped_mm(x_AH, w_EOH.transpose(-2, -1), offs=offs_E).float()


class Linear(nn.Module):
    """Bias-free linear layer whose weight is named like nn.Linear's (checkpoint key `.weight`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, precision: str) -> torch.Tensor:
        return linear(x, self.weight, precision)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_cos_sin(positions_N: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] for the rotate-half convention of HF Llama/Qwen."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions_N.device)
    inv_freq = 1.0 / (theta ** (dims / head_dim))
    freqs_ND = positions_N[:, None].float() * inv_freq
    emb_ND = torch.cat((freqs_ND, freqs_ND), dim=-1)
    return emb_ND.cos(), emb_ND.sin()


def apply_rope(x_NhD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_NhD.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_NhD * cos_ND[:, None] + rotated * sin_ND[:, None]
