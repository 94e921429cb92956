"""Every event of a Reel run: msgspec Structs in one tagged union, msgpack on the wire and on disk.

Schema rules (see DESIGN.md "Events"): a new field gets a default; a field never changes type;
an unknown tag is a `MalformedEvent` (the stream consumer sends it to dead letters).

Every event carries `run`, `producer` ("role:instance") and `seq` (per-producer counter, never
reused): `(producer, seq)` is the idempotency key readers dedupe on.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from reel.bus.errors import ReelError

__all__ = [
    "BlobRef", "Tensor", "Event", "RunStarted", "WeightsPublished", "Sample", "Trajectory",
    "RoutingTrace", "DroppedGroup", "GroupsDropped", "StepTiming", "StepCommitted", "MismatchSplit", "WorkerStats", "EvalResult",
    "ConfigChanged", "RunFinished", "CheckpointsPruned",
    "AnyEvent", "MalformedEvent", "encode", "decode", "event_key", "STREAM_OF", "stream_key",
]

# Tensor dtypes that cross the wire; names match numpy (bf16 travels as its raw 16-bit pattern).
_NUMPY_DTYPES = {
    "uint8": np.uint8, "uint16": np.uint16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16,
}


class MalformedEvent(ReelError, ValueError):
    """Bytes that are not a valid Reel event (bad msgpack, unknown tag, wrong field type)."""


class BlobRef(msgspec.Struct, frozen=True, gc=False):
    """Claim check for a payload kept in the blob store (bus/blobs.py)."""

    uri: str
    sha256: str
    nbytes: int


class Tensor(msgspec.Struct, frozen=True, gc=False):
    """A dense array as raw little-endian bytes; decoding is a zero-copy view of `data`."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        dtype = array.dtype.name
        if dtype not in _NUMPY_DTYPES:
            raise MalformedEvent(f"tensor dtype {dtype} cannot travel on the bus")
        return cls(dtype, list(array.shape), np.ascontiguousarray(array).tobytes())

    @classmethod
    def from_torch(cls, tensor: Any) -> Tensor:
        import torch

        t = tensor.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            return cls("bfloat16", list(t.shape), t.view(torch.uint16).numpy().tobytes())
        return cls.from_numpy(t.numpy())

    def numpy(self) -> np.ndarray:
        """Read-only view over `data` (no copy)."""
        np_dtype = _NUMPY_DTYPES.get(self.dtype)
        if np_dtype is None:
            raise MalformedEvent(f"unknown tensor dtype {self.dtype!r}")
        count = int(np.prod(self.shape)) if self.shape else 1
        if count * np.dtype(np_dtype).itemsize != len(self.data):
            raise MalformedEvent(
                f"tensor of shape {self.shape} and dtype {self.dtype} needs "
                f"{count * np.dtype(np_dtype).itemsize} bytes, has {len(self.data)}"
            )
        return np.frombuffer(self.data, dtype=np_dtype).reshape(self.shape)

    def torch(self) -> Any:
        """torch view over `data`; torch warns on read-only buffers, so this one copies once."""
        import torch

        array = self.numpy().copy()
        t = torch.from_numpy(array)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t


# gc=False: events hold no reference cycles, and a consumer keeps hundreds alive at once; leaving
# them out of the cyclic GC made decoding a batch ~25% cheaper.
class Event(msgspec.Struct, tag_field="type", kw_only=True, frozen=True, gc=False):
    run: str
    producer: str
    seq: int


class RunStarted(Event, tag="run_started"):
    """Launcher -> everyone: the run's configuration, fixed for its lifetime."""

    config_toml: str
    seed: int
    code_version: str
    model_config: dict[str, Any]
    config_hash: str = ""
    init_reward: float | None = None  # mean sampled reward of the warm-started policy (version 0)
    # What replay compares besides config and code (runtime/train/environment.py): trainer.ranks,
    # expert_parallel, context_parallel; torch/cuda/nccl/vllm versions ("" = absent; {} = not recorded).
    layout: dict[str, int] = {}
    libraries: dict[str, str] = {}
    cpu_count: int = 0  # cores the launcher could run on (the simulator's shared-hardware model); 0 = unknown
    cpus: list[int] = []  # which cores the trainer may run on (its affinity: pinned apart or not); [] = unknown
    dataset_sha256: str = ""  # of env.options.path's files ([env] name = "dataset"); "" = no local dataset


class WeightsPublished(Event, tag="weights_published"):
    """Trainer -> rollout workers: policy `version` (= weights after trainer `step`) is ready."""

    version: int
    step: int
    weights: BlobRef
    # "safetensors": `weights` is one whole-model safetensors blob (logs before sharded publish);
    # "manifest": `weights` is a bus/weight_manifest.py WeightManifest naming the version's shards.
    format: str = "safetensors"


class Sample(msgspec.Struct, frozen=True, gc=False):
    """One completion of a GRPO group."""

    tokens: Tensor  # int32 [C] completion token ids
    logprobs: Tensor  # float32 [C] log mu(token) under the sampling distribution
    reward: float
    finish_reason: str  # "stop" | "length" | "abort"
    seed: int
    # [(first completion token index, policy version)], ascending; first index is 0.
    spans: list[tuple[int, int]]
    generate_s: float = 0.0  # seconds from the engine admitting the sample to its last token (0 = not measured)
    # Multi-turn episodes: `tokens` holds every model turn and, between them, what the env
    # appended (tool results, user turns). Those are prompt tokens: not sampled (logprob 0), never
    # trained on. Defaults describe a one-turn sample.
    env_spans: list[tuple[int, int]] = []  # [(first, end)) token ranges the env appended
    turns: int = 1  # model turns
    tool_calls: int = 0  # model turns the env answered as tool calls
    turn_lengths: list[int] = []  # tokens sampled per model turn (empty = one turn of len(tokens))
    scores: dict[str, float] = {}  # the reward's parts by name (a verifiers rubric's functions); {} = none
    # Why an env call was cut (it timed out or raised, producers/tool_calls.py): the episode ended
    # there with reward 0; "" = it ended as the env said.
    env_error: str = ""
    # Wall seconds of each env.respond (one per model turn: the tool call, or the final reward), so
    # `reel simulate` can model tool waits; [] = not recorded (older logs).
    env_s: list[float] = []


class Trajectory(Event, tag="trajectory"):
    """Rollout worker -> trainer, archiver: one finished GRPO group."""

    group_id: str
    env: str
    prompt: Tensor  # int32 [P] prompt token ids
    samples: list[Sample]
    worker: str
    meta: dict[str, Any] = {}
    temperature: float = 1.0
    generate_s: float = 0.0  # seconds from the worker starting the group to its completions (0 = not measured)


class RoutingTrace(Event, tag="routing_trace"):
    """Rollout worker -> trainer, archiver: the experts each sample's tokens were routed to.

    Per sample a uint8/uint16 Tensor [P + C - 1, moe_layers, top_k]: every token that went through a
    forward pass (the last sampled token never does). Inline when small; otherwise `blob` holds the
    msgpack of the same list[Tensor], zstd-packed (bus/logcodec.py; raw in older runs), and `experts`
    is empty.
    """

    group_id: str
    experts: list[Tensor] = []
    blob: BlobRef | None = None


class DroppedGroup(msgspec.Struct, frozen=True, gc=False):
    group_id: str
    reason: str


class GroupsDropped(Event, tag="groups_dropped"):
    """Trainer -> rollout workers: groups it set aside while gathering step `step`'s batch, announced before
    that step's commit lists them again in StepCommitted.dropped, so their workers replace them now: a
    synchronous worker waits for that commit, which waits for the replacement (producers/async_gate.py).
    Logs from before this event have the drops in the commits only."""

    step: int  # the step (and policy version) whose batch they are missing from
    dropped: list[DroppedGroup]


class StepTiming(msgspec.Struct, frozen=True, gc=False):
    """Wall seconds of one trainer step; idle = wait / (wait + compute + publish).

    The phases follow each other: commit (of the previous step), wait, compute, publish; within compute,
    score_old + forward_backward + optimizer <= compute (the rest of compute: batch assembly, the
    weight digest, the thread hand-off). 0 = not recorded (logs before these fields)."""

    wait: float  # reading the bus until batch_groups groups are ready
    compute: float  # batch assembly + train_step
    publish: float  # new weights (and the checkpoint when due) to the blob store
    score_old: float = 0.0  # in compute: the batch scored by the weights before the update (pi_old)
    forward_backward: float = 0.0  # in compute: the loss's forward and backward passes, every micro-batch
    optimizer: float = 0.0  # in compute: gradient clipping, the finite checks, the optimizer step
    # The previous step's commit protocol after its StepCommitted was stamped (the atomic publish, the
    # acks, retention): it cannot time itself, so the next step records it; it ran just before `wait`.
    commit: float = 0.0


class StepCommitted(Event, tag="step_committed"):
    """Trainer -> everyone: step `step` is done; its groups are never trained again."""

    step: int
    version: int
    groups: list[str]
    dropped: list[DroppedGroup]
    loss: float
    grad_norm: float
    weights_sha256: str
    timing: StepTiming
    metrics: dict[str, float] = {}
    staleness: dict[int, int] = {}  # versions behind -> token count
    checkpoint: BlobRef | None = None
    config_hash: str = ""
    code_version: str = ""
    world_size: int = 1  # trainer ranks that computed the step (replay re-executes on as many)
    layout: dict[str, int] = {}  # as RunStarted.layout, for this step
    libraries: dict[str, str] = {}  # as RunStarted.libraries, of the trainer that computed it
    # CPU seconds of the trainer process (all its threads) over timing.compute: with the wall
    # seconds, the cores the trainer demands (the simulator's shared-hardware model). 0 = not recorded.
    cpu_s: float = 0.0


class MismatchSplit(Event, tag="mismatch_split"):
    """Mismatch role (consumers/mismatch.py) -> metrics, sinks, report, replay: step `step`'s train/inference
    mismatch split into engine numerics KL(mu || pi_v) and policy drift KL(pi_v || pi_old)
    (runtime/train/mismatch_split.py), computed off the trainer's step; `reel replay step` recomputes it."""

    step: int
    figures: dict[str, float]  # mismatch_split.SPLIT_KEYS: numerics_k1..k3, drift_k1..k3, split_tokens
    versions: list[int]  # the older policy versions whose weights the split scored the batch with
    missing_versions: list[int] = []  # versions whose weights were gone (their tokens left out of split_tokens)
    lag_steps: int = 0  # committed steps beyond `step` when this one was published (how far the role lags)
    lag_s: float = 0.0  # seconds from the step's commit to this event
    compute_s: float = 0.0  # wall seconds the role spent on this step
    cpus: list[int] = []  # which cores the role may run on (its affinity; the simulator's shared cores); [] = unknown
    nice: int = 0  # the role's CPU priority (os.getpriority): how much of a shared core it takes


class WorkerStats(Event, tag="worker_stats"):
    """Rollout worker -> metrics: periodic throughput and lag."""

    worker: str
    tokens_per_s: float
    running: int
    waiting: int
    policy_version: int
    groups_published: int
    idle_share: float = 0.0
    # Engine counters since the worker started (deltas between two stats give the mean decode-step
    # time and batch occupancy over the interval: what `reel simulate` calibrates on).
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens sampled, one per running sequence per decode step
    forward_tokens: int = 0  # tokens fed through the model: decode_tokens plus the prompts' prefill
    busy_s: float = 0.0  # seconds the engine spent decoding
    # The same by batch size: [sequences, decode steps, prompt tokens prefilled, seconds] for each batch size
    # the engine ran, since the worker started ([] = not recorded: vLLM, or logs from before 2026-12-05).
    decode_batches: list[tuple[int, int, int, float]] = []
    swap_s: list[float] = []  # weight swaps since the last stats: seconds from reading the event to live
    # Samples since the worker started whose version spans were assumed (the engine, vLLM, sent no
    # weight_versions): each is labelled with the version it started under.
    version_spans_assumed: int = 0
    # CPU seconds of the worker process (all its threads) since it started: deltas over active wall
    # time give the cores the rollout side demands (the simulator's shared-hardware model). 0 = not recorded.
    cpu_s: float = 0.0
    # Where the worker's wall time went since it started: busy_s (the engine decoding) + tool_wait_s
    # (the engine idle while at least one episode waits on its env or tool) + idle_s (the engine idle
    # with nothing waiting: no prompt admitted, held by the async gate) = wall seconds. 0 = not recorded.
    tool_wait_s: float = 0.0
    idle_s: float = 0.0
    cpus: list[int] = []  # which cores the worker may run on (its affinity; the simulator's shared cores); [] = unknown


class EvalResult(Event, tag="eval_result"):
    """Eval role (or `reel eval`) -> metrics, sinks, compare, report: held-out scores of one version."""

    version: int
    step: int  # trainer step that produced the version
    env: str  # the eval env's name
    prompts: int
    samples_per_prompt: int  # k of pass@k
    mean_reward: float
    pass_at_1: float
    pass_at_k: float
    per_task: dict[str, float] = {}  # task -> mean reward, for mixtures
    skipped_versions: list[int] = []  # versions passed over since the last result (eval runs behind)
    wall_s: float = 0.0


class ConfigChanged(Event, tag="config_changed"):
    """Launcher -> everyone: `--resume` continued the run after step `after_step`, with the keys it changed
    (safe ones; none when only resumed). After a RunFinished it means the run went on."""

    config_toml: str  # the whole config as it now runs
    changed: dict[str, list[Any]]  # key -> [old, new]
    after_step: int


class CheckpointsPruned(Event, tag="checkpoints_pruned"):
    """Trainer -> log readers (verify, replay, du): the checkpoints of `steps` are deleted by retention
    (bus/retention.py, log.keep_checkpoints); published before they are, so a missing checkpoint is
    either named here or damage. Replay rebuilds a step from the newest checkpoint still kept."""

    steps: list[int]  # commits whose checkpoint is deleted (their events stay in the log)
    after_step: int  # the newest committed step when the policy let them go
    keep_last: int  # the policy then: the newest checkpoints kept ...
    keep_every: int = 0  # ... and those of steps divisible by this (0 = none)


class RunFinished(Event, tag="run_finished"):
    """Launcher -> everyone: the run is over, or (not "completed") ended before its last step."""

    reason: str  # "completed" | "failed: <role> exited <code>" | "stopped: <SIGNAL>" (a --resume may follow)
    dead_letters: int = 0  # entries ever dead-lettered, so a finished run's log knows them (metrics)


AnyEvent = Union[
    RunStarted, WeightsPublished, Trajectory, RoutingTrace, StepCommitted, WorkerStats, EvalResult,
    ConfigChanged, RunFinished, MismatchSplit, CheckpointsPruned, GroupsDropped,
]

# Which stream each event type travels on (DESIGN.md "Events").
STREAM_OF: dict[type, str] = {
    RunStarted: "control",
    WeightsPublished: "weights",
    Trajectory: "trajectories",
    RoutingTrace: "routing",
    StepCommitted: "steps",
    GroupsDropped: "steps",
    MismatchSplit: "steps",
    WorkerStats: "control",
    EvalResult: "control",
    ConfigChanged: "control",
    RunFinished: "control",
    CheckpointsPruned: "control",
}
STREAMS = ("control", "weights", "trajectories", "routing", "steps")


def stream_key(run: str, stream: str) -> str:
    """Redis key of a run's stream; the hash tag keeps a run on one cluster slot."""
    return f"reel:{{{run}}}:{stream}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


def encode(event: AnyEvent) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> AnyEvent:
    """Decode one event; anything malformed raises MalformedEvent and nothing else."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedEvent(str(exc)) from exc
    except Exception as exc:  # msgspec can raise e.g. RecursionError on adversarial nesting
        raise MalformedEvent(f"{type(exc).__name__}: {exc}") from exc


def event_key(event: Event) -> tuple[str, int]:
    """The idempotency key of an event."""
    return (event.producer, event.seq)
