"""The engine's cached forward (inference only): flat tokens of many sequences, prefill chunks and
decode tokens mixed, against a KV cache indexed by (slot, position); routing [N, L, K].

It computes what `MoEModel.forward` computes from the same parameters (tests hold it to the full
forward within 1e-5 and to the same routing); it depends on the model, the model not on it. In
fp32 on the CPU the whole call is one C function over the weights kvcache.py prepares (native.py,
forward_cached.c), when a C compiler is there; otherwise, and for bf16/fp8 or other devices, the
torch ops below, written for the small decode steps of a tiny model, whose cost is per-op overhead
and memory traffic:
- the weights are prepared once per parameter version and precision (kvcache.prepared_weights; in
  fp32 they are the parameters);
- attention is two batched matmuls over (slot, kv head) rows of the cache's layout (kvcache.KVCache):
  decode tokens read the range of slots they touch in place, one row per slot; chunks (prefills)
  gather their slots once per layer, padded to the longest chunk of their length bucket;
- experts run as two batched matmuls over per-expert rows padded to the busiest expert's count
  while experts get few rows each (decode steps), else as the training path's grouped GEMM;
- fewer dispatches per layer: RMSNorm as x / hypot(|x|, sqrt(n eps)) * w sqrt(n) (4 ops, equal up
  to rounding), q and k heads normed and rotated together, RoPE from a table, the router inlined,
  o_proj's residual added inside its GEMM.
fp8 runs the reference GEMM (dequantised operands in fp32) on every device, DeepGEMM never.

Shape legend: N flat tokens, H hidden, V vocab, h query heads, g kv heads, r = h / g, D head dim,
S cache slots, P cache positions, R slots in the call's range, T tokens per slot row (padded),
E experts, K top-k, A = N * K assignments, C rows per expert (padded), I expert width, L MoE layers,
Q = h D, G = g D.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from reel.runtime.model import native
from reel.runtime.model.config import ModelError
from reel.runtime.model.fp8 import dequant_tokens, per_token_cast_to_fp8
from reel.runtime.model.kvcache import KVCache, PreparedWeights, prepared_weights
from reel.runtime.model.layers import unquantised
from reel.runtime.model.model import ModelOutput, MoEModel


@torch.no_grad()
def forward_cached(model: MoEModel, input_ids_N: torch.Tensor, slot_ids_N: torch.Tensor, positions_N: torch.Tensor,
                   cache: KVCache, *, replay_routing_NLK: torch.Tensor | None = None,
                   return_routing: bool = False) -> ModelOutput:
    """Token n (of slot s, at position p) writes its k/v to cache[s, p], then attends to cache[s, :p+1].

    Cost grows with the range of slots the call touches (min to max slot id), not their count.
    """
    model.check_replay(replay_routing_NLK, (input_ids_N.shape[0],), "replay_routing_NLK")
    span = int(positions_N.max()) + 1
    if span > cache.max_len:
        raise ModelError(f"position {span - 1} does not fit the KV cache (max_len {cache.max_len})")
    slot_N, pos_N = (t if t.dtype == torch.long else t.long() for t in (slot_ids_N, positions_N))
    w = prepared_weights(model, cache.max_len)
    if native.usable(model, input_ids_N):
        logits_NV, routing_NLK = native.forward_cached(model, w, input_ids_N, slot_N, pos_N, cache, replay_routing_NLK)
    else:
        logits_NV, ids = _forward_torch(model, w, input_ids_N, slot_N, pos_N, span, cache, replay_routing_NLK)
        routing_NLK = torch.stack(ids, dim=1) if return_routing and ids else None
    return ModelOutput(logits_NV, routing_NLK if return_routing else None, None)


def release_prepared(model: MoEModel) -> None:
    """Drops the prepared weights (and the C plan over them) before a weight swap, so that a rebuild
    (bf16 or fp8 copies) never holds two copies at once."""
    model._prepared = None
    native.forget(model)


def _act(x: torch.Tensor, precision: str) -> torch.Tensor:
    """What `linear` multiplies the input by: bf16 copy, or the per-token fp8 round trip."""
    if precision == "fp8":
        return dequant_tokens(*per_token_cast_to_fp8(x))
    return x.bfloat16() if precision == "bf16" else x


def _linear(x: torch.Tensor, w_OI: torch.Tensor, precision: str) -> torch.Tensor:
    y = torch.mm(_act(x, precision), w_OI.T)
    return y.float() if precision == "bf16" else y


def _rms_norm(x: torch.Tensor, w_scaled: torch.Tensor, eps_scaled: torch.Tensor) -> torch.Tensor:
    """layers.RMSNorm up to rounding, in 4 dispatches instead of 7:
    x / sqrt(mean(x^2) + eps) * w == x / hypot(|x|, sqrt(n eps)) * (w sqrt(n))."""
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps_scaled) * w_scaled


def _rope(x_NxD: torch.Tensor, cos_N1D: torch.Tensor, sin_N1D: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x_NxD * cos_N1D, x_NxD.roll(x_NxD.shape[-1] // 2, -1), sin_N1D)


def _route(x_NH: torch.Tensor, router_EH: torch.Tensor, top_k: int, renormalise: bool, precision: str,
           replay_NK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.Router: (gate weights [N, K], expert ids [N, K]); topk's values are the gathered scores."""
    scores_NE = torch.softmax(_linear(x_NH, router_EH, unquantised(precision)), dim=-1)
    if replay_NK is None:
        weights_NK, ids_NK = torch.topk(scores_NE, top_k, dim=-1)
    else:
        ids_NK = replay_NK.long()
        weights_NK = scores_NE.gather(-1, ids_NK)
    return (weights_NK / weights_NK.sum(-1, keepdim=True) if renormalise else weights_NK), ids_NK


# ---- attention against the cache ---------------------------------------------------------------

class _Grid(NamedTuple):
    """Some of the call's tokens laid out as a padded grid of R slot rows by T tokens."""

    tokens: torch.Tensor | None  # which of the call's tokens (None: all of them, in order)
    row: torch.Tensor | None  # token -> grid row (slot row * T + t); None when token i is row i
    slots: torch.Tensor | None  # the rows' cache slots, gathered; None: the range read in place below
    k_LRgDP: torch.Tensor | None  # every layer's keys and values of a slot range (views)
    v_LRgPD: torch.Tensor | None
    R: int
    T: int
    span: int  # cache positions read
    hidden_R11TP: torch.Tensor  # key p is hidden from row (r, t): p > its position


def _grid(tokens, row, R: int, T: int, pos_N: torch.Tensor, cache: KVCache, slots: torch.Tensor | slice,
          span: int | None = None) -> _Grid:
    # Padding cells keep position 0, so they see one key and no softmax row is empty.
    pos_RT = pos_N if row is None else pos_N.new_zeros(R * T).index_copy_(0, row, pos_N)
    span = span or int(pos_N.max()) + 1
    hidden = (torch.arange(span, device=pos_N.device) > pos_RT[:, None]).view(R, 1, 1, T, span)
    if isinstance(slots, slice):
        return _Grid(tokens, row, None, cache.k[:, slots, :, :, :span], cache.v[:, slots, :, :span], R, T, span, hidden)
    return _Grid(tokens, row, slots, None, None, R, T, span, hidden)


def _grids(slot_N: torch.Tensor, pos_N: torch.Tensor, span: int, cache: KVCache) -> list[_Grid]:
    """Decode tokens (one in their slot this call) read their slots' range in place, one row each;
    chunks (several tokens of a slot) gather their slots, bucketed by length (powers of two) so that
    short chunks are not padded to the longest."""
    N, dev = slot_N.shape[0], slot_N.device
    lo, hi = (int(v) for v in torch.aminmax(slot_N))
    if hi + 1 - lo == N and torch.equal(slot_N, torch.arange(lo, hi + 1, device=dev)):
        return [_grid(None, None, N, 1, pos_N, cache, slice(lo, hi + 1), span)]  # decode over packed slots
    uniq_U, inv_N, counts_U = torch.unique(slot_N, return_inverse=True, return_counts=True)
    bucket_U = torch.ceil(torch.log2(counts_U.float())).long()  # 0: decode tokens
    grids = []
    for bucket in bucket_U.unique().tolist():
        in_U = bucket_U == bucket
        whole = bool(in_U.all())
        tokens_n = None if whole else in_U[inv_N].nonzero()[:, 0]
        slot_n, pos_n = (slot_N, pos_N) if whole else (slot_N[tokens_n], pos_N[tokens_n])
        if bucket == 0:
            lo, hi = (int(v) for v in torch.aminmax(slot_n))
            rel_n = slot_n - lo
            identity = hi + 1 - lo == len(slot_n) and torch.equal(rel_n, torch.arange(len(slot_n), device=dev))
            grids.append(_grid(tokens_n, None if identity else rel_n, hi + 1 - lo, 1, pos_n, cache,
                               slice(lo, hi + 1)))
            continue
        srow_n = (in_U.cumsum(0) - 1)[inv_N if whole else inv_N[tokens_n]]  # the token's slot row in the grid
        counts_R = counts_U[in_U]
        T = int(counts_R.max())
        order_n = torch.argsort(srow_n, stable=True)  # t = rank of a token among its slot's, in call order
        t_sorted = torch.arange(len(srow_n), device=dev) - (counts_R.cumsum(0) - counts_R)[srow_n[order_n]]
        row_n = srow_n * T + torch.empty_like(srow_n).index_copy_(0, order_n, t_sorted)
        grids.append(_grid(tokens_n, row_n, len(counts_R), T, pos_n, cache, uniq_U[in_U]))
    return grids


def _attend_grid(q_nhD: torch.Tensor, cache: KVCache, layer: int, grid: _Grid) -> torch.Tensor:
    R, T, span = grid.R, grid.T, grid.span
    _, h, D = q_nhD.shape
    g = cache.k.shape[2]
    r = h // g
    if grid.slots is None:  # views: no copy
        k_RgDP, v_RgPD = grid.k_LRgDP[layer], grid.v_LRgPD[layer]
    else:
        k_RgDP = cache.k[layer, :, :, :, :span].index_select(0, grid.slots)
        v_RgPD = cache.v[layer, :, :, :span].index_select(0, grid.slots)
    q_RThD = q_nhD if grid.row is None else q_nhD.new_zeros(R * T, h, D).index_copy_(0, grid.row, q_nhD)
    # Rows of one (slot, kv head) are its r query heads times T tokens: [R*g, r*T, D].
    q_GQD = q_RThD.reshape(R * g, r, D) if T == 1 else \
        q_RThD.view(R, T, g, r, D).permute(0, 2, 3, 1, 4).reshape(R * g, r * T, D)
    s_GQP = torch.bmm(q_GQD, k_RgDP.reshape(R * g, D, span))  # q carries the D^-0.5 scale
    s_GQP.view(R, g, r, T, span).masked_fill_(grid.hidden_R11TP, float("-inf"))
    o_GQD = torch.bmm(torch.softmax(s_GQP, dim=-1), v_RgPD.reshape(R * g, span, D))
    o_RThD = o_GQD.view(R, h, D) if T == 1 else \
        o_GQD.view(R, g, r, T, D).permute(0, 3, 1, 2, 4).reshape(R * T, h, D)
    return o_RThD if grid.row is None else o_RThD.index_select(0, grid.row)


def _attend(q_NhD, k_NgD, v_NgD, cache: KVCache, layer: int, slot_N, pos_N, grids: list[_Grid]) -> torch.Tensor:
    # Write this call's keys first, so a chunk's tokens see each other (causally, via the mask).
    cache.k[layer, slot_N, :, :, pos_N] = k_NgD
    cache.v[layer, slot_N, :, pos_N] = v_NgD
    if len(grids) == 1 and grids[0].tokens is None:
        return _attend_grid(q_NhD, cache, layer, grids[0])
    o_NhD = q_NhD.new_empty(q_NhD.shape)
    for grid in grids:
        o_NhD.index_copy_(0, grid.tokens, _attend_grid(q_NhD.index_select(0, grid.tokens), cache, layer, grid))
    return o_NhD


# ---- experts ------------------------------------------------------------------------------------

# Average rows per expert up to which padding every expert to the busiest one's count beats a
# grouped GEMM's per-expert matmuls (measured on a 2-core CPU: 1.6x faster at 16, 1.3x at 64,
# 2x slower at 200, where padding and its memory grow).
_PADDED_ROWS_PER_EXPERT = 64


def _experts(x_NH, ids_NK, weights_NK, token_A, experts_E, gate_EIH, up_EIH, down_EHI,
             precision: str) -> torch.Tensor:
    """Each assignment's row goes to its expert's block of C rows; three bmm, then back to its token.

    token_A: the token of each assignment (n // K), shared by every layer of the call."""
    (N, K), (E, _, H) = ids_NK.shape, gate_EIH.shape
    ids_A = ids_NK.flatten()
    mine_AE = ids_A[:, None] == experts_E
    seen_AE = mine_AE.cumsum(0)
    C = int(seen_AE[-1].max())
    row_A = (seen_AE * mine_AE).sum(1).add_(ids_A, alpha=C).sub_(1)  # expert * C + order among its rows
    # Padding rows read token 0 (any token would do): their outputs are never read back.
    token_EC = torch.zeros(E * C, dtype=torch.long, device=x_NH.device).index_copy_(0, row_A, token_A)
    x_ECH = _act(x_NH, precision).index_select(0, token_EC).view(E, C, H)
    gate_ECI, up_ECI = (torch.bmm(x_ECH, w_EIH.transpose(1, 2)).float() for w_EIH in (gate_EIH, up_EIH))
    y_ECH = torch.bmm(_act(F.silu(gate_ECI) * up_ECI, precision), down_EHI.transpose(1, 2))
    y_NKH = (y_ECH.float() if precision == "bf16" else y_ECH).view(E * C, H).index_select(0, row_A).view(N, K, H)
    return (y_NKH * weights_NK.unsqueeze(-1)).sum(1)


# ---- the forward ----------------------------------------------------------------------------------

def _forward_torch(model: MoEModel, w: PreparedWeights, ids_N: torch.Tensor, slot_N: torch.Tensor,
                   pos_N: torch.Tensor, span: int, cache: KVCache, replay_NLK: torch.Tensor | None):
    """-> (logits [N, V], expert ids per MoE layer [N, K]); writes the tokens' keys and values.

    span: 1 + the largest position."""
    cfg, precision = model.config, model.precision
    h, g, D, K = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts_per_tok
    N = ids_N.shape[0]
    grids = _grids(slot_N, pos_N, span, cache)
    cos_N1D, sin_N1D = w.cos_PD[pos_N, None], w.sin_PD[pos_N, None]
    x_NH = F.embedding(ids_N, w.embed_VH)
    # Few rows per expert: padded bmm (few ops); many: the training path's grouped GEMM (no padding).
    padded_experts = N * K <= _PADDED_ROWS_PER_EXPERT * cfg.num_experts
    token_A = torch.arange(N, device=ids_N.device).repeat_interleave(K) if padded_experts else None
    ids = []
    for i, lw in enumerate(w.layers):
        xn_NH = _rms_norm(x_NH, lw.input_norm_H, w.eps_H)
        qkv_NxD = torch.cat([_linear(xn_NH, p, precision) for p in (lw.q_QH, lw.k_GH, lw.v_GH)], -1).view(N, -1, D)
        qk_NxD = _rope(_rms_norm(qkv_NxD[:, :h + g], lw.qk_norm_D, w.eps_D), cos_N1D, sin_N1D)
        o_NhD = _attend(qk_NxD[:, :h], qk_NxD[:, h:], qkv_NxD[:, h + g:], cache, i, slot_N, pos_N, grids)
        if precision == "fp32":  # residual add inside the GEMM
            x_NH = torch.addmm(x_NH, o_NhD.reshape(N, h * D), lw.o_HQ.T)
        else:
            x_NH = x_NH + _linear(o_NhD.reshape(N, h * D), lw.o_HQ, precision)
        h_NH = _rms_norm(x_NH, lw.post_norm_H, w.eps_H)
        if lw.router_EH is None:
            x_NH = x_NH + lw.mlp(h_NH, precision)
            continue
        replay_NK = None if replay_NLK is None else replay_NLK[:, len(ids)]
        weights_NK, ids_NK = _route(h_NH, lw.router_EH, K, cfg.norm_topk_prob, precision, replay_NK)
        if padded_experts:
            x_NH = x_NH + _experts(h_NH, ids_NK, weights_NK, token_A, w.experts_E, lw.gate_EIH, lw.up_EIH,
                                   lw.down_EHI, precision)
        else:
            x_NH = x_NH + lw.mlp.experts(h_NH, ids_NK, weights_NK, precision)
        ids.append(ids_NK)
    logits_NV = _linear(_rms_norm(x_NH, w.norm_H, w.eps_H), w.lm_head_VH, unquantised(precision))
    return logits_NV, ids
