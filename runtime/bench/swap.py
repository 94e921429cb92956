"""`reel bench swap`: a policy version from the trainer's memory into a serving engine, phase by phase.

publish (runtime/weights/publish.py): gather (the tensors under their Hub names: views on one process),
  serialise (cast to the shards' dtype, headers), hash (sha256, the store's key, and BLAKE3, the digest a
  loader checks: runtime/weights/shard_hash.py), write (+ fsync); each phase timed alone
  on the version's buckets, then the pipeline as the trainer runs it (shards in parallel, each hashed
  while written). Baseline in the same run: a raw write of the same bytes to one file + fdatasync.
load (runtime/weights/load.py into the built-in engine): read (map every shard, touch its pages), verify
  (BLAKE3 of every shard), copy (torch's copy_ into the engine's parameters), each timed alone; `loader`:
  verify, then copy into tensors of the shards' own dtype and layout (what an engine holding one copy of
  the weights in the served dtype, as vLLM does, writes; the built-in engine holds one copy in fp32, its
  parameters, which its kernels read); then the swap as a rollout worker runs it: update (update_weights:
  verify while the old version serves, then the copy with streaming stores: runtime/weights/stream_copy.py;
  shards in parallel) and visible (what the first request under the new version costs over the same
  request without a swap: the small derived vectors rebuilt), with requests decoding meanwhile at the
  small size.
  Baseline: a raw read of the same bytes (every shard file, page cache warm) into one reused buffer.
  `cold_*`: the raw read and the update again with the shard files dropped from the page cache first
  (posix_fadvise DONTNEED), so both read the disk: the medium a node other than the trainer's reads.
`ratio` = baseline seconds / pipeline seconds (1.0: as fast as the medium; `update_ratio` leaves out
visible). Extra RSS: the most the process's resident memory rose above its level before the phase
(the kernel's high-water mark: bench_measure.RssPeak).
Two sizes: `small` (~14M parameters, fp32 shards, what the built-in engine serves) and `large` (~550M
parameters, bf16 shards, ~1.1 GB). Mooncake (one object per shard, a master and holder started here) and
vLLM (`vllm serve` on CPU loading the manifest: producers/vllm_worker.py) get a row each at the small
size (REEL_BENCH_NO_VLLM=1 leaves vLLM out: starting vLLM on CPU takes minutes). Best of `rounds` for
every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.jsonout import print_json
from reel.bus.weight_manifest import WeightManifest
from reel.runtime.bench.common.measure import RssPeak, best, best_cold, evict, gb, rate, secs
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import Engine, SamplingParams
from reel.runtime.config import run as config_mod
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import hub_tensors, save
from reel.runtime.weights.delta import changed, publish_delta
from reel.runtime.weights.load import copy_version, verify_version
from reel.runtime.weights.shard_hash import WRITE_HASH, new_digest
from reel.runtime.weights.publish import DTYPES, buckets, publish_version
from reel.runtime.weights.shards import read_header, shard_parts, tensor_at

# head_dim 32 because vLLM's CPU attention has no kernel for 16.
SMALL = MoEConfig(vocab_size=1024, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16,
                  num_experts_per_tok=2, max_position_embeddings=512)
LARGE = MoEConfig(vocab_size=32000, hidden_size=1024, moe_intermediate_size=1024, num_hidden_layers=9,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=16,
                  num_experts_per_tok=2, max_position_embeddings=512)
QUICK = MoEConfig(vocab_size=256, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=2,
                  head_dim=32, num_experts=4, max_position_embeddings=512)
SERVE = '[engine]\nkind = "vllm"\nmax_batch = 16\n[trainer]\nrouter_replay = false\n'
PROMPT = list(range(3, 19))
BACKGROUND = SamplingParams(n=4, temperature=1.0, max_tokens=400, seed=1)  # requests decoding during each swap
PROBE = SamplingParams(temperature=0.0, max_tokens=1)
SHARD_BYTES = 64 << 20
THREADS = 2
DELTA_LR = 1e-6  # a typical RL fine-tuning learning rate


def run(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    rounds = 1 if quick else 2
    sizes = {"quick": (QUICK, "float32")} if quick else {"small": (SMALL, "float32"), "large": (LARGE, "bfloat16")}
    figures: dict[str, object] = {"bench": "swap", "quick": quick, "rounds": rounds, "threads": THREADS,
                                  "shard_mb": SHARD_BYTES >> 20, "hash": WRITE_HASH, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="reel-bench-swap-", dir=os.environ.get("REEL_BENCH_DIR")) as tmp:
        for name, (config, dtype) in sizes.items():
            figures["sizes"][name] = _one_size(Path(tmp) / name, config, dtype, rounds, background=name != "large")
        if not quick:
            figures["mooncake"] = _mooncake_row(Path(tmp) / "mooncake", SMALL, "float32", rounds)
        skip_vllm = bool(os.environ.get("REEL_BENCH_NO_VLLM"))
        figures["vllm"] = None if skip_vllm else _vllm_row(Path(tmp) / "vllm", QUICK if quick else SMALL, rounds)
    last = figures["sizes"]["quick" if quick else "large"]
    figures["load_ratio"], figures["publish_ratio"] = last["load"]["ratio"], last["publish"]["ratio"]
    figures["loader_ratio"], figures["cold_ratio"] = last["load"]["loader_ratio"], last["load"]["cold_ratio"]
    figures["ratio"] = figures["load_ratio"]
    print_json(figures)
    return 0


def _one_size(root: Path, config: MoEConfig, dtype: str, rounds: int, background: bool) -> dict[str, object]:
    root.mkdir(parents=True)
    blobs = BlobStore(root / "blobs")
    publish = _publish_phases(root, blobs, _model(config, 0), dtype, rounds)
    manifests = [_published(blobs, _model(config, seed), seed, dtype)[1] for seed in range(rounds + 1)]
    load = _load_phases(blobs, _model(config, 0), manifests, rounds, background)
    nbytes = sum(s.blob.nbytes for s in manifests[0].shards)
    return {"params": sum(t.numel() for _, t in hub_tensors(_model(config, 0).state_dict(), config)), "dtype": dtype,
            "gb": gb(nbytes), "shards": len(manifests[0].shards), "publish": publish, "load": load,
            "delta": _delta_figures(blobs, _model(config, 0), manifests[0], dtype)}


def _unchanged(blobs: BlobStore, base: WeightManifest, tensors: dict[str, torch.Tensor],
               dtype: torch.dtype) -> tuple[int, int]:
    """(elements whose bits did not change from `base`, elements), shard by shard."""
    same = total = 0
    for shard in base.shards:
        with blobs.mapped(shard.blob) as data:
            for entry in read_header(data):
                total += entry.count
                same += entry.count - changed(tensors[entry.name].to(dtype), tensor_at(data, entry)).numel()
    return same, total


def _delta_figures(blobs: BlobStore, model: MoEModel, base: WeightManifest, dtype: str) -> dict[str, object]:
    """One AdamW step (lr DELTA_LR, fresh moments: every element moves by about lr) after version 0:
    the share of elements whose bits did not change, and the delta's bytes against the full version's."""
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=DELTA_LR, weight_decay=0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    del optimizer
    for p in params:
        p.grad = None
    full = _published(blobs, model, base.version + 1, dtype)[1]
    same, total = _unchanged(blobs, base, dict(hub_tensors(model.state_dict(), model.config)), DTYPES[dtype])
    started = time.perf_counter()
    delta = publish_delta(blobs, hub_tensors(model.state_dict(), model.config), base, full, shard_bytes=SHARD_BYTES,
                          threads=THREADS)
    seconds = time.perf_counter() - started
    full_bytes = sum(s.blob.nbytes for s in full.shards)
    delta_bytes = full_bytes if delta is None else sum(s.blob.nbytes for s in delta[1].shards)
    return {"lr": DELTA_LR, "unchanged_share": round(same / total, 4), "full_mb": round(full_bytes / 1e6, 1),
            "delta_mb": round(delta_bytes / 1e6, 1), "saved_share": round(1 - delta_bytes / full_bytes, 4),
            "delta_publish_s": secs(seconds), "published": delta is not None}


def _published(blobs: BlobStore, model: MoEModel, version: int, dtype: str) -> tuple[BlobRef, WeightManifest]:
    return publish_version(blobs, hub_tensors(model.state_dict(), model.config), version=version, step=version,
                           dtype=dtype, shard_bytes=SHARD_BYTES, threads=THREADS)


def _model(config: MoEConfig, seed: int) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(config)


# ---- publish --------------------------------------------------------------------------------------


def _publish_phases(root: Path, blobs: BlobStore, model: MoEModel, dtype: str, rounds: int) -> dict[str, object]:
    torch_dtype = DTYPES[dtype]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    gather_s = best(rounds, lambda: buckets(hub_tensors(model.state_dict(), model.config), SHARD_BYTES, itemsize))
    groups = buckets(hub_tensors(model.state_dict(), model.config), SHARD_BYTES, itemsize)
    serialise_s = best(rounds, lambda: [list(shard_parts([(n, t.to(torch_dtype)) for n, t in g])) for g in groups])
    parts = [list(shard_parts([(n, t.to(torch_dtype)) for n, t in g])) for g in groups]
    nbytes = sum(p.nbytes if isinstance(p, memoryview) else len(p) for ps in parts for p in ps)
    key_s = best(rounds, lambda: [_digest("sha256", ps) for ps in parts])
    hash_s = best(rounds, lambda: [_digest(WRITE_HASH, ps) for ps in parts])
    write_s = best(rounds, lambda: _raw_write(root / "raw-write", parts))
    del parts
    sampler = RssPeak()
    pipeline_s = float("inf")
    for version in range(rounds):
        with sampler:
            started = time.perf_counter()
            publish_version(blobs, hub_tensors(model.state_dict(), model.config), version=100 + version, step=0,
                            dtype=dtype, shard_bytes=SHARD_BYTES, threads=THREADS)
            pipeline_s = min(pipeline_s, time.perf_counter() - started)
    return {"gather_s": secs(gather_s), "serialise_s": secs(serialise_s), "key_sha256_s": secs(key_s),
            "key_sha256_gb_per_s": rate(nbytes, key_s), "hash_s": secs(hash_s), "hash_gb_per_s": rate(nbytes, hash_s),
            "raw_write_fdatasync_s": secs(write_s),
            "raw_write_gb_per_s": rate(nbytes, write_s), "pipeline_s": secs(pipeline_s),
            "pipeline_gb_per_s": rate(nbytes, pipeline_s), "peak_extra_rss_mb": sampler.peak_mb,
            "ratio": round(write_s / pipeline_s, 3)}


def _digest(algorithm: str, parts: list) -> str:
    digest = new_digest(algorithm)
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _raw_write(path: Path, parts: list[list]) -> None:
    with open(path, "wb") as f:
        for ps in parts:
            for p in ps:
                f.write(p)
        f.flush()
        os.fdatasync(f.fileno())
    path.unlink()


# ---- load -----------------------------------------------------------------------------------------


def _load_phases(blobs: BlobStore, model: MoEModel, manifests: list[WeightManifest], rounds: int,
                 background: bool) -> dict[str, object]:
    shards = [s.blob for s in manifests[0].shards]
    nbytes = sum(ref.nbytes for ref in shards)
    raw_s = best(rounds + 1, lambda: _raw_read(blobs, shards))
    read_s = best(rounds, lambda: [_touch(blobs, ref) for ref in shards])
    shapes = {n: t.shape for n, t in state_dict_adapter.to_hf(model.state_dict(), model.config).items()}
    verify_s = best(rounds, lambda: verify_version(blobs, manifests[0], shapes, THREADS))
    hub = state_dict_adapter.to_hf(model.state_dict(), model.config)
    served = {n: torch.empty(t.shape, dtype=DTYPES[manifests[0].dtype]) for n, t in hub.items()}
    with torch.inference_mode():
        copy_s = best(rounds, lambda: copy_version(blobs, manifests[0], _copier(hub), THREADS))
        loader_s = best(rounds, lambda: (verify_version(blobs, manifests[0], shapes, THREADS),
                                          copy_version(blobs, manifests[0], _copier(served), THREADS)))
    served.clear()  # freed before the swaps, whose extra RSS is measured
    engine = BuiltinEngine(model, max_batch=16, blobs=blobs, version=-1)
    swaps = asyncio.run(_time_swaps(engine, manifests, background))
    swap_s = swaps["update_s"] + swaps["visible_s"]
    # Cold: the shards read from the disk (dropped from the page cache first), as on a node other than
    # the trainer's, or after memory pressure: the medium itself.
    raw_cold_s = best_cold(rounds + 1, blobs, shards, lambda: _raw_read(blobs, shards))
    cold = BuiltinEngine(model, max_batch=16, blobs=blobs, version=-1)
    cold_s = asyncio.run(_time_swaps(cold, manifests, False, lambda m: evict(blobs, [s.blob for s in m.shards])))
    return {"raw_read_s": secs(raw_s), "raw_read_gb_per_s": rate(nbytes, raw_s), "read_s": secs(read_s),
            "verify_s": secs(verify_s), "verify_gb_per_s": rate(nbytes, verify_s), "copy_s": secs(copy_s),
            "loader_s": secs(loader_s), "loader_gb_per_s": rate(nbytes, loader_s), "loader_ratio": round(raw_s / loader_s, 3),
            "update_s": secs(swaps["update_s"]), "update_gb_per_s": rate(nbytes, swaps["update_s"]),
            "visible_s": secs(swaps["visible_s"]), "swap_s": secs(swap_s), "update_rss_mb": swaps["update_rss_mb"],
            "swap_rss_mb": swaps["swap_rss_mb"], "update_ratio": round(raw_s / swaps["update_s"], 3),
            "ratio": round(raw_s / swap_s, 3), "cold_raw_read_s": secs(raw_cold_s),
            "cold_raw_read_gb_per_s": rate(nbytes, raw_cold_s), "cold_update_s": secs(cold_s["update_s"]),
            "cold_ratio": round(raw_cold_s / cold_s["update_s"], 3)}


def _copier(into: dict[str, torch.Tensor]) -> Callable[[str, torch.Tensor, int], None]:
    """copy_version's sink: torch's copy_ of each block of rows into its rows of `into`."""
    return lambda name, t, start: into[name].narrow(0, start, len(t)).copy_(t)


def _raw_read(blobs: BlobStore, refs: list[BlobRef]) -> None:
    buffer = bytearray(max(ref.nbytes for ref in refs))
    for ref in refs:
        with open(blobs.path(ref), "rb", buffering=0) as f:
            f.readinto(buffer)


def _touch(blobs: BlobStore, ref: BlobRef) -> None:
    with blobs.mapped(ref) as data:
        bytes(data[::4096])  # one byte per page: every page mapped in


async def _time_swaps(engine: Engine, manifests: list[WeightManifest], background: bool,
                      before: Callable[[WeightManifest], None] | None = None) -> dict[str, float]:
    """Best seconds of update_weights (read, verify, copy) and of the extra the first request after it
    costs over the same request without a swap (the version made visible); the peak extra RSS of the
    update and of the whole swap, each over the level before the update."""
    update, visible, update_rss_mb = float("inf"), float("inf"), 0.0
    swapping = RssPeak()
    async with engine:
        await engine.update_weights(manifests[0], 0)
        await engine.generate(PROMPT, PROBE)
        for version, manifest in enumerate(manifests[1:], start=1):
            decoding = asyncio.create_task(engine.generate(PROMPT, BACKGROUND)) if background else None
            await asyncio.sleep(0.2 if background else 0)  # decoding when the swap lands
            probe_s = await _probe(engine, version - 1)
            if before is not None:
                before(manifest)
            with swapping:
                start = time.perf_counter()
                await engine.update_weights(manifest, version)
                update = min(update, time.perf_counter() - start)
                update_rss_mb = max(update_rss_mb, swapping.since_entry_mb())
                visible = min(visible, await _probe(engine, version) - probe_s)
            if decoding is not None:
                await decoding
    return {"update_s": update, "visible_s": max(0.0, visible), "update_rss_mb": update_rss_mb,
            "swap_rss_mb": swapping.peak_mb}


async def _probe(engine: Engine, version: int) -> float:
    start = time.perf_counter()
    probe, = await engine.generate(PROMPT, PROBE)
    if probe.spans != [(0, version)]:
        raise RuntimeError(f"the engine sampled under {probe.spans}, version {version} expected")
    return time.perf_counter() - start


# ---- Mooncake (one object per shard) --------------------------------------------------------------


def _mooncake_row(root: Path, config: MoEConfig, dtype: str, rounds: int) -> dict[str, object]:
    """Publish and load through a Mooncake store over TCP (a master and a holder started here)."""
    if importlib.util.find_spec("mooncake") is None:
        return {"missing": "Mooncake is not installed (pip install 'reel-rl[mooncake]')"}
    from reel.bus.blob_backends.mooncake import MooncakeBlobs
    from reel.bus.blob_backends.mooncake_service import MooncakeService

    with MooncakeService(root / "mooncake", segment_bytes=1 << 30) as service:
        blobs = MooncakeBlobs(service.address, retry_s=5.0)
        try:
            model = _model(config, 0)
            publish_s = best(rounds, lambda: _published(blobs, model, 0, dtype))
            manifests = [_published(blobs, _model(config, seed), seed, dtype)[1] for seed in range(rounds + 1)]
            refs = [s.blob for s in manifests[0].shards]
            raw_s = best(rounds + 1, lambda: [blobs.read(ref) for ref in refs])
            swaps = asyncio.run(_time_swaps(BuiltinEngine(model, max_batch=16, blobs=blobs, version=-1), manifests,
                                            background=False))
        finally:
            blobs.close()
    nbytes = sum(ref.nbytes for ref in refs)
    return {"gb": gb(nbytes), "objects": len(refs), "publish_s": secs(publish_s), "raw_get_s": secs(raw_s),
            "update_s": secs(swaps["update_s"]), "update_gb_per_s": rate(nbytes, swaps["update_s"]),
            "update_rss_mb": swaps["update_rss_mb"], "update_ratio": round(raw_s / swaps["update_s"], 3)}


# ---- vLLM (the manifest, streamed into each worker) ---------------------------------------------


def _vllm_row(root: Path, config: MoEConfig, rounds: int) -> dict[str, object]:
    if importlib.util.find_spec("vllm") is None:
        return {"missing": "vLLM is not installed (bash ops/install_vllm.sh)"}
    from reel.producers.vllm_http import VLLMHTTPEngine
    from reel.runtime.launch.vllm_serve import local_vllm

    root.mkdir(parents=True)
    blobs = BlobStore(root / "blobs")
    published = [_published(blobs, _model(config, seed), seed, "float32") for seed in range(rounds + 1)]
    save(_model(config, 0), root / "model")
    shards = [s.blob for s in published[0][1].shards]
    raw_s = best(rounds + 1, lambda: _raw_read(blobs, shards))
    with local_vllm(config_mod.loads(SERVE), root / "model", root / "vllm.log", blobs.root) as url:
        engine = VLLMHTTPEngine(root / "model", url=url, blobs=blobs, version=-1, routed_experts=False)
        swap_s = asyncio.run(_time_vllm_swaps(engine, published))
    nbytes = sum(ref.nbytes for ref in shards)
    return {"format": "manifest", "gb": gb(nbytes), "shards": len(shards), "raw_read_s": secs(raw_s),
            "swap_s": secs(swap_s), "swap_gb_per_s": rate(nbytes, swap_s), "ratio": round(raw_s / swap_s, 3)}


async def _time_vllm_swaps(engine: Engine, published: list[tuple[BlobRef, WeightManifest]]) -> float:
    """Best seconds from update_weights (verify, then every worker verifies and streams) to the first
    sample under the new version, with requests decoding meanwhile."""
    best = float("inf")
    async with engine:
        await engine.update_weights(published[0][1], 0, ref=published[0][0])
        for version, (ref, manifest) in enumerate(published[1:], start=1):
            decoding = asyncio.create_task(engine.generate(PROMPT, BACKGROUND))
            await asyncio.sleep(0.2)
            start = time.perf_counter()
            await engine.update_weights(manifest, version, ref=ref)
            probe, = await engine.generate(PROMPT, PROBE)
            best = min(best, time.perf_counter() - start)
            if probe.spans != [(0, version)]:
                raise RuntimeError(f"after the swap to version {version} vLLM sampled under {probe.spans}")
            await decoding
    return best
