"""One TOML schema for a run, decoded strictly with msgspec.

Every error a user can cause here is a `ConfigError` whose message names the key and what is
expected, e.g. "trainer.batch_groups = 64 exceeds ...; lower it or raise rollout.concurrency".
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec
import tomli_w

from reel.runtime.config_bounds import validate_bounds
from reel.runtime.config_engine import EngineSection, Precision, validate_engine
from reel.runtime.config_keys import ConfigError, name_key, require

Objective = Literal["tis", "icepop", "mis", "none"]


# env.name is checked against the env registry, reached by name (runtime/ never imports producers/).
ENV_NAME_CHECK = "reel.producers.envs.registry:check_name"
# ... and the task adapters' env.options (reasoning_gym, dataset, verifiers), which may read files.
ENV_OPTIONS_CHECK = "reel.producers.envs.registry:check_options"


class RunSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "run"  # run directory name under out_dir and the stream namespace
    seed: int = 0  # seeds warm-start, prompts, sampling and training
    steps: int = 10  # trainer steps; the run ends after the last commit
    out_dir: str = "runs"  # parent of the run directory


class BusSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str = ""  # redis:// | rediss:// | unix://, with an ACL user but no password; empty = embedded Redis
    password_file: str = ""  # file (mode 0600) with the Redis password; REEL_BUS_PASSWORD overrides it
    tls_ca: str = ""  # rediss://: CA certificate(s) that signed the server's certificate
    tls_cert: str = ""  # rediss://: client certificate, for servers that require one (with tls_key)
    tls_key: str = ""  # rediss://: the client certificate's private key
    block_ms: int = 1000  # XREADGROUP BLOCK time
    claim_idle_ms: int = 30_000  # pending entries idle this long are reclaimed (XAUTOCLAIM)
    max_deliveries: int = 5  # deliveries before an entry goes to the dead-letter stream
    partitions: int = 1  # trajectory and routing streams split over this many hash tags (bus/partitions.py)
    cluster: bool = False  # bus.url names a node of a Redis Cluster (also REEL_BUS_CLUSTER=1 for roles)


class ModelSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Qwen3-MoE config keys (a tiny MoE by default), or `path` to an HF-layout directory."""

    # An HF Qwen3-MoE checkpoint directory (config.json, safetensors shards + index, tokenizer
    # files): trained and served as is, with its own tokenizer; a key below given too must agree.
    path: str = ""
    vocab_size: int = 0  # 0 = the environment tokenizer's vocabulary size
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


class InitSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    from_dir: str = msgspec.field(default="", name="from")  # HF-layout weights; empty = warm-start
    # Supervised steps on the task before RL; -1 = 150 for a model built from the [model] keys,
    # 0 (start from the checkpoint as is) with model.path. Read it through `warmup_steps(config)`.
    warmup_steps: int = -1
    warmup_lr: float = 3e-3
    warmup_batch: int = 32
    warmup_noise: float = 0.3  # label smoothing of the warm-start loss: right at greedy, noisy when sampled


class RolloutSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    workers: int = 1  # rollout worker processes
    concurrency: int = 8  # GRPO groups in flight per worker
    group_size: int = 8  # samples per prompt
    async_level: int = 1  # max versions ahead of the last commit (0 = synchronous)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stats_every_s: float = 2.0


class EnvSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # reverse_text | sort_digits | arith | calc_tool, or "package.module:factory" (producers/envs/registry.py)
    name: str = "reverse_text"
    min_len: int = 3  # reverse_text, sort_digits: question characters
    max_len: int = 6
    # Long-tail completion lengths for `reel bench async`: share of prompts asking for max_tokens.
    long_tail: float = 0.0
    options: dict[str, Any] = {}  # keyword arguments of the env's factory ([env.options]; arith, calc_tool, yours)


class TrainerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    objective: Objective = "tis"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    batch_groups: int = 8  # GRPO groups per step
    micro_batch_tokens: int = 0  # 0 = one micro-batch per step (no packing)
    optimizer_steps: int = 1  # >1 enables PPO clipping
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    # log ρ = log π_θ/π_old is clamped to ±ratio_clamp (verl's 20) so optimizer_steps > 1 cannot
    # overflow the loss; dual_clip caps a negative-advantage token's loss at dual_clip·|A| (verl's
    # 3, Ye et al. 2020), 0 = off. Both are inert on the first optimizer step (ρ = 1). docs/numerics.md
    ratio_clamp: float = 20.0
    dual_clip: float = 3.0  # cap of a negative-advantage token's loss, in units of |A| (0 = off; verl's 3)
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    max_off_policy_steps: int = 4
    router_replay: bool = True
    aux_loss_coef: float = 0.0
    precision: Precision = "fp32"
    checkpoint_every: int = 5
    threads: int = 0  # torch threads of the trainer (part of bit-exactness); 0 = 1
    # Fault injection, to rehearse debugging (`reel replay bisect`): step lr_spike_step (0 = none)
    # trains with lr x lr_spike_factor. Part of the config hash, so replay reproduces it.
    lr_spike_step: int = 0
    lr_spike_factor: float = 1.0
    ranks: int = 1  # processes of the one logical trainer (FSDP2; `reel run` starts them with torchrun)
    # Ranks of an expert-parallel group (runtime/model/expert_parallel.py): each holds num_experts / E
    # whole experts and tokens travel to them; divides ranks and model.num_experts. 1 = no EP.
    expert_parallel: int = 1
    # Ranks of a context-parallel group (runtime/model/context_parallel.py): they split each micro-batch's
    # positions and run ring attention; divides ranks (the batch is split over ranks / C groups). CUDA
    # only; not with expert_parallel > 1, objective = "mis" or aux_loss_coef > 0. 1 = no CP.
    context_parallel: int = 1
    # How a policy version is published (runtime/weight_publish.py): "manifest" = shards written in place
    # and verified shard by shard; "safetensors" = one whole-model blob (the format of older logs).
    weight_format: Literal["manifest", "safetensors"] = "manifest"
    weight_shard_mb: int = 64  # bytes per manifest shard, in MiB (the loader's extra memory is about one per thread)
    # Also publish each version as a sparse delta against the previous one (runtime/weight_delta.py) when
    # that is smaller: workers holding the previous version read only what changed. Pays for bf16 shards.
    weight_delta: bool = False


class BlobsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    backend: Literal["file", "mooncake"] = "file"  # where weights and big routing traces go (bus/blob_backends/)
    # Mooncake (backend = "mooncake"); the run's blobs/ still gets a copy of every blob an event names.
    mooncake_master: str = ""  # host:port of a running master; empty = `reel run` / the Slurm job start one
    mooncake_metadata: str = ""  # its metadata server, http://host:port/metadata (with mooncake_master)
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""  # RDMA device names (protocol = "rdma"), e.g. "mlx5_0"
    mooncake_segment_bytes: int = 1 << 30  # memory of the holder process started with the master
    mooncake_buffer_bytes: int = 64 << 20  # each client's local transfer buffer


class LogSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    segment_bytes: int = 64 * 1024 * 1024
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"  # Python logging level of each role
    # Weight versions are deleted from the blob store once no worker or trainer step can need them
    # (bus/retention.py); also keep every version divisible by this. 0 = none (replay re-derives them).
    keep_weights_every: int = 0


Tracker = Literal["wandb", "tensorboard", "mlflow"]


class MetricsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    sinks: list[Tracker] = []  # trackers `reel run` feeds as roles (consumers/sinks/); needs the `tracking` extra
    tensorboard_dir: str = ""  # TensorBoard event files; empty = RUN_DIR/tracking/tensorboard
    mlflow_tracking_uri: str = ""  # any MLflow tracking URI; empty = SQLite at RUN_DIR/tracking/mlflow.db
    mlflow_experiment: str = "reel"  # MLflow experiment that holds the run
    wandb_dir: str = ""  # W&B offline run files go under its wandb/; empty = RUN_DIR/tracking
    wandb_project: str = "reel"  # W&B project the offline run is synced into


class EvalSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The eval role (producers/evaluator.py): held-out scores of every N-th policy version, as EvalResult events."""

    every: int = 0  # evaluate versions 0, N, 2N, ... and the last; 0 = no eval role
    prompts: int = 32  # held-out prompts per evaluation (the same ones at every version)
    samples_per_prompt: int = 4  # k of pass@k
    temperature: float = 1.0  # sampling temperature of the held-out samples
    max_tokens: int = 0  # per model turn; 0 = rollout.max_tokens
    pass_threshold: float = 1.0  # a sample passes (pass@k) when its reward is at least this
    seed: int = 1  # draws the held-out prompts and the sampling seeds
    env: EnvSection | None = None  # [eval.env]; default: the run's env, its held-out split (Env.held_out)


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    run: RunSection = msgspec.field(default_factory=RunSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    init: InitSection = msgspec.field(default_factory=InitSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    blobs: BlobsSection = msgspec.field(default_factory=BlobsSection)
    log: LogSection = msgspec.field(default_factory=LogSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)


def loads(text: str, source: str = "config") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from exc
    return from_dict(raw, source)


def from_dict(raw: dict, source: str = "config") -> Config:
    """A config from parsed TOML (strict types, then the checks of `validate`)."""
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {name_key(str(exc), Config)}") from exc
    try:
        validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None  # cross-key errors name the file too
    return config


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    return loads(text, source=str(path))


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
    module, function = ENV_NAME_CHECK.split(":")
    getattr(importlib.import_module(module), function)(c.env.name)
    module, function = ENV_OPTIONS_CHECK.split(":")
    getattr(importlib.import_module(module), function)(c.env)
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


def warmup_steps(c: Config) -> int:
    """init.warmup_steps resolved: -1 means 150 for a model built from keys, 0 with model.path."""
    if c.init.warmup_steps >= 0:
        return c.init.warmup_steps
    return 0 if c.model.path else 150


def to_toml(c: Config) -> str:
    """The resolved config (defaults filled in) as TOML text that `loads` reads back to `c`."""
    return tomli_w.dumps(_without_none(msgspec.to_builtins(c)))


def _without_none(table: dict) -> dict:
    """TOML has no null: an unset optional section (eval.env) is left out, which reads back as unset."""
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}



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
    if e.env is not None:
        module, function = ENV_OPTIONS_CHECK.split(":")
        try:
            getattr(importlib.import_module(module), function)(e.env)
        except ConfigError as exc:
            raise ConfigError(f"eval.{exc}") from None  # its keys are eval.env.*


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


def config_hash(c: Config) -> str:
    """Hash of what determines a training step's result: the seed, the model and the trainer.

    Not trainer.ranks, expert_parallel nor context_parallel: every commit records its world size, and
    a replay on another layout is a deviation to measure, not a different config."""
    trainer = msgspec.structs.asdict(c.trainer)
    for layout_key in ("ranks", "expert_parallel", "context_parallel"):
        trainer.pop(layout_key)
    for publish_key in ("weight_format", "weight_shard_mb", "weight_delta"):  # how versions are written, not what they hold
        trainer.pop(publish_key)
    keys = msgspec.json.encode([c.run.seed, c.model, trainer])
    return hashlib.sha256(keys).hexdigest()[:16]


def cache_dir(kind: str) -> Path:
    """$REEL_CACHE/KIND (default ~/.cache/reel/KIND): what Reel rebuilds when it is missing."""
    return Path(os.environ.get("REEL_CACHE", Path.home() / ".cache" / "reel")) / kind
