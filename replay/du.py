"""`reel log du --run DIR [--json]`: where a run's bytes are, per step and per trained token, and what
they would come to at real model sizes (replay/extrapolate.py; labelled as a calculation).

Kinds: weight versions and checkpoints (blobs the WeightsPublished / StepCommitted events name),
trajectories and routing traces (their log streams, plus trace blobs), other events (every other
stream), other blobs (named by no event: e.g. weights of a step that crashed before its commit) and
the Redis append-only file of an embedded server (run_dir/redis). `routing_at_rest_ratio` is the
routing traces' bytes as they were produced (events as on the bus, trace blobs unpacked) over their
bytes on disk (bus/logcodec.py packs both; a run written before that measures about 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef, CheckpointsPruned, RunStarted, StepCommitted, WeightsPublished
from reel.bus.jsonout import print_json
from reel.bus.run_log import RunLog
from reel.bus.logcodec import HEAD_BYTES, unpacked_size
from reel.bus.retention import CheckpointPolicy
from reel.bus.weight_manifest import blob_refs, decode_manifest
from reel.replay.extrapolate import SHAPES, Extrapolated, extrapolate, shape_of
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load_run_config
from reel.runtime.model.config import MoEConfig, read_checkpoint_config

SUGGESTED_KEEP_CHECKPOINTS = 3  # what `du` shows log.keep_checkpoints would save, when it is 0
KINDS = ("weight_versions", "checkpoints", "trajectories", "routing_traces", "other_events", "other_blobs",
         "redis_aof")


class _TraceBlob(msgspec.Struct):
    """The blob of a RoutingTrace, decoded without the rest of the event."""

    blob: BlobRef | None = None


_trace_blob = msgspec.msgpack.Decoder(_TraceBlob)


class Usage(msgspec.Struct, kw_only=True):
    run_dir: str
    steps: int
    trained_tokens: int
    bytes: dict[str, int]  # kind -> bytes on disk
    per_step: dict[str, float]
    per_token: dict[str, float]
    weight_versions_published: int
    weight_versions_stored: int
    checkpoints: int  # written (commits naming one)
    checkpoints_pruned: int  # of them, deleted by retention (log.keep_checkpoints; CheckpointsPruned events)
    checkpoint_bytes_pruned: int  # what those held (their blobs' sizes as the commits name them)
    routing_at_rest_ratio: float  # routing traces' bytes as produced / their bytes on disk (0: none logged)
    extrapolation: list[Extrapolated]
    # With log.keep_checkpoints = 0 (every checkpoint kept): the same with SUGGESTED_KEEP_CHECKPOINTS kept.
    bounded: list[Extrapolated] = []


def measure(run_dir: Path, config: Config, steps: int, tokens_per_step: int) -> Usage:
    store = BlobStore(run_dir / "blobs")
    stored = store.keys()
    sizes = dict.fromkeys(KINDS, 0)
    named: set[str] = set()
    commits: list[StepCommitted] = []
    versions: list[WeightsPublished] = []
    model: MoEConfig | None = None
    pruned: set[int] = set()  # checkpoint steps retention deleted
    routing_ratio, packed_away = 0.0, 0  # packed_away: bytes the routing log saves by packing
    with RunLog(run_dir, readonly=True) as run_log:
        for stream in run_log.names():
            kind = {"trajectories": "trajectories", "routing": "routing_traces"}.get(stream, "other_events")
            sizes[kind] += sum(p.stat().st_size for p in (run_log.root / stream).iterdir() if p.is_file())
        if "weights" in run_log.names():
            versions = [e for _, e in run_log.events("weights") if isinstance(e, WeightsPublished)]
        if "steps" in run_log.names():
            commits = [e for _, e in run_log.events("steps") if isinstance(e, StepCommitted)]
        if "control" in run_log.names():
            control = [e for _, e in run_log.events("control") if isinstance(e, (RunStarted, CheckpointsPruned))]
            model = next((MoEConfig.from_hf_dict(e.model_config) for e in control if isinstance(e, RunStarted)), None)
            pruned = {step for e in control if isinstance(e, CheckpointsPruned) for step in e.steps}
        if "routing" in run_log.names():
            produced, trace_blobs = 0, {}
            for record in run_log.stream("routing").records():
                produced += len(record.data)
                if (ref := _trace_blob.decode(record.data).blob) is not None:
                    trace_blobs[ref.sha256] = ref
            on_disk = sum(p.stat().st_size for p in (run_log.root / "routing").glob("*.seg"))
            for sha in trace_blobs.keys() & stored.keys():
                with open(store.path(trace_blobs[sha]), "rb") as f:
                    produced += unpacked_size(f.read(HEAD_BYTES), stored[sha])
                on_disk += stored[sha]
            routing_ratio = produced / on_disk if on_disk else 0.0
            packed_away = max(produced - on_disk, 0)
            sizes["routing_traces"] += _claim(set(trace_blobs), stored, named)
    weight_shas = {ref.sha256 for event in versions for ref in _version_refs(event, store)}
    stored_versions = sum(1 for event in versions if event.weights.sha256 in stored)
    sizes["checkpoints"] = _claim({c.checkpoint.sha256 for c in commits if c.checkpoint}, stored, named)
    sizes["weight_versions"] = _claim(weight_shas, stored, named)
    sizes["other_blobs"] = sum(n for sha, n in stored.items() if sha not in named)
    sizes["redis_aof"] = sum(p.stat().st_size for p in (run_dir / "redis").rglob("*") if p.is_file()
                             and "aof" in p.name) if (run_dir / "redis").is_dir() else 0
    tokens = sum(int(c.metrics.get("tokens", sum(c.staleness.values()))) for c in commits)
    model = _model_of(config) or model
    basis = ({**sizes, "routing_traces": sizes["routing_traces"] + packed_away}, tokens, model, config, steps,
             tokens_per_step)
    return Usage(
        run_dir=str(run_dir), steps=len(commits), trained_tokens=tokens, bytes=sizes,
        per_step={k: v / len(commits) for k, v in sizes.items()} if commits else {},
        per_token={k: v / tokens for k, v in sizes.items()} if tokens else {},
        weight_versions_published=len(versions), weight_versions_stored=stored_versions,
        checkpoints=sum(1 for c in commits if c.checkpoint),
        checkpoints_pruned=sum(1 for c in commits if c.checkpoint and c.step in pruned),
        checkpoint_bytes_pruned=sum(c.checkpoint.nbytes for c in commits if c.checkpoint and c.step in pruned),
        routing_at_rest_ratio=round(routing_ratio, 2),
        extrapolation=_extrapolations(*basis), bounded=[] if config.log.keep_checkpoints else
        _extrapolations(*basis, keep_last=SUGGESTED_KEEP_CHECKPOINTS),
    )


def _claim(shas: set[str], stored: dict[str, int], named: set[str]) -> int:
    """Bytes of the stored blobs among `shas` not yet counted under another kind."""
    mine = (shas & stored.keys()) - named
    named |= mine
    return sum(stored[sha] for sha in mine)


def _version_refs(event: WeightsPublished, store: BlobStore) -> list[BlobRef]:
    if event.format != "manifest" or event.weights.sha256 not in store.keys():
        return [event.weights]
    return blob_refs(event.weights, decode_manifest(store.get(event.weights)))


def _model_of(config: Config) -> MoEConfig | None:
    return read_checkpoint_config(Path(config.model.path)) if config.model.path else None


def _extrapolations(sizes: dict[str, int], tokens: int, model: MoEConfig | None, config: Config,
                    steps: int, tokens_per_step: int, keep_last: int = 0) -> list[Extrapolated]:
    """The named shapes and this run's own (model.path's, else the logged model config). Routing counts
    unpacked: at real shapes expert ids are near uniform and a group's prompt is a small part of its
    tokens, so the example's packing ratio would not carry over. `keep_last` > 0 stands in for
    log.keep_checkpoints (what setting it would save)."""
    if not tokens or model is None:
        return []
    own = shape_of(f"model.path ({config.model.path})" if config.model.path else "this run's model", model)
    # Trace bytes per trained token and expert-id byte: prompt tokens and dropped groups included.
    id_bytes = own.moe_layers * own.top_k * (1 if own.num_experts <= 256 else 2)
    lag = config.mismatch.max_lag_steps if config.mismatch.every > 0 else 0  # kept for the mismatch role
    window = max(config.rollout.async_level, config.trainer.max_off_policy_steps) + 1 + lag
    policy = CheckpointPolicy(keep_last or config.log.keep_checkpoints, config.log.keep_checkpoints_every)
    return [extrapolate(shape, trajectory_bytes_per_token=sizes["trajectories"] / tokens,
                        routing_bytes_per_id=sizes["routing_traces"] / tokens / max(id_bytes, 1), steps=steps,
                        tokens_per_step=tokens_per_step, checkpoint_every=config.trainer.checkpoint_every,
                        window=window, keep_every=config.log.keep_weights_every, checkpoint_policy=policy)
            for shape in (*SHAPES, own)]


def du(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    usage = measure(run_dir, load_run_config(run_dir), args.steps, args.tokens_per_step)
    if args.json:
        print_json(usage)
        return 0
    print(f"{run_dir}: {usage.steps} steps, {usage.trained_tokens} trained tokens, "
          f"{usage.weight_versions_stored} of {usage.weight_versions_published} weight versions stored, "
          f"{usage.checkpoints - usage.checkpoints_pruned} of {usage.checkpoints} checkpoints stored")
    if usage.checkpoints_pruned:
        print(f"checkpoint retention (log.keep_checkpoints) deleted {usage.checkpoints_pruned} checkpoints, "
              f"{usage.checkpoint_bytes_pruned:,} bytes; steps before the oldest kept one no longer replay bitwise")
    print(f"{'kind':<16}{'bytes':>14}{'per step':>14}{'per token':>12}")
    for kind in KINDS:
        print(f"{kind:<16}{usage.bytes[kind]:>14,}{usage.per_step.get(kind, 0):>14,.0f}"
              f"{usage.per_token.get(kind, 0):>12,.1f}")
    print(f"{'total':<16}{sum(usage.bytes.values()):>14,}")
    if usage.routing_at_rest_ratio:
        print(f"routing traces at rest: {usage.routing_at_rest_ratio:.2f}x smaller in the log than on the bus")
    if usage.extrapolation:
        first = usage.extrapolation[0]
        print(f"\nextrapolation ({first.basis}), {first.steps} steps of {first.tokens_per_step:,} tokens:")
        print(f"{'shape':<40}{'params':>10}{'version':>10}{'ckpt':>10}{'ckpts kept':>12}{'events/step':>12}"
              f"{'before':>11}{'after':>11}")
        for e in usage.extrapolation:
            print(f"{e.shape.name:<40}{_count(e.shape.params):>10}{_size(e.weight_version_bytes):>10}"
                  f"{_size(e.checkpoint_bytes):>10}{f'{e.checkpoints_kept}/{e.checkpoints}':>12}"
                  f"{_size(e.event_bytes_per_step):>12}{_size(e.before_bytes):>11}{_size(e.after_bytes):>11}")
        for e, bounded in zip(usage.extrapolation, usage.bounded):
            print(f"log.keep_checkpoints = 0 keeps all {e.checkpoints} checkpoints; = {SUGGESTED_KEEP_CHECKPOINTS} "
                  f"would bring {e.shape.name} to {_size(bounded.after_bytes)} (from {_size(e.after_bytes)})")
    return 0


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"
