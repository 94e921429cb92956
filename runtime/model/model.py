"""Decoder-only MoE transformer with Qwen3-MoE module names (checkpoint keys are module paths).

`forward` takes padded batches [B, T] (training, scoring); layers see flat tokens [N, H] and get
attention as a callable; routing [B, T, L, K]. The engine's cached forward over the same
parameters (flat tokens of many sequences against a KV cache, written for small decode steps)
lives in cached_forward.py and depends on this module, not the other way round; tests hold it to
`forward` (1e-5, same routing).

Shape legend: B batch, T time, N flat tokens, H hidden, V vocab, h query heads, g kv heads,
D head dim, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from reel.runtime.model.config import ModelError, MoEConfig
from reel.runtime.model.layers import PRECISIONS, Linear, RMSNorm, apply_rope, linear, rope_cos_sin, unquantised
from reel.runtime.model.moe import DenseMLP, MoE, load_balancing_loss

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q_NhD, k_NgD, v_NgD) -> o_NhD


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # fp32 [B, T, V] | [N, V]
    routing: torch.Tensor | None  # int64 expert ids [B, T, L, K] | [N, L, K]; None unless asked
    aux_loss: torch.Tensor | None  # scalar load-balancing loss (1.0 = balanced); None unless asked


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        h, g, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, h * D)
        self.k_proj = Linear(cfg.hidden_size, g * D)
        self.v_proj = Linear(cfg.hidden_size, g * D)
        self.o_proj = Linear(h * D, cfg.hidden_size)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head_dim = D

    def forward(self, x_NH, cos_ND, sin_ND, attend: Attend, precision: str) -> torch.Tensor:
        N, D = x_NH.shape[0], self.head_dim
        q_NhD = apply_rope(self.q_norm(self.q_proj(x_NH, precision).view(N, -1, D)), cos_ND, sin_ND)
        k_NgD = apply_rope(self.k_norm(self.k_proj(x_NH, precision).view(N, -1, D)), cos_ND, sin_ND)
        v_NgD = self.v_proj(x_NH, precision).view(N, -1, D)
        return self.o_proj(attend(q_NhD, k_NgD, v_NgD).reshape(N, -1), precision)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, sparse: bool):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = (MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                        cfg.norm_topk_prob) if sparse else DenseMLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_NH, cos_ND, sin_ND, attend: Attend, precision: str, replay_ids_NK=None):
        """-> (x [N, H], expert ids [N, K] | None, router scores [N, E] | None)."""
        x_NH = x_NH + self.self_attn(self.input_layernorm(x_NH), cos_ND, sin_ND, attend, precision)
        h_NH = self.post_attention_layernorm(x_NH)
        if isinstance(self.mlp, DenseMLP):
            return x_NH + self.mlp(h_NH, precision), None, None
        out_NH, ids_NK, scores_NE = self.mlp(h_NH, precision, replay_ids_NK)
        return x_NH + out_NH, ids_NK, scores_NE


def _attend_padded(q_NhD, k_NgD, v_NgD, *, B: int, T: int, allowed_B1TT: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.view(B, T, -1, t.shape[-1]).transpose(1, 2) for t in (q_NhD, k_NgD, v_NgD))
    o_BhTD = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_B1TT, enable_gqa=True)
    return o_BhTD.transpose(1, 2).reshape(B * T, -1, q_NhD.shape[-1])


def _attend_causal(q_NhD, k_NgD, v_NgD, *, B: int, T: int) -> torch.Tensor:
    """By position only (is_causal, no mask): what ring attention accepts. kv heads are repeated
    rather than left to enable_gqa, which not every SDPA kernel that ring attention calls takes."""
    q_BhTD, k_BgTD, v_BgTD = (t.view(B, T, -1, t.shape[-1]).transpose(1, 2) for t in (q_NhD, k_NgD, v_NgD))
    groups = q_BhTD.shape[1] // k_BgTD.shape[1]
    k_BhTD, v_BhTD = (t.repeat_interleave(groups, dim=1) for t in (k_BgTD, v_BgTD))
    o_BhTD = F.scaled_dot_product_attention(q_BhTD, k_BhTD, v_BhTD, is_causal=True)
    return o_BhTD.transpose(1, 2).reshape(B * T, -1, q_NhD.shape[-1])


def positions_from_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """Position of each token: real tokens counted from 0 along the row (right padding repeats the last)."""
    return (mask_BT.long().cumsum(-1) - 1).clamp(min=0)


class MoEModel(nn.Module):
    def __init__(self, config: MoEConfig, precision: str = "fp32"):
        super().__init__()
        self.config = config
        self.precision = precision
        moe_layers = set(config.moe_layers)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(config, i in moe_layers)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @property
    def precision(self) -> str:
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in PRECISIONS:
            raise ModelError(f"precision {value!r} is not one of {', '.join(PRECISIONS)}")
        self._precision = value

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF Qwen3-MoE init: matrices ~ N(0, initializer_range), norms 1."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, self.config.initializer_range)

    def _run_layers(self, x_NH, positions_N, attend: Attend, replay_NLK=None):
        cfg, precision = self.config, self.precision
        cos_ND, sin_ND = rope_cos_sin(positions_N, cfg.head_dim, cfg.rope_theta)
        ids, scores = [], []
        for layer in self.model.layers:
            replay_NK = None if replay_NLK is None else replay_NLK[:, len(ids)]
            x_NH, ids_NK, scores_NE = layer(x_NH, cos_ND, sin_ND, attend, precision, replay_NK)
            if ids_NK is not None:
                ids.append(ids_NK)
                scores.append(scores_NE)
        logits_NV = linear(self.model.norm(x_NH), self.lm_head.weight, unquantised(precision))
        return logits_NV, ids, scores

    def check_replay(self, replay: torch.Tensor | None, lead: tuple[int, ...], name: str) -> None:
        """Refuse replayed expert ids whose shape is not (*lead, MoE layers, top-k)."""
        want = (*lead, len(self.config.moe_layers), self.config.num_experts_per_tok)
        if replay is not None and tuple(replay.shape) != want:
            raise ModelError(f"{name} has shape {tuple(replay.shape)}, expected {want} (tokens, MoE layers, top-k)")

    def forward(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, *,
                position_ids_BT: torch.Tensor | None = None, is_causal: bool = False,
                replay_routing_BTLK: torch.Tensor | None = None, return_routing: bool = False,
                aux_loss: bool = False) -> ModelOutput:
        """Right-padded batch (mask 1 = real token); positions count real tokens from 0.

        `position_ids_BT` (default: positions_from_mask) is for a slice of longer rows, whose positions
        its own mask cannot tell. `is_causal` attends by position only, ignoring the mask: in a
        right-padded row a real token's predecessors are all real, so its logits are the same."""
        B, T = input_ids_BT.shape
        self.check_replay(replay_routing_BTLK, (B, T), "replay_routing_BTLK")
        device = input_ids_BT.device
        mask_BT = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask_BT is None \
            else attention_mask_BT.bool()
        positions_BT = positions_from_mask(mask_BT) if position_ids_BT is None else position_ids_BT
        if is_causal:
            attend = partial(_attend_causal, B=B, T=T)
        else:
            causal_TT = torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))
            # Padding rows still see themselves, so no softmax row is empty (no NaN in padded logits).
            allowed_B1TT = ((causal_TT & mask_BT[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device))[:, None]
            attend = partial(_attend_padded, B=B, T=T, allowed_B1TT=allowed_B1TT)
        replay_NLK = None if replay_routing_BTLK is None else replay_routing_BTLK.flatten(0, 1)
        logits_NV, ids, scores = self._run_layers(self.model.embed_tokens(input_ids_BT).flatten(0, 1),
                                                  positions_BT.flatten(), attend, replay_NLK)
        routing = torch.stack(ids, dim=1).view(B, T, len(ids), -1) if return_routing and ids else None
        aux = None
        if aux_loss and ids:
            aux = torch.stack([load_balancing_loss(s, i, mask_BT.flatten()) for s, i in zip(scores, ids)]).mean()
        return ModelOutput(logits_NV.view(B, T, -1), routing, aux)
