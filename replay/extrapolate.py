"""What a run's storage would come to at real model sizes: a calculation, not a measurement.

Event bytes scale with trained tokens: a trajectory's bytes per token as measured, a routing
trace's per (token x MoE layer x top-k) expert id as measured, times the id width (uint8 up to
256 experts, else uint16). Weights and optimizer state come from the parameter count:

    weight version   bf16 weights                          2 bytes / parameter
    checkpoint       fp32 weights + AdamW's two moments    12 bytes / parameter

`before` keeps every weight version and checkpoint (Reel before retention); `after` keeps the
retention window, every keep_weights_every-th version and the checkpoints log.keep_checkpoints /
log.keep_checkpoints_every keep (bus/retention.py: all of them when keep_checkpoints = 0). Both keep
every event.
"""

from __future__ import annotations

import msgspec

from reel.bus.retention import CheckpointPolicy
from reel.runtime.model.config import MoEConfig

__all__ = ["Shape", "SHAPES", "shape_of", "param_count", "Extrapolated", "extrapolate", "BASIS"]

WEIGHT_BYTES_PER_PARAM = 2
CHECKPOINT_BYTES_PER_PARAM = 12
BASIS = ("calculation: measured event bytes per token (routing per expert id) scaled to the shape; weight "
         "versions bf16 (2 B/param), checkpoints fp32 weights + AdamW moments (12 B/param)")


class Shape(msgspec.Struct, frozen=True):
    name: str
    params: int
    moe_layers: int
    top_k: int
    num_experts: int


SHAPES = (
    Shape("Qwen3-30B-A3B", 30_500_000_000, 48, 8, 128),
    Shape("1T (Kimi-K2 / DeepSeek-V3 class)", 1_040_000_000_000, 60, 8, 384),
)


def param_count(c: MoEConfig) -> int:
    """Parameters of a Qwen3-MoE shape: embeddings, attention (with q/k norms), MoE or dense MLPs, norms."""
    H, D = c.hidden_size, c.head_dim
    attention = H * D * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * D + 2 * H
    moe = H * c.num_experts + c.num_experts * 3 * H * c.moe_intermediate_size
    dense = 3 * H * c.intermediate_size
    moe_layers = len(c.moe_layers)
    layers = c.num_hidden_layers * attention + moe_layers * moe + (c.num_hidden_layers - moe_layers) * dense
    embeddings = c.vocab_size * H * (1 if c.tie_word_embeddings else 2)
    return embeddings + layers + H


def shape_of(name: str, c: MoEConfig) -> Shape:
    return Shape(name, param_count(c), len(c.moe_layers), c.num_experts_per_tok, c.num_experts)


class Extrapolated(msgspec.Struct, kw_only=True):
    shape: Shape
    steps: int
    tokens_per_step: int
    weight_version_bytes: int
    checkpoint_bytes: int
    event_bytes_per_step: int
    checkpoints: int  # written over the run
    checkpoints_kept: int  # in the store at the end of the run, after retention
    versions_kept: int  # weight versions in the store at the end of the run, after retention
    before_bytes: int  # every weight version kept
    after_bytes: int  # the retention policy
    basis: str = BASIS


def extrapolate(shape: Shape, *, trajectory_bytes_per_token: float, routing_bytes_per_id: float, steps: int,
                tokens_per_step: int, checkpoint_every: int, window: int, keep_every: int,
                checkpoint_policy: CheckpointPolicy = CheckpointPolicy()) -> Extrapolated:
    id_bytes = 1 if shape.num_experts <= 256 else 2
    # routing_bytes_per_id: per trained token and byte of expert id (so framing overhead scales too)
    per_token = trajectory_bytes_per_token + routing_bytes_per_id * shape.moe_layers * shape.top_k * id_bytes
    events = round(per_token * tokens_per_step)
    weights = shape.params * WEIGHT_BYTES_PER_PARAM
    ckpt = shape.params * CHECKPOINT_BYTES_PER_PARAM
    written = {*range(checkpoint_every, steps + 1, checkpoint_every), steps} if steps else set()  # and the last
    checkpoints_kept = len(checkpoint_policy.kept(written))
    versions = steps + 1  # version 0 .. steps
    kept = len({v for v in range(versions) if v > steps - window or (keep_every and v % keep_every == 0)})
    return Extrapolated(shape=shape, steps=steps, tokens_per_step=tokens_per_step, weight_version_bytes=weights,
                        checkpoint_bytes=ckpt, event_bytes_per_step=events, checkpoints=len(written),
                        checkpoints_kept=checkpoints_kept, versions_kept=kept,
                        before_bytes=steps * events + len(written) * ckpt + versions * weights,
                        after_bytes=steps * events + checkpoints_kept * ckpt + kept * weights)
