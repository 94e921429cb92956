"""The archiver's `blobs` step: with a blob store other than the run's blobs/ (Mooncake), every blob
an archived event names is copied into blobs/ before the event is logged, so a replay never depends
on a live store. A weight manifest's shards are copied with it.
"""

from __future__ import annotations

import logging

import msgspec

from reel.bus import weight_manifest
from reel.bus.blobs import BlobBackend
from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import AnyEvent, BlobRef, RoutingTrace, StepCommitted, WeightsPublished

log = logging.getLogger(__name__)


def event_blobs(event: AnyEvent) -> list[BlobRef]:
    """The blobs an event names (what a replay of the run reads)."""
    match event:
        case WeightsPublished():
            return [event.weights]
        case RoutingTrace(blob=BlobRef() as ref) | StepCommitted(checkpoint=BlobRef() as ref):
            return [ref]
    return []


def copy_blobs(store: BlobBackend, files: BlobStore, refs: list[BlobRef], manifests: list[BlobRef]) -> None:
    """Copy `refs` and the shards of the weight `manifests` from `store` into `files`, skipping what is there."""
    for ref in refs:
        if not files.path(ref).is_file():
            files.put(store.get(ref))  # get checks the sha256 the event names
    for ref in manifests:
        try:
            manifest = weight_manifest.decode_manifest(files.get(ref))
        except msgspec.DecodeError as exc:
            log.warning("weight manifest %s is not a WeightManifest (%s); its shards are not copied", ref.sha256, exc)
            continue
        for shard in weight_manifest.blob_refs(ref, manifest)[1:]:
            if not files.path(shard).is_file():
                files.put(store.get(shard))
