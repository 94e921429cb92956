"""The built-in engine's weights: a published version checked, then copied in place.

    verified   (while the engine serves the old version) a delta on the version the engine holds, or
               the version's full shards: hashes, names, shapes, whole experts
    load       (on the step thread, between two decode steps) the shards copied straight from the
               store's maps into the parameters and, in the same pass, into the prepared weights
               (`kvcache.prepared_targets`), so nothing is rebuilt; a delta applied to the held
               tensors, its full shards loaded where it does not reproduce them

Anything but a full manifest (a delta, a state dict, one safetensors blob) drops the prepared
weights, rebuilt on the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from safetensors.torch import save as st_save

from reel.bus.blobs import BlobBackend
from reel.bus.weight_manifest import WeightManifest, shard_rows
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.cached_forward import release_prepared
from reel.runtime.model.kvcache import Target, mark_current, prepared_targets
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_state_dict_bytes
from reel.runtime.weight_delta import apply_delta, full_of, verify_delta
from reel.runtime.weight_load import WeightLoadError, copy_version, verify_version

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
        # The prepared weights take an expert as a whole (FSDP2 and EP shard over experts, so ranks write them so).
        split = next((n for s in full.shards for n, rows in shard_rows(s).items()
                      if rows is not None and state_dict_adapter.is_expert(n)), None)
        if split is not None:
            raise WeightLoadError(f"version {manifest.version} splits expert tensor {split} by rows; the built-in "
                                  "engine loads whole experts")
        return full

    @torch.inference_mode()
    def load(self, weights: Mapping[str, torch.Tensor] | bytes | WeightManifest, held: int) -> None:
        """Copies `weights` (a manifest `verified` returned, a state dict, or one safetensors blob) in."""
        targets = prepared_targets(self.model, self.max_seq_len)
        if not isinstance(weights, WeightManifest) or weights.base_version >= 0 or targets is None:
            release_prepared(self.model)
            targets = {}
        if isinstance(weights, WeightManifest):  # verified: copied shard by shard from the store's maps
            if weights.base_version >= 0 and not (wrong := apply_delta(self.blobs, weights, self.hub)):
                return
            if weights.base_version >= 0:
                log.warning("delta of version %d did not reproduce shards %s; loading its full shards",
                            weights.version, wrong)
                weights = self.verified(full_of(weights), held)
            copy_version(self.blobs, weights, self._copier(targets))
            if targets:
                mark_current(self.model, self.max_seq_len)
            return
        # A state dict takes the blob's path too (safetensors in memory), so both are checked alike.
        load_state_dict_bytes(self.model, weights if isinstance(weights, bytes) else st_save(dict(weights)))

    def _copier(self, targets: dict[str, list[Target]]) -> Callable[[str, torch.Tensor, int], None]:
        """Copies a Hub tensor, or rows [start, start + len(t)) of it, into its parameter, then those
        rows of the parameter into its prepared slices (narrowed to the rows on each slice's own dim)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        config = self.model.config

        @torch.inference_mode()  # on copy_version's threads: the prepared tensors are inference tensors
        def copy(name: str, t: torch.Tensor, start: int) -> None:
            rows = t.shape[0]
            self.hub[name].narrow(0, start, rows).copy_(t)
            for param, expert, _ in state_dict_adapter.param_slices(name, t, config):
                for dest, value, row_dim in targets.get(param, ()):
                    if expert is not None:  # a whole expert (experts are never split by rows)
                        _copy(dest[expert], value(params[param])[expert])
                    else:
                        _copy(dest.narrow(row_dim, start, rows), value(params[param].narrow(0, start, rows)))
        return copy


def _copy(into: torch.Tensor, src: torch.Tensor, block: int = 32) -> None:
    """into.copy_(src). A transposed source into a strided slice (the fused q/k/v, the gate/up halves)
    is copy_'s slow path (16x slower here than blocked): copy it a few source rows at a time."""
    if into.is_contiguous() or into.dim() != 2:
        into.copy_(src)
        return
    for first in range(0, into.shape[1], block):
        into[:, first:first + block].copy_(src[:, first:first + block])
