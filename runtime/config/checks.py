"""The checks a run's config passes at load, across keys: what no type can say on its own.

env.name and env.options are the envs' to check (producers/envs/registry.py `check_config`): the
commands that load a user's config (the shell: `reel run`, `config show`, `init`, `launch slurm`)
call it after these.

Every failure is a `ConfigError` naming the key and the fix. Ranges of sizes and counts and the
memory a config's shapes need are runtime/config/bounds.py; the [engine] section's own checks are
runtime/config/engine.py.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from reel.runtime.config.bounds import validate_bounds
from reel.runtime.config.engine import validate_engine
from reel.runtime.config.keys import ConfigError, require

from reel.runtime.config.sections import Config, TrainerSection

def validate(c: Config) -> None:
    """Reject impossible values before anything starts."""
    require(re.fullmatch(r"[A-Za-z0-9_.-]+", c.run.name) is not None,
             f"run.name = {c.run.name!r} must use only letters, digits, '_', '.', '-'")
    require(c.run.steps >= 1, f"run.steps = {c.run.steps} must be at least 1")
    require(c.rollout.async_level >= 0, f"rollout.async_level = {c.rollout.async_level} must be >= 0")
    require(c.engine.threads >= 1, f"engine.threads = {c.engine.threads} must be at least 1")
    require(c.rollout.workers >= 1, f"rollout.workers = {c.rollout.workers} must be at least 1")
    require(c.rollout.concurrency >= 1, f"rollout.concurrency = {c.rollout.concurrency} must be at least 1")
    require(c.rollout.group_size >= 2,
             f"rollout.group_size = {c.rollout.group_size} must be at least 2 (GRPO compares samples of a group)")
    require(c.rollout.max_tokens >= 1, f"rollout.max_tokens = {c.rollout.max_tokens} must be at least 1")
    require(c.rollout.temperature > 0, f"rollout.temperature = {c.rollout.temperature} must be > 0")
    require(0 < c.rollout.top_p <= 1, f"rollout.top_p = {c.rollout.top_p} must be in (0, 1]")
    require(c.rollout.tool_concurrency >= 1,
            f"rollout.tool_concurrency = {c.rollout.tool_concurrency} must be at least 1 (env calls at once per worker)")
    require(c.rollout.tool_timeout_s > 0,
            f"rollout.tool_timeout_s = {c.rollout.tool_timeout_s} must be > 0 (seconds before an env call is cut)")
    require(c.trainer.batch_groups >= 1, f"trainer.batch_groups = {c.trainer.batch_groups} must be at least 1")
    # With async_level = a, workers start at most concurrency groups per version for a+1 versions.
    producible = c.rollout.workers * c.rollout.concurrency * (c.rollout.async_level + 1)
    require(c.trainer.batch_groups <= producible,
             f"trainer.batch_groups = {c.trainer.batch_groups} exceeds what rollout can produce per step "
             f"({producible} = workers x concurrency x (async_level + 1)); lower it or raise rollout.concurrency")
    require(c.trainer.lr > 0, f"trainer.lr = {c.trainer.lr} must be > 0")
    require(c.trainer.lr_spike_step >= 0, f"trainer.lr_spike_step = {c.trainer.lr_spike_step} must be >= 0 (0 = none)")
    require(c.trainer.lr_spike_factor > 0, f"trainer.lr_spike_factor = {c.trainer.lr_spike_factor} must be > 0")
    require(c.trainer.max_off_policy_steps >= 0,
             f"trainer.max_off_policy_steps = {c.trainer.max_off_policy_steps} must be >= 0")
    require(c.trainer.max_off_policy_steps >= c.rollout.async_level,
             f"trainer.max_off_policy_steps = {c.trainer.max_off_policy_steps} is below rollout.async_level = "
             f"{c.rollout.async_level}: every async group would be dropped; raise it")
    require(c.trainer.optimizer_steps >= 1, f"trainer.optimizer_steps = {c.trainer.optimizer_steps} must be >= 1")
    require(c.trainer.ranks >= 1, f"trainer.ranks = {c.trainer.ranks} must be at least 1")
    ep = c.trainer.expert_parallel
    require(ep >= 1 and c.trainer.ranks % ep == 0,
             f"trainer.expert_parallel = {ep} must be at least 1 and divide trainer.ranks = {c.trainer.ranks}; "
             "pick a divisor of trainer.ranks (1 = no expert parallelism)")
    _validate_context_parallel(c.trainer)
    require(c.trainer.weight_shard_mb >= 1, f"trainer.weight_shard_mb = {c.trainer.weight_shard_mb} must be at "
            "least 1 (MiB per weight shard)")
    require(c.trainer.checkpoint_every >= 1,
             f"trainer.checkpoint_every = {c.trainer.checkpoint_every} must be at least 1")
    require(c.log.keep_weights_every >= 0,
            f"log.keep_weights_every = {c.log.keep_weights_every} must be >= 0 (0 = keep no extra weight versions)")
    require(c.trainer.icepop_low < c.trainer.icepop_high, "trainer.icepop_low must be below trainer.icepop_high")
    require(c.trainer.mis_low < c.trainer.mis_high, "trainer.mis_low must be below trainer.mis_high")
    require(0 < c.trainer.ratio_clamp <= 80, f"trainer.ratio_clamp = {c.trainer.ratio_clamp} must be in (0, 80] "
             "(exp(log ρ) overflows float32 past 88); the default 20 is verl's bound")
    require(c.trainer.dual_clip == 0 or c.trainer.dual_clip > 1,
             f"trainer.dual_clip = {c.trainer.dual_clip} must be 0 (off) or above 1 (the default 3 is verl's)")
    require(1 <= c.env.min_len <= c.env.max_len,
             f"env.min_len = {c.env.min_len} and env.max_len = {c.env.max_len} need 1 <= min_len <= max_len")
    require(0.0 <= c.env.long_tail <= 1.0, f"env.long_tail = {c.env.long_tail} must be in [0, 1]")
    require(c.env.long_tail == 0 or c.rollout.max_tokens - 1 >= c.env.max_len,
             f"env.long_tail = {c.env.long_tail} asks for answers of rollout.max_tokens - 1 = "
             f"{c.rollout.max_tokens - 1} characters, fewer than env.max_len = {c.env.max_len}; raise rollout.max_tokens")
    require(c.init.warmup_steps >= -1, f"init.warmup_steps = {c.init.warmup_steps} must be >= 0 (or -1 = default)")
    m = c.model
    if not m.path:
        require(m.num_experts_per_tok <= m.num_experts,
                 f"model.num_experts_per_tok = {m.num_experts_per_tok} exceeds model.num_experts = {m.num_experts}")
        require(m.num_attention_heads % m.num_key_value_heads == 0,
                 "model.num_attention_heads must be a multiple of model.num_key_value_heads")
        require(m.num_experts <= 65535, "model.num_experts must fit in uint16 (<= 65535)")
        require(m.num_experts % c.trainer.expert_parallel == 0,
                 f"trainer.expert_parallel = {c.trainer.expert_parallel} does not divide model.num_experts = "
                 f"{m.num_experts}: each EP rank holds whole experts; pick a divisor of both")
    require(c.bus.url == "" or c.bus.url.split("://")[0] in ("redis", "rediss", "unix"),
             f"bus.url must start with redis://, rediss:// or unix:// (or be empty), not "
             f"{c.bus.url.split('://')[0][:20]!r}://")  # never the rest: it may hold a password
    require(":" not in c.bus.url.split("://")[-1].rpartition("@")[0],
             "bus.url holds a password, which would be copied into the run's log: remove it and put it in "
             "bus.password_file (mode 0600) or REEL_BUS_PASSWORD")
    require(not (c.bus.tls_ca or c.bus.tls_cert or c.bus.tls_key) or c.bus.url.startswith("rediss://"),
             "bus.tls_ca, bus.tls_cert and bus.tls_key need a rediss:// bus.url")
    require(bool(c.bus.tls_cert) == bool(c.bus.tls_key), "bus.tls_cert and bus.tls_key go together; set both or neither")
    every = c.log.keep_checkpoints_every
    require(not every or every % c.trainer.checkpoint_every == 0,
             f"log.keep_checkpoints_every = {every} keeps the checkpoints of steps divisible by it, but checkpoints "
             f"are written every trainer.checkpoint_every = {c.trainer.checkpoint_every} steps: make it a multiple")
    require(not every or c.log.keep_checkpoints > 0,
             "log.keep_checkpoints_every needs log.keep_checkpoints > 0 (0 keeps every checkpoint already)")
    require(c.bus.partitions >= 1, f"bus.partitions = {c.bus.partitions} must be at least 1")
    require(not c.bus.cluster or c.bus.url.split("://")[0] in ("redis", "rediss"),
             "bus.cluster = true needs bus.url = redis://HOST:PORT naming a node of the cluster "
             "(the embedded Redis is not a cluster)")
    b = c.blobs
    require(bool(b.mooncake_master) == bool(b.mooncake_metadata),
             "blobs.mooncake_master and blobs.mooncake_metadata name a running store together; set both or neither")
    require(b.backend == "file" or c.engine.kind == "builtin",
             'blobs.backend = "mooncake" needs engine.kind = "builtin" (vLLM loads weights from files); '
             'use blobs.backend = "file"')
    require(b.mooncake_segment_bytes > 0 and b.mooncake_buffer_bytes > 0,
             "blobs.mooncake_segment_bytes and blobs.mooncake_buffer_bytes must be > 0")
    validate_engine(c.engine, router_replay=c.trainer.router_replay)
    require(len(set(c.metrics.sinks)) == len(c.metrics.sinks),
             f"metrics.sinks = {c.metrics.sinks} names a sink twice; list each once")
    validate_bounds(c)  # ranges of counts, intervals and sizes; the memory the shapes need
    _validate_eval(c)
    require(c.mismatch.every >= 0, f"mismatch.every = {c.mismatch.every} must be >= 0 (0 = no mismatch role)")
    require(c.mismatch.max_lag_steps >= 0, f"mismatch.max_lag_steps = {c.mismatch.max_lag_steps} must be >= 0")
    require(0 <= c.mismatch.nice <= 19, f"mismatch.nice = {c.mismatch.nice} must be in 0..19 (19: the lowest CPU priority)")


def check_model_path(c: Config, text: str) -> None:
    """model.path (if set) is a readable Qwen3-MoE checkpoint with a tokenizer, and no key given in
    the config `text`'s [model] contradicts its config.json.

    Checked where this machine must read the checkpoint (`reel run`), not at every load: a Slurm
    launch renders paths that may exist only on the compute nodes.
    """
    from reel.runtime.model.config import ModelError, read_checkpoint_config  # torch-free

    model = c.model
    if not model.path:
        return
    given = tomllib.loads(text).get("model", {})

    try:
        checkpoint = read_checkpoint_config(Path(model.path))
    except ModelError as exc:
        raise ConfigError(f"model.path = {model.path!r}: {exc}") from exc
    for key, value in given.items():
        if key != "path" and key in checkpoint.__struct_fields__ and getattr(checkpoint, key) != value:
            raise ConfigError(f"model.{key} = {value!r} contradicts {Path(model.path) / 'config.json'} "
                              f"({key} = {getattr(checkpoint, key)!r}); remove it, the checkpoint decides")
    path = Path(model.path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"model.path = {model.path!r} has no tokenizer (tokenizer.json or tokenizer_config.json); "
                          "save the checkpoint's tokenizer into it")


def _validate_eval(c: Config) -> None:
    e = c.eval
    require(e.every >= 0, f"eval.every = {e.every} must be >= 0 (0 = no evaluation)")
    if e.every == 0:
        return
    require(e.prompts >= 1, f"eval.prompts = {e.prompts} must be at least 1")
    require(e.samples_per_prompt >= 1, f"eval.samples_per_prompt = {e.samples_per_prompt} must be at least 1")
    require(e.temperature > 0, f"eval.temperature = {e.temperature} must be > 0")
    require(e.max_tokens >= 0, f"eval.max_tokens = {e.max_tokens} must be >= 0 (0 = rollout.max_tokens)")
    # The eval role runs its own engine; a shared `vllm serve` holds the rollout's version, not the one evaluated.
    require(c.engine.kind == "builtin" or c.engine.vllm_server == "inprocess",
             f"eval.every = {e.every} needs an engine of its own: engine.kind = \"builtin\", or "
             "engine.vllm_server = \"inprocess\"")


def _validate_context_parallel(t: TrainerSection) -> None:
    cp = t.context_parallel
    require(cp >= 1 and t.ranks % cp == 0,
             f"trainer.context_parallel = {cp} must be at least 1 and divide trainer.ranks = {t.ranks}; "
             "pick a divisor of trainer.ranks (1 = no context parallelism)")
    if cp == 1:
        return
    # Each of these couples a rank's tokens to tokens another CP rank holds; none is reduced across the group.
    require(t.expert_parallel == 1, f"trainer.context_parallel = {cp} with trainer.expert_parallel = "
             f"{t.expert_parallel} is not supported; set one of them to 1")
    require(t.objective != "mis", f"trainer.context_parallel = {cp} splits sequences, and trainer.objective = "
             "\"mis\" weighs each whole sequence; use tis, icepop or none, or set context_parallel = 1")
    require(t.aux_loss_coef == 0, f"trainer.context_parallel = {cp} splits sequences, and the load-balancing "
             "loss (trainer.aux_loss_coef) is a product of means over them; set aux_loss_coef = 0 or "
             "context_parallel = 1")
