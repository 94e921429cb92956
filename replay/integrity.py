"""Do the run directory's files still match the hashes its log names? (`reel log verify`, and replay
when a step does not reproduce: tampering is named as tampering, not as non-determinism.)

    init/        the version-0 weights: their safetensors blob hashes to WeightsPublished(version 0)
    blobs/       every blob an event names (routing traces, checkpoints, weights) that is present
                 hashes to its BlobRef; a missing routing trace or checkpoint is a problem (replay
                 needs them), a missing weights blob is not (versions are transient), nor a
                 checkpoint a CheckpointsPruned names (retention deleted it: bus/retention.py)
    checkpoints/ a DCP checkpoint's files match the manifest the commit's checkpoint blob holds
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobError, BlobMissing
from reel.bus.errors import ReelError
from reel.bus.events import AnyEvent, BlobRef, CheckpointsPruned, RoutingTrace, StepCommitted, WeightsPublished
from reel.bus.run_log import RunLog

__all__ = ["run_file_problems", "tampering_note"]


def run_file_problems(run_dir: Path) -> tuple[int, list[str]]:
    """(files checked, one sentence per file that does not match the log)."""
    blobs = BlobStore(run_dir / "blobs")
    checked, problems = 0, []
    with RunLog(run_dir, readonly=True) as run_log:
        events = [e for name in run_log.names() for _, e in run_log.events(name)]
    pruned = {step for e in events if isinstance(e, CheckpointsPruned) for step in e.steps}
    for what, ref, required in _named_blobs(events, pruned):
        checked += 1
        if problem := _blob_problem(blobs, ref, what, required):
            problems.append(problem)
    version_zero = next((e for e in events if isinstance(e, WeightsPublished) and e.version == 0), None)
    if version_zero is not None and (run_dir / "init").is_dir():
        checked += 1
        if problem := _init_problem(run_dir, blobs, version_zero):
            problems.append(problem)
    for commit in (e for e in events if isinstance(e, StepCommitted) and e.checkpoint and e.world_size > 1
                   and e.step not in pruned):
        checked += 1
        if problem := _dcp_problem(run_dir, blobs, commit):
            problems.append(problem)
    return checked, problems


def tampering_note(run_dir: Path) -> str:
    """"" when the run's files match its log, else a clause naming the first file that does not."""
    _, problems = run_file_problems(run_dir)
    if not problems:
        return ""
    more = f" (and {len(problems) - 1} more; see `reel log verify`)" if len(problems) > 1 else ""
    return f"the run directory was tampered with: {problems[0]}{more}"


def _named_blobs(events: list[AnyEvent], pruned: set[int]) -> Iterator[tuple[str, BlobRef, bool]]:
    for event in events:
        match event:
            case WeightsPublished():
                yield f"the weights of version {event.version}", event.weights, False
            case RoutingTrace(blob=BlobRef() as ref):
                yield f"the routing trace of group {event.group_id}", ref, True
            case StepCommitted(checkpoint=BlobRef() as ref):
                yield f"the checkpoint of step {event.step}", ref, event.step not in pruned


def _blob_problem(blobs: BlobStore, ref: BlobRef, what: str, required: bool) -> str | None:
    if not required and not blobs.path(ref).exists() and not blobs.path(ref).is_symlink():
        return None
    try:
        blobs.get(ref)
    except BlobError as exc:
        return f"{what}: {exc}"
    return None


def _init_problem(run_dir: Path, blobs: BlobStore, version_zero: WeightsPublished) -> str | None:
    import torch  # torch: only when there is an init/
    from safetensors.torch import load as st_load

    from reel.runtime.train.initial_policy import load_initial_model
    from reel.runtime.model.weights import state_dict_bytes
    from reel.runtime.weights.load import version_bytes

    try:
        ours = state_dict_bytes(load_initial_model(run_dir))
    except ReelError as exc:
        return f"init/ cannot be read: {exc}"
    if version_zero.format == "safetensors":  # one blob: its hash is the weights' own
        actual = hashlib.sha256(ours).hexdigest()
        if actual != version_zero.weights.sha256:
            return f"init/ holds weights hashing to {actual}, the log's version 0 is {version_zero.weights.sha256}"
        return None
    try:  # a manifest of shards: compare tensor by tensor with what version 0 published
        logged = st_load(version_bytes(blobs, version_zero.weights, version_zero.format))
    except BlobMissing:
        return None  # retention deleted version 0; the checkpoints' hashes still bind the run
    except ReelError as exc:
        return f"version 0's weights cannot be read: {exc}"
    held = st_load(ours)
    differ = sorted(set(held) ^ set(logged)) or [n for n in sorted(held) if not torch.equal(held[n], logged[n])]
    if differ:
        return f"init/ does not hold the weights the log published as version 0 (tensor {differ[0]} differs)"
    return None


def _dcp_problem(run_dir: Path, blobs: BlobStore, commit: StepCommitted) -> str | None:
    from reel.runtime.checkpoint.sharded import verify_files

    assert commit.checkpoint is not None
    try:
        verify_files(blobs.get(commit.checkpoint), run_dir, source=f"the checkpoint of step {commit.step}")
    except ReelError as exc:
        return str(exc)
    return None
