"""What the engine's cached forward (cached_forward.py) runs over: the KV cache and the model's
weights prepared for it. Both depend on the model; the model depends on neither.

- The cache stores keys transposed per kv head ([S, g, D, P]) and values [S, g, P, D], so attention
  is two batched matmuls over (slot, kv head) rows with no per-token copies.
- Weights are prepared once per parameter version and precision (q/k/v fused into one matrix,
  experts' gate/up fused, expert matrices stored in the layout a batched matmul reads, cast or fp8
  round-tripped as the precision says, norm weights scaled as cached_forward._rms_norm reads them)
  and reused until a parameter changes in place or anew. The torch ops and the C build
  (native.py, forward_cached.c) read the same prepared tensors.

Shape legend: H hidden, V vocab, h query heads, g kv heads, D head dim, S cache slots, P cache
positions, E experts, I expert width, J = 2 I, O = (h + 2 g) D.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """What `linear(x, w, precision)` multiplies by: bf16 copy, or the fp8 round trip (per block)."""
    if precision == "fp8":
        return dequant_blocks(*per_block_cast_to_fp8(w))
    return w.bfloat16() if precision == "bf16" else w


class LayerWeights(NamedTuple):
    input_norm_H: torch.Tensor  # norm weights times sqrt(width) (see cached_forward._rms_norm)
    qkv_HO: torch.Tensor  # q, k, v projections side by side, transposed for x @ w
    qk_norm_D: torch.Tensor  # [h + g, D] q_norm's weight per query head, then k_norm's times sqrt(D)
    o_OH: torch.Tensor
    post_norm_H: torch.Tensor
    router_HE: torch.Tensor | None  # None for a dense MLP
    gate_up_EHJ: torch.Tensor  # experts' gate then up, transposed for x @ w (a dense MLP: one expert)
    down_EIH: torch.Tensor
    mlp: nn.Module  # the layer's MoE (its experts serve large calls) or dense MLP


class PreparedWeights(NamedTuple):
    key: tuple
    params: list[torch.Tensor]
    embed_VH: torch.Tensor
    layers: list[LayerWeights]
    norm_H: torch.Tensor
    lm_head_HV: torch.Tensor
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
        qkv = torch.cat([_prepare(p.weight, precision) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        # Norm weights carry sqrt(width) (cached_forward._rms_norm); for q that cancels attention's D^-0.5.
        qk_norm = torch.cat([attn.q_norm.weight.expand(cfg.num_attention_heads, -1),
                             attn.k_norm.weight.expand(cfg.num_key_value_heads, -1) * D ** 0.5])
        if isinstance(layer.mlp, DenseMLP):  # one expert of weight 1, in the experts' layout
            router = None
            gate_EIH, up_EIH, down_EHI = (p.weight[None] for p in (layer.mlp.gate_proj, layer.mlp.up_proj,
                                                                    layer.mlp.down_proj))
        else:
            ex = layer.mlp.experts
            router = _prepare(layer.mlp.gate.weight, unq).T.contiguous()
            gate_EIH, up_EIH, down_EHI = ex.gate_proj, ex.up_proj, ex.down_proj
        gate_up = torch.cat([_prepare(gate_EIH, precision), _prepare(up_EIH, precision)], 1).transpose(1, 2).contiguous()
        down = _prepare(down_EHI, precision).transpose(1, 2).contiguous()
        layers.append(LayerWeights(layer.input_layernorm.weight * H ** 0.5, qkv.T.contiguous(), qk_norm,
                                   _prepare(attn.o_proj.weight, precision).T.contiguous(),
                                   layer.post_attention_layernorm.weight * H ** 0.5, router, gate_up, down, layer.mlp))
    cos_PD, sin_PD = rope_cos_sin(torch.arange(max_len, device=dev), D, cfg.rope_theta)
    sin_PD = torch.cat([-sin_PD[:, :D // 2], sin_PD[:, D // 2:]], -1)
    params = list(model.parameters())
    eps_H, eps_D = (torch.tensor((n * cfg.rms_norm_eps) ** 0.5, device=dev) for n in (H, D))
    model._prepared = PreparedWeights(_key(params, precision, max_len), params, model.model.embed_tokens.weight,
                                      layers, model.model.norm.weight * H ** 0.5,
                                      _prepare(model.lm_head.weight, unq).T.contiguous(), cos_PD, sin_PD,
                                      torch.arange(cfg.num_experts, device=dev), eps_H, eps_D)
    return model._prepared


# ---- a new version copied into the prepared weights in place ----------------------------------------

# (prepared slice, parameter -> its value, the slice's dim that the parameter's dim 0 lands on): a swap
# that brings rows [a, b) of a parameter copies value(rows) into the slice narrowed to [a, b) on that dim.
Target = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], int]


def prepared_targets(model: MoEModel, max_len: int) -> dict[str, list[Target]] | None:
    """Where each parameter (state-dict name) lands in the model's current prepared weights: a weight
    swap copies `fn(parameter)` into each slice after the parameter, so the prepared copy is never
    dropped and rebuilt. None when there is nothing current to update, or the precision's preparation
    is not a plain cast (fp8's block round trip is redone from scratch)."""
    w: PreparedWeights | None = getattr(model, "_prepared", None)
    if w is None or model.precision == "fp8" or w.key != _key(w.params, model.precision, max_len):
        return None
    cfg = model.config
    H, D, h = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    scale_H = lambda p: p * H ** 0.5  # noqa: E731
    T, T12 = (lambda p: p.T), (lambda p: p.transpose(1, 2))  # noqa: E731
    out: dict[str, list[Target]] = {"model.norm.weight": [(w.norm_H, scale_H, 0)]}
    lm_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out.setdefault(lm_head, []).append((w.lm_head_HV, T, 1))
    for i, (layer, lw) in enumerate(zip(model.model.layers, w.layers)):
        pre = f"model.layers.{i}."
        q, k = h * D, cfg.num_key_value_heads * D
        out |= {pre + "input_layernorm.weight": [(lw.input_norm_H, scale_H, 0)],
                pre + "post_attention_layernorm.weight": [(lw.post_norm_H, scale_H, 0)],
                pre + "self_attn.q_proj.weight": [(lw.qkv_HO[:, :q], T, 1)],
                pre + "self_attn.k_proj.weight": [(lw.qkv_HO[:, q:q + k], T, 1)],
                pre + "self_attn.v_proj.weight": [(lw.qkv_HO[:, q + k:], T, 1)],
                pre + "self_attn.o_proj.weight": [(lw.o_OH, T, 1)],
                pre + "self_attn.q_norm.weight": [(lw.qk_norm_D[:h], lambda p: p.expand(h, -1), 1)],
                pre + "self_attn.k_norm.weight": [(lw.qk_norm_D[h:], lambda p: p.expand(cfg.num_key_value_heads, -1)
                                                   * D ** 0.5, 1)]}
        I = lw.gate_up_EHJ.shape[2] // 2
        gate, up, down = lw.gate_up_EHJ[:, :, :I], lw.gate_up_EHJ[:, :, I:], lw.down_EIH
        if isinstance(layer.mlp, DenseMLP):
            mlp = pre + "mlp."
            out |= {mlp + "gate_proj.weight": [(gate[0], T, 1)], mlp + "up_proj.weight": [(up[0], T, 1)],
                    mlp + "down_proj.weight": [(down[0], T, 1)]}
        else:
            ex = pre + "mlp.experts."
            out |= {pre + "mlp.gate.weight": [(lw.router_HE, T, 1)], ex + "gate_proj": [(gate, T12, 0)],
                    ex + "up_proj": [(up, T12, 0)], ex + "down_proj": [(down, T12, 0)]}
    return out


def mark_current(model: MoEModel, max_len: int) -> None:
    """The prepared weights were updated in place along with the parameters: they are current again."""
    w: PreparedWeights = model._prepared
    model._prepared = w._replace(key=_key(w.params, model.precision, max_len))
