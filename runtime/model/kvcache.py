"""What the engine's cached forward (cached_forward.py) runs over: the KV cache and the model's
weights prepared for it. Both depend on the model; the model depends on neither.

- The cache stores keys transposed per kv head ([S, g, D, P]) and values [S, g, P, D], so attention
  is two batched matmuls over (slot, kv head) rows with no per-token copies.
- Weights are prepared once per parameter version and precision and reused until a parameter
  changes in place or anew. Matrices keep the parameters' [out, in] layout (x @ w.T): in fp32 they
  are the parameters themselves, so the engine holds one copy of its weights and a weight swap
  writes each weight once, into the parameters; bf16 casts them, fp8 round-trips them per block.
  Only small vectors are derived (norm weights scaled as cached_forward._rms_norm reads them, the
  RoPE tables). The torch ops and the C build (native.py, forward_cached.c) read the same tensors.

Shape legend: H hidden, V vocab, h query heads, g kv heads, D head dim, S cache slots, P cache
positions, E experts, I expert width, Q = h D, G = g D.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from reel.runtime.model.fp8 import dequant_blocks, per_block_cast_to_fp8
from reel.runtime.model.layers import rope_cos_sin, unquantised
from reel.runtime.model.moe import DenseMLP

if TYPE_CHECKING:
    from reel.runtime.model.model import MoEModel


@dataclass
class KVCache:
    """Post-norm, post-RoPE keys and values per layer, slot and position (fp32)."""

    k: torch.Tensor  # [layers, S, g, D, P] (transposed: a slot's keys are the right operand of q @ k)
    v: torch.Tensor  # [layers, S, g, P, D]

    @property
    def slots(self) -> int:
        return self.v.shape[1]

    @property
    def max_len(self) -> int:
        return self.v.shape[3]


def new_cache(model: MoEModel, slots: int, max_len: int) -> KVCache:
    cfg, dev = model.config, model.lm_head.weight.device
    layers, g, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    return KVCache(torch.zeros(layers, slots, g, D, max_len, device=dev),
                   torch.zeros(layers, slots, g, max_len, D, device=dev))


# ---- weights prepared for a precision ------------------------------------------------------------

def _prepare(w: torch.Tensor, precision: str) -> torch.Tensor:
    """What `linear(x, w, precision)` multiplies by: the weight itself (fp32), a bf16 copy, or the fp8
    round trip (per block)."""
    if precision == "fp8":
        return dequant_blocks(*per_block_cast_to_fp8(w))
    return w.bfloat16() if precision == "bf16" else w.detach()


class LayerWeights(NamedTuple):
    input_norm_H: torch.Tensor  # norm weights times sqrt(width) (see cached_forward._rms_norm)
    q_QH: torch.Tensor
    k_GH: torch.Tensor
    v_GH: torch.Tensor
    qk_norm_D: torch.Tensor  # [h + g, D] q_norm's weight per query head, then k_norm's times sqrt(D)
    o_HQ: torch.Tensor
    post_norm_H: torch.Tensor
    router_EH: torch.Tensor | None  # None for a dense MLP
    gate_EIH: torch.Tensor  # the experts' (a dense MLP: one expert's)
    up_EIH: torch.Tensor
    down_EHI: torch.Tensor
    mlp: nn.Module  # the layer's MoE (its experts serve large calls) or dense MLP


class PreparedWeights(NamedTuple):
    key: tuple
    params: list[torch.Tensor]
    embed_VH: torch.Tensor
    layers: list[LayerWeights]
    norm_H: torch.Tensor
    lm_head_VH: torch.Tensor
    cos_PD: torch.Tensor
    sin_PD: torch.Tensor  # sign-folded: rotate_half(x) * sin == roll(x, D/2) * sin_PD
    experts_E: torch.Tensor  # 0 .. E-1
    eps_H: torch.Tensor  # sqrt(width * eps) for the hidden and the head norms (cached_forward._rms_norm)
    eps_D: torch.Tensor


_registrations = 0  # parameters registered on any module so far (a parameter replaced by another)


def _count_registration(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    global _registrations
    _registrations += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def _key(params: list[torch.Tensor], precision: str, max_len: int) -> tuple:
    # In-place changes (loads, optimizer steps) move a version; `.data =` (e.g. `.to()`) a pointer.
    return (precision, max_len, _registrations, *((p.data_ptr(), p._version) for p in params))


def prepared_weights(model: MoEModel, max_len: int) -> PreparedWeights:
    """The model's prepared weights, rebuilt when the precision or any parameter changed."""
    cached: PreparedWeights | None = getattr(model, "_prepared", None)
    if cached is not None and cached.key == _key(cached.params, model.precision, max_len):
        return cached
    precision, cfg, dev = model.precision, model.config, model.lm_head.weight.device
    H, D, unq = cfg.hidden_size, cfg.head_dim, unquantised(precision)
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k, v, o = (_prepare(p.weight, precision) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        # Norm weights carry sqrt(width) (cached_forward._rms_norm); for q that cancels attention's D^-0.5.
        qk_norm = torch.cat([attn.q_norm.weight.expand(cfg.num_attention_heads, -1),
                             attn.k_norm.weight.expand(cfg.num_key_value_heads, -1) * D ** 0.5])
        if isinstance(layer.mlp, DenseMLP):  # one expert of weight 1, in the experts' layout
            router = None
            gate, up, down = (_prepare(p.weight, precision)[None] for p in (layer.mlp.gate_proj, layer.mlp.up_proj,
                                                                            layer.mlp.down_proj))
        else:
            ex = layer.mlp.experts
            router = _prepare(layer.mlp.gate.weight, unq)
            gate, up, down = (_prepare(p, precision) for p in (ex.gate_proj, ex.up_proj, ex.down_proj))
        layers.append(LayerWeights(layer.input_layernorm.weight * H ** 0.5, q, k, v, qk_norm, o,
                                   layer.post_attention_layernorm.weight * H ** 0.5, router, gate, up, down, layer.mlp))
    cos_PD, sin_PD = rope_cos_sin(torch.arange(max_len, device=dev), D, cfg.rope_theta)
    sin_PD = torch.cat([-sin_PD[:, :D // 2], sin_PD[:, D // 2:]], -1)
    params = list(model.parameters())
    eps_H, eps_D = (torch.tensor((n * cfg.rms_norm_eps) ** 0.5, device=dev) for n in (H, D))
    model._prepared = PreparedWeights(_key(params, precision, max_len), params, model.model.embed_tokens.weight,
                                      layers, model.model.norm.weight * H ** 0.5,
                                      _prepare(model.lm_head.weight, unq), cos_PD, sin_PD,
                                      torch.arange(cfg.num_experts, device=dev), eps_H, eps_D)
    return model._prepared
