"""Upper bounds for config values that name resources, checked at load with the key and the limit.

Without them a typo is found late and badly: `rollout.group_size = 1e9` hangs, `stats_every_s = 0`
fills the disk, `bus.partitions = 1e6` spins creating keys, a 1e9 `model.hidden_size` ends in an
allocator traceback. Three kinds of check:

- sizes must be positive (or 0 where 0 means "the default");
- counts and intervals must lie in a range no real run leaves (RANGES);
- a memory estimate of the model and engine shapes must fit this machine, where the run's
  weights live on it: the built-in engine with a single-rank trainer (a cluster run's memory is
  on its GPU nodes, which the submitting machine cannot see).
"""

from __future__ import annotations

import os
from typing import Any

from reel.runtime.config.keys import require

__all__ = ["RANGES", "validate_bounds", "memory_estimate", "machine_memory"]

# key -> (lowest, highest) allowed, inclusive.
RANGES: dict[str, tuple[float, float]] = {
    "rollout.workers": (1, 4096),
    "rollout.concurrency": (1, 65536),
    "rollout.group_size": (2, 4096),
    "rollout.max_tokens": (1, 1 << 20),
    "rollout.stats_every_s": (0.1, 3600),
    "trainer.batch_groups": (1, 1 << 20),
    "trainer.micro_batch_tokens": (0, 1 << 30),
    "trainer.checkpoint_every": (1, 1 << 30),
    "bus.block_ms": (1, 600_000),
    "bus.claim_idle_ms": (1, 7 * 24 * 3600 * 1000),
    "bus.max_deliveries": (1, 1000),
    "bus.partitions": (1, 1024),
    "bus.ride_out_s": (0, 3600),
    "run.stall_s": (1, 7 * 24 * 3600),  # longer hides a dead server: stop, and `reel run --resume` once it is back
    "engine.max_batch": (1, 1 << 16),
    "engine.max_seq_len": (0, 1 << 24),
    "engine.threads": (1, 1024),
    "log.segment_bytes": (4096, 1 << 34),
    "log.keep_checkpoints": (0, 1 << 30),
    "log.keep_checkpoints_every": (0, 1 << 30),
    "model.max_position_embeddings": (1, 1 << 24),
    "model.hidden_size": (1, 1 << 17),
    "model.intermediate_size": (1, 1 << 20),
    "model.moe_intermediate_size": (1, 1 << 20),
    "model.num_hidden_layers": (1, 1024),
    "model.num_attention_heads": (1, 1024),
    "model.num_key_value_heads": (1, 1024),
    "model.head_dim": (1, 4096),
    "model.num_experts": (1, 65535),
    "model.num_experts_per_tok": (1, 1024),
    "model.vocab_size": (0, 1 << 22),
}
TRAINER_BYTES_PER_PARAM = 16  # fp32 weights, gradients and Adam's two moments
ENGINE_BYTES_PER_VALUE = 4  # the built-in engine's weights and KV cache in fp32 (the upper case)
MEMORY_SHARE = 0.9  # of this machine's memory a run may plan to use


def validate_bounds(c: Any) -> None:
    """Reject values out of RANGES and, for a run held on this machine, shapes that cannot fit in it."""
    for key, (low, high) in RANGES.items():
        section, name = key.split(".")
        if section == "model" and c.model.path:
            continue  # a checkpoint's own shapes: its config.json decides them
        value = getattr(getattr(c, section), name)
        require(low <= value <= high, f"{key} = {value} is outside [{_n(low)}, {_n(high)}]; pick a value in that range")
    if c.model.path or c.engine.kind != "builtin" or c.trainer.ranks != 1:
        return
    need, parts = memory_estimate(c)
    have = machine_memory()
    require(need <= MEMORY_SHARE * have,
            f"the model and engine shapes need about {_gib(need)} of memory ({parts}), more than "
            f"{MEMORY_SHARE:.0%} of this machine's {_gib(have)}; lower the [model] sizes, engine.max_batch or "
            f"engine.max_seq_len")


def memory_estimate(c: Any) -> tuple[int, str]:
    """(bytes, how they add up) of the trainer's state and the built-in engine's weights and KV cache."""
    m = c.model
    vocab = m.vocab_size or 256  # 0: the env tokenizer's, which is small
    attention = m.hidden_size * m.head_dim * (2 * m.num_attention_heads + 2 * m.num_key_value_heads)
    experts = m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size + m.hidden_size * m.num_experts
    dense = 3 * m.hidden_size * m.intermediate_size
    embeddings = vocab * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    params = embeddings + m.num_hidden_layers * (attention + max(experts, dense))
    seq = c.engine.max_seq_len or m.max_position_embeddings
    kv_values = c.engine.max_batch * seq * m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_dim
    rope_values = 2 * m.max_position_embeddings * m.head_dim
    trainer = params * TRAINER_BYTES_PER_PARAM
    engine = (params + kv_values + rope_values) * ENGINE_BYTES_PER_VALUE
    return trainer + engine, (f"trainer {_gib(trainer)} for {params:,} parameters, engine {_gib(engine)} with a KV "
                              f"cache of engine.max_batch = {c.engine.max_batch} x {seq} positions")


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its container's limit (cgroup v2) when lower."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _n(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else f"{x:,}"
