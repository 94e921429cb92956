"""The built-in engine's weights: a published version checked, then copied in place.

    verified   (while the engine serves the old version) a delta on the version the engine holds, or
               the version's full shards: hashes, names, shapes, whole experts
    load       (on the step thread, between two decode steps) the shards copied straight from the
               store's maps into the parameters, each weight once (in fp32 the engine's kernels read
               the parameters themselves: kvcache.py); a delta applied to the held tensors, its full
               shards loaded where it does not reproduce them

The prepared weights' small derived vectors (and, in bf16 or fp8, their casts) are dropped before
the copy and rebuilt on the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from safetensors.torch import save as st_save

from reel.bus.blobs import BlobBackend
from reel.bus.weight_manifest import WeightManifest
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.cached_forward import release_prepared
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_state_dict_bytes
from reel.runtime.weights.stream_copy import copy_into
from reel.runtime.weights.delta import apply_delta, full_of, verify_delta
from reel.runtime.weights.load import copy_version, verify_version

__all__ = ["EngineWeights"]

log = logging.getLogger("reel.engine")


class EngineWeights:
    """Loads published versions into one engine's model, in place."""

    def __init__(self, model: MoEModel, blobs: BlobBackend | None, max_seq_len: int):
        self.model = model
        self.blobs = blobs
        self.max_seq_len = max_seq_len
        self.hub = state_dict_adapter.to_hf(model.state_dict(), model.config)  # Hub name -> view of its parameter

    def verified(self, manifest: WeightManifest, held: int) -> WeightManifest:
        """The manifest to load, checked: a delta on `held` (the version the engine serves), else the
        version's full shards."""
        shapes = {n: t.shape for n, t in self.hub.items()}
        if manifest.base_version >= 0 and manifest.base_version == held:
            verify_delta(self.blobs, manifest, shapes)
            return manifest
        full = full_of(manifest) if manifest.base_version >= 0 else manifest
        verify_version(self.blobs, full, shapes)
        return full

    @torch.inference_mode()
    def load(self, weights: Mapping[str, torch.Tensor] | bytes | WeightManifest, held: int) -> None:
        """Copies `weights` (a manifest `verified` returned, a state dict, or one safetensors blob) in."""
        release_prepared(self.model)
        if isinstance(weights, WeightManifest):  # verified: copied shard by shard from the store's maps
            if weights.base_version >= 0 and not (wrong := apply_delta(self.blobs, weights, self.hub)):
                return
            if weights.base_version >= 0:
                log.warning("delta of version %d did not reproduce shards %s; loading its full shards",
                            weights.version, wrong)
                weights = self.verified(full_of(weights), held)
            copy_version(self.blobs, weights, self._copy)
            return
        # A state dict takes the blob's path too (safetensors in memory), so both are checked alike.
        load_state_dict_bytes(self.model, weights if isinstance(weights, bytes) else st_save(dict(weights)))

    @torch.inference_mode()  # on copy_version's threads: the parameters are updated as inference tensors
    def _copy(self, name: str, t: torch.Tensor, start: int) -> None:
        """A Hub tensor, or rows [start, start + len(t)) of it, into its parameter."""
        copy_into(self.hub[name].narrow(0, start, t.shape[0]), t)
