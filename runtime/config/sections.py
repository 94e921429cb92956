"""The schema of a run's TOML: one msgspec Struct per section, a comment on every field.

`reel config schema` (runtime/config/schema.py) reads these comments; run.py decodes a file into
`Config` and checks.py checks it across keys.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from reel.runtime.config.engine import EngineSection, Precision


Objective = Literal["tis", "icepop", "mis", "none"]


class RunSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "run"  # run directory name under out_dir and the stream namespace
    seed: int = 0  # seeds warm-start, prompts, sampling and training
    steps: int = 10  # trainer steps; the run ends after the last commit
    out_dir: str = "runs"  # parent of the run directory
    # A role without progress this long (or 5x its slowest progress so far, if longer: a slow step is not
    # a stall) is named by the launcher in one line (runtime/launch/liveness.py, runtime/heartbeat.py).
    stall_s: float = 120.0


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
    # A Redis that stops answering (a paused VM, a failover, a long fork) is retried with backoff for up to
    # this many seconds, and the wait logged; only a longer pause stops the run (bus/redis_boundary.py).
    # 60 s: as long as a role should wait for a server to come back (a Kafka producer retries for 120 s). 0 = never.
    ride_out_s: float = 60.0


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
    # env.respond calls (tool calls, rewards) at once per worker, off its event loop (producers/tool_calls.py):
    # a coroutine respond is awaited, a plain one runs on a pool of this many threads
    tool_concurrency: int = 64
    # Seconds an env.respond may take (waiting for a slot included) before it is cut: its episode ends
    # with reward 0 and the reason in the trajectory (Sample.env_error); the run goes on
    tool_timeout_s: float = 60.0


class EnvSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # reverse_text | sort_digits | arith | calc_tool | slow_calc, or "package.module:factory" (producers/envs/registry.py)
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
    # How a policy version is published (runtime/weights/publish.py): "manifest" = shards written in place
    # and verified shard by shard; "safetensors" = one whole-model blob (the format of older logs).
    weight_format: Literal["manifest", "safetensors"] = "manifest"
    weight_shard_mb: int = 64  # bytes per manifest shard, in MiB (the loader's extra memory is about one per thread)
    # Also publish each version as a sparse delta against the previous one (runtime/weights/delta.py) when
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
    # Checkpoints (12 bytes a parameter: most of a big run's disk) kept: the newest keep_checkpoints, plus
    # those of steps divisible by keep_checkpoints_every (a multiple of trainer.checkpoint_every); 0 = all.
    # Steps after the oldest kept checkpoint replay bit for bit; older ones not (`reel replay step` says
    # which checkpoint they need), though their trajectories stay for `reel retrain` (bus/retention.py).
    keep_checkpoints: int = 0
    keep_checkpoints_every: int = 0  # 0 = none besides the newest keep_checkpoints


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


class MismatchSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The mismatch role (consumers/mismatch.py): each step's mismatch split into engine numerics and policy
    drift, as MismatchSplit events, computed beside the trainer (never in its step), lagging as it must."""

    # Split steps K, 2K, ... and the last; 1 = every step; 0 = no mismatch role (large models: the role
    # holds a whole copy of the model and scores each batch once per policy version it spans).
    every: int = 1
    # How far (in steps) the role may fall behind the trainer and still find the weights it scores with: the
    # blob store keeps this many more policy versions (bus/retention.py). A step further behind is passed over
    # with a warning (`reel replay step N` still computes its split).
    max_lag_steps: int = 8
    # The role's CPU priority (os.nice increment, 0..19). 19, the lowest, gives it only the CPU the trainer and
    # rollout workers leave, so its forward passes never slow a step or a rollout; it lags instead (lag_steps).
    nice: int = 19


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
    mismatch: MismatchSection = msgspec.field(default_factory=MismatchSection)
