"""The C build of the KV-cache forward (forward_cached.c): fp32 on the CPU, one call per step.

A tiny model's decode step is ~170 torch ops whose cost is dispatch, not arithmetic; the C version
does the same math over the same prepared weights and cache in plain loops (runtime/cbuild.py
compiles it on first use). Where no compiler works, or REEL_NATIVE=0, cached_forward.py keeps its
torch ops: same results up to fp32 rounding (tests hold both to the full forward).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from reel.runtime import cbuild
from reel.runtime.model.config import ModelError
from reel.runtime.package_files import package_file

if TYPE_CHECKING:
    from reel.runtime.model.kvcache import KVCache, PreparedWeights
    from reel.runtime.model.model import MoEModel

__all__ = ["forward_cached", "forget", "usable"]

_SOURCE = package_file(__package__, "forward_cached.c")
_i64, _f32p, _i64p = ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)


class _Dims(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("H", "h", "g", "D", "K", "V", "S", "P", "renormalise")] + \
               [("eps_H", ctypes.c_float), ("eps_D", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _f32p) for name in ("input_norm", "q", "k", "v", "qk_norm", "o", "post_norm", "router",
                                           "gate", "up", "down")] + [("experts", _i64), ("width", _i64)]


def _library() -> ctypes.CDLL | None:
    return cbuild.load(_SOURCE) if cbuild.enabled() else None


def usable(model: MoEModel, ids_N: torch.Tensor) -> bool:
    """fp32 on the CPU, not turned off (REEL_NATIVE=0), with the kernel built."""
    return model.precision == "fp32" and ids_N.device.type == "cpu" and _library() is not None


class _Plan(NamedTuple):
    """ctypes views of one PreparedWeights (whose tensors keep the memory alive)."""

    prepared: PreparedWeights
    layers: ctypes.Array
    tables: tuple  # embed, final norm, lm_head, cos, sin: the same every step (made once: ~20 us a step)


def _ptr(t: torch.Tensor | None):
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"the C forward needs contiguous fp32 weights, got {t.dtype} {tuple(t.shape)}")
    return ctypes.cast(t.data_ptr(), _f32p)


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Plan (not copied with it)


def forget(model: MoEModel) -> None:
    """Drops the model's plan (and with it the prepared weights it points into)."""
    _plans.pop(model, None)


def _plan(model: MoEModel, w: PreparedWeights) -> _Plan:
    cached: _Plan | None = _plans.get(model)
    if cached is not None and cached.prepared is w:
        return cached
    layers = (_Layer * len(w.layers))()
    for out, lw in zip(layers, w.layers):
        out.input_norm, out.qk_norm, out.post_norm = (_ptr(t) for t in (lw.input_norm_H, lw.qk_norm_D, lw.post_norm_H))
        out.q, out.k, out.v, out.o = (_ptr(t) for t in (lw.q_QH, lw.k_GH, lw.v_GH, lw.o_HQ))
        out.router, out.gate, out.up, out.down = (_ptr(t) for t in (lw.router_EH, lw.gate_EIH, lw.up_EIH, lw.down_EHI))
        out.experts, out.width = lw.gate_EIH.shape[0], lw.gate_EIH.shape[1]
    tables = tuple(_ptr(t) for t in (w.embed_VH, w.norm_H, w.lm_head_VH, w.cos_PD, w.sin_PD))
    _plans[model] = plan = _Plan(w, layers, tables)
    return plan


def forward_cached(model: MoEModel, w: PreparedWeights, ids_N: torch.Tensor, slot_N: torch.Tensor, pos_N: torch.Tensor,
                   cache: KVCache, replay_NLK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [N, V], expert ids [N, L, K]; None without MoE layers): cached_forward._forward_torch's
    result, from one C call."""
    cfg = model.config
    plan = _plan(model, w)
    N, K, moe_layers = ids_N.shape[0], cfg.num_experts_per_tok, sum(lw.router_EH is not None for lw in w.layers)
    dims = _Dims(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, K,
                 cfg.vocab_size, cache.slots, cache.max_len, int(cfg.norm_topk_prob), float(w.eps_H), float(w.eps_D))
    ids, slots, pos = (t.to(torch.int64).contiguous() for t in (ids_N, slot_N, pos_N))
    replay = None if replay_NLK is None else replay_NLK.to(torch.int64).contiguous()
    logits_NV = torch.empty(N, cfg.vocab_size)
    routing_NLK = torch.empty(N, moe_layers, K, dtype=torch.int64)
    status = _library().reel_forward_cached(
        ctypes.byref(dims), plan.layers, _i64(len(w.layers)), *plan.tables, _ptr(cache.k), _ptr(cache.v), _i64(N),
        *(ctypes.cast(t.data_ptr(), _i64p) for t in (ids, slots, pos)),
        None if replay is None else ctypes.cast(replay.data_ptr(), _i64p),
        _ptr(logits_NV), ctypes.cast(routing_NLK.data_ptr(), _i64p))
    if status < 0:
        raise MemoryError(f"the C forward could not allocate scratch memory for {N} tokens")
    if status > 0:  # the C code checks every index before it touches memory: nothing was written
        name, t, bound = (("token id", ids, cfg.vocab_size), ("slot", slots, cache.slots),
                          ("position", pos, cache.max_len), ("replayed expert id", replay, cfg.num_experts))[status - 1]
        raise ModelError(f"{name}s must lie in [0, {bound}), got {int(t.min())}..{int(t.max())}")
    return logits_NV, routing_NLK if moe_layers else None
