"""Reel's side inside each vLLM worker (`worker_extension_cls`): loading a published version in place.

`collective_rpc` (in-process AsyncLLM, or `vllm serve`'s dev route /collective_rpc, which anyone with
the run's key can call) names what to load; the worker reads only the run's blob store
(REEL_BLOBS_DIR, set by the launcher), by hash:

    reel_load_manifest(sha256)      a manifest version (bus/weight_manifest.py): the manifest blob,
                                    then every shard mapped and hashed (a delta: its full shards),
                                    then the tensors streamed into `model.load_weights` as views
                                    of the shards' maps, one shard after another
    reel_load_weights(path, sha256) one safetensors blob (runs published before manifests, and
                                    state dicts handed to the engine directly)

Streaming views, not loaded tensors: vLLM's weight loaders narrow each tensor to the slice their
rank holds and copy that, so a tensor-parallel worker reads only its slices' pages after the hash
pass, and no worker holds a shard (let alone the model) as a buffer of its own. Verify-then-load:
a shard that fails its hash refuses the load before any weight changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.runtime.launch.vllm_args import BLOBS_ENV
from reel.runtime.weight_delta import full_of
from reel.runtime.weight_load import read_manifest, stream_version, verify_version

__all__ = ["ReelWorkerExtension", "LOAD_WEIGHTS", "LOAD_MANIFEST"]

LOAD_WEIGHTS = "reel_load_weights"  # the ReelWorkerExtension methods collective_rpc calls
LOAD_MANIFEST = "reel_load_manifest"


class ReelWorkerExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); `collective_rpc` calls its methods there."""

    model_runner: Any  # provided by vLLM's worker

    def reel_load_weights(self, path: str, sha256: str) -> None:
        """Load a Reel weights blob (safetensors, HF names) in place: only the blob of hash `sha256` in
        the run's blob store, read through its checks; `path` must be where that store keeps it."""
        from safetensors.torch import load

        store = _run_store()
        where = store.path(_ref(sha256))  # BlobError for a key that is not a sha256
        if Path(path).absolute() != where:
            raise ValueError(f"weights blob {path} is not the blob {sha256} of the run's store {store.root}")
        tensors = load(store.get(_ref(sha256, _size(store, sha256, "weights blob"))))
        self._load(tensors.items(), tensors)

    def reel_load_manifest(self, sha256: str) -> None:
        """Load the manifest version of hash `sha256` in place: every shard verified, then streamed."""
        store = _run_store()
        manifest = read_manifest(store, _ref(sha256, _size(store, sha256, "weight manifest")))
        if manifest.base_version >= 0:  # a delta: its version's full shards (what a worker without the base takes)
            manifest = full_of(manifest)
        verify_version(store, manifest, None)  # WeightLoadError before any weight changes
        self._load(stream_version(store, manifest), [name for shard in manifest.shards for name in shard.tensors])

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], names: Iterable[str]) -> None:
        runner = self.model_runner
        model = runner.get_model()  # the runner may wrap the model it serves
        try:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        except ImportError:  # older vLLM: unquantised models load in place directly
            model.load_weights(weights=iter(weights))
            return
        # Quantised (fp8) layers re-run their post-load processing after the raw weights are in.
        initialize_layerwise_reload(model)
        model.load_weights(weights=iter(weights))
        finalize_layerwise_reload(model, runner.model_config)
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and any(".mlp.experts." in name for name in names):
            _repack_cpu_experts(model)  # a version always holds every expert: each is packed exactly once


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


def _repack_cpu_experts(model: Any) -> None:
    """Prepack the CPU experts' new weights into the grouped-GEMM layout their kernel reads.

    vLLM's unquantised MoE method runs that prepack on the first load only: on a weight update it
    copies the raw weights into the packed storage and skips it (`_setup_kernel`, vLLM 0.32), so the
    CPU kernel would read unpacked weights as packed (measured: logprobs 1e-2 off Reel's forward,
    every other tensor bit-exact). Padding is a no-op for Reel's models (intermediate sizes are
    multiples of the kernel's 32).
    """
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
