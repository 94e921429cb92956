"""Reel's side inside each vLLM worker (`worker_extension_cls`): loading a published version in place.

`collective_rpc` (in-process AsyncLLM, or `vllm serve`'s dev route /collective_rpc, which anyone with
the run's key can call) names what to load; the worker reads only the run's blob store
(REEL_BLOBS_DIR, set by the launcher), by hash:

    reel_load_manifest(sha256)      a manifest version (bus/weight_manifest.py): the manifest blob,
                                    then every shard mapped and hashed, then the tensors streamed
                                    into `model.load_weights` as views of the shards' maps, one
                                    shard after another; returns what it loaded and read (a dict)
    reel_load_weights(path, sha256) one safetensors blob (runs published before manifests, and
                                    state dicts handed to the engine directly)

Streaming views, not loaded tensors: vLLM's weight loaders narrow each tensor to the slice their
rank holds and copy that, so a tensor-parallel worker reads only its slices' pages after the hash
pass, and no worker holds a shard (let alone the model) as a buffer of its own. Verify-then-load:
a shard that fails its hash refuses the load before any weight changes.

A delta version on the version this worker holds (it remembers the full manifest it last loaded) is
rebuilt from that version's full shards plus the delta (runtime/weights/delta.rebuilt_version), and
only the vLLM layers it touches are loaded. A layer is loaded whole: vLLM's layerwise reload
(`initialize_layerwise_reload`) puts every layer on the meta device and processes one once all its
elements have arrived; a layer given only part of its tensors is materialised uninitialised and
copied back whole (garbage in the rest), and a layer given none is put back untouched. So a change
to one expert reloads all experts of its FusedMoE layer, a change to q_proj reloads qkv_proj, and
the CPU experts' repack runs only on the MoE layers reloaded. A worker that does not hold the base,
or whose delta fails a check, loads the version's full shards.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest
from reel.runtime.launch.vllm_args import BLOBS_ENV
from reel.runtime.weights.delta import base_shards, full_of, rebuilt_version
from reel.runtime.weights.load import WeightLoadError, read_manifest, stream_version, verify_version

log = logging.getLogger("reel.vllm_worker")

__all__ = ["ReelWorkerExtension", "LOAD_WEIGHTS", "LOAD_MANIFEST"]

LOAD_WEIGHTS = "reel_load_weights"  # the ReelWorkerExtension methods collective_rpc calls
LOAD_MANIFEST = "reel_load_manifest"


class ReelWorkerExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); `collective_rpc` calls its methods there."""

    model_runner: Any  # provided by vLLM's worker
    # The full version these weights are (a delta's base); None: unknown (a blob load, a failed load).
    reel_held: WeightManifest | None = None

    def reel_load_weights(self, path: str, sha256: str) -> None:
        """Load a Reel weights blob (safetensors, HF names) in place: only the blob of hash `sha256` in
        the run's blob store, read through its checks; `path` must be where that store keeps it."""
        from safetensors.torch import load

        store = _run_store()
        where = store.path(_ref(sha256))  # BlobError for a key that is not a sha256
        if Path(path).absolute() != where:
            raise ValueError(f"weights blob {path} is not the blob {sha256} of the run's store {store.root}")
        tensors = load(store.get(_ref(sha256, _size(store, sha256, "weights blob"))))
        self.reel_held = None
        self._load(tensors.items(), set(tensors))

    def reel_load_manifest(self, sha256: str) -> dict[str, Any]:
        """Load the manifest version of hash `sha256` in place: a delta on the held version rebuilt and
        loaded layer by layer, else every shard verified, then streamed. Returns what was loaded: `how`
        ("delta" or "full"), `tensors` (Hub tensors handed to vLLM), `read_bytes` (shard bytes mapped)
        and `why_full` (for a delta loaded in full)."""
        store = _run_store()
        manifest = read_manifest(store, _ref(sha256, _size(store, sha256, "weight manifest")))
        why_full = ""
        if manifest.base_version >= 0:
            try:
                return self._load_delta(store, manifest)
            except WeightLoadError as exc:  # the version's full shards instead (they replace all a delta did)
                why_full = str(exc)
                log.warning("version %d: %s; loading its full shards", manifest.version, why_full)
            manifest = full_of(manifest)
        started = time.perf_counter()
        verify_version(store, manifest, None)  # WeightLoadError before any weight changes
        names = {name for shard in manifest.shards for name in shard.tensors}
        self.reel_held = None
        seconds = {"verify_s": round(time.perf_counter() - started, 3)} | self._load(stream_version(store, manifest), names)
        self.reel_held = manifest
        return {"version": manifest.version, "how": "full", "tensors": len(names), "why_full": why_full,
                "read_bytes": sum(shard.blob.nbytes for shard in manifest.shards), "seconds": seconds}

    def _load_delta(self, store: BlobStore, delta: WeightManifest) -> dict[str, Any]:
        """The delta rebuilt on the held version, its touched layers loaded whole; WeightLoadError before
        any weight changes when this worker cannot (it does not hold the base, or a check fails)."""
        held = self.reel_held
        if held is None or held.version != delta.base_version:
            raise WeightLoadError(f"this worker holds version {held.version if held else 'unknown'}, "
                                  f"not the delta's base {delta.base_version}")
        model = self.model_runner.get_model()
        needed = _whole_layers(model, [name for shard in held.shards for name in shard.tensors],
                               {name for shard in delta.shards for name in shard.tensors})
        read = sum(shard.blob.nbytes for shard in [*base_shards(held, needed), *delta.shards])
        started = time.perf_counter()
        with rebuilt_version(store, delta, held, needed) as tensors:
            self.reel_held = None
            seconds = {"verify_s": round(time.perf_counter() - started, 3)} | self._load(tensors, needed)
        self.reel_held = full_of(delta)
        return {"version": delta.version, "how": "delta", "tensors": len(needed), "why_full": "", "read_bytes": read,
                "seconds": seconds}

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], names: set[str]) -> dict[str, float]:
        """Hands `weights` to vLLM's loaders; the seconds of each phase (what a swap's time is made of)."""
        runner = self.model_runner
        model = runner.get_model()  # the runner may wrap the model it serves
        started = time.perf_counter()
        try:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        except ImportError:  # older vLLM: unquantised models load in place directly
            model.load_weights(weights=iter(weights))
            return {"load_s": round(time.perf_counter() - started, 3)}
        # Quantised (fp8) layers re-run their post-load processing after the raw weights are in.
        initialize_layerwise_reload(model)
        model.load_weights(weights=iter(weights))
        with _layers_left_alone():
            finalize_layerwise_reload(model, runner.model_config)
        seconds = {"load_s": round(time.perf_counter() - started, 3)}
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            started = time.perf_counter()
            packed = _packed(model)
            _repack_cpu_experts(model, {_layer(name, packed) for name in names})
            seconds["repack_s"] = round(time.perf_counter() - started, 3)
        return seconds


def _run_store() -> BlobStore:
    root = os.environ.get(BLOBS_ENV)
    if not root:
        raise ValueError(f"{BLOBS_ENV} is not set in the vLLM server's environment: weights load only from the "
                         "run's blob store")
    return BlobStore(Path(root))


def _ref(sha256: str, nbytes: int = 0) -> BlobRef:
    return BlobRef(uri="", sha256=sha256, nbytes=nbytes)


def _size(store: BlobStore, sha256: str, what: str) -> int:
    try:
        return store.path(_ref(sha256)).lstat().st_size
    except OSError as exc:
        raise ValueError(f"{what} {sha256} is not in the run's store {store.root}") from exc


def _packed(model: Any) -> dict[str, str]:
    """Hub module name -> the vLLM module it is fused into (q_proj -> qkv_proj, gate_proj -> gate_up_proj)."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {part: fused for fused, parts in mapping.items() for part in parts}


def _layer(name: str, packed: dict[str, str]) -> str:
    """The vLLM module a Hub tensor loads into: every expert of a MoE layer into one FusedMoE layer."""
    parts = name.split(".")[:-1]  # the module, without .weight
    if "experts" in parts[:-1] and parts[parts.index("experts") + 1].isdigit():
        return ".".join(parts[:parts.index("experts") + 1])
    return ".".join([*parts[:-1], packed.get(parts[-1], parts[-1])])


def _whole_layers(model: Any, names: list[str], touched: set[str]) -> set[str]:
    """The Hub tensors of every vLLM layer a delta touches (a layer reloads only whole); WeightLoadError
    when a touched tensor's layer is not one this model has (the full shards are the safe load)."""
    packed, modules = _packed(model), {name for name, _ in model.named_modules()}
    layers = {_layer(name, packed) for name in touched}
    unknown = sorted(layers - modules)
    if unknown:
        raise WeightLoadError(f"the delta changes {unknown[0]}, which is no layer of vLLM's model")
    return {name for name in names if _layer(name, packed) in layers}


@contextmanager
def _layers_left_alone() -> Iterator[None]:
    """Without vLLM's "Failed to load weights" warning for each layer a delta leaves alone (such a
    layer keeps its weights: `finalize_layerwise_reload` puts them back)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def quiet(record: logging.LogRecord) -> bool:
        return record.msg != "%s: Failed to load weights"
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _repack_cpu_experts(model: Any, layers: set[str]) -> None:
    """Prepack the CPU experts' new weights into the grouped-GEMM layout their kernel reads.

    vLLM's unquantised MoE method runs that prepack on the first load only: on a weight update it
    copies the raw weights into the packed storage and skips it (`_setup_kernel`, vLLM 0.32), so the
    CPU kernel would read unpacked weights as packed (measured: logprobs 1e-2 off Reel's forward,
    every other tensor bit-exact). Padding is a no-op for Reel's models (intermediate sizes are
    multiples of the kernel's 32). Only the MoE layers just reloaded (`layers`, module names): the others
    kept their packed weights, and packing them again would scramble them.
    """
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight") and _under(name, layers):
            kernel.fused_experts.process_weights_after_loading(module)


def _under(name: str, layers: set[str]) -> bool:
    """Whether module `name` is one of `layers` or inside one (vLLM's FusedMoE keeps its weights in a
    submodule of the layer the Hub names map to)."""
    return any(name == layer or name.startswith(layer + ".") for layer in layers)
