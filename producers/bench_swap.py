"""`reel bench swap`: weight hot-swap latency, for the built-in engine and for vLLM.

A swap is what a rollout worker does with a WeightsPublished: from the BlobRef in hand until the
engine serves the new version (update_weights returned, and a request sampled under it names it
in its spans). The built-in engine reads and checks the blob and swaps between decode steps; vLLM
(a real `vllm serve`, the one `reel run` starts) pauses with running requests kept, loads the blob
in its workers through Reel's worker extension (sha256 checked), takes the version label and
resumes. Each swap happens while requests are decoding, as in a run. The baseline, measured in the
same run, is a raw read of the same blob with safetensors (`load_file`, page cache warm):
`ratio` = raw read ÷ built-in swap (1.0 would be a swap as cheap as reading the file), and
`vllm_ratio` the same for vLLM. Best of `rounds` for every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.jsonout import print_json
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import Engine, SamplingParams
from reel.runtime import config as config_mod
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import save, state_dict_bytes

# ~14M parameters (56 MB of fp32 safetensors): big enough that reading it is measurable, small enough
# for vLLM's CPU build; head_dim 32 because vLLM's CPU attention has no kernel for 16.
MODEL = MoEConfig(vocab_size=1024, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16,
                  num_experts_per_tok=2, max_position_embeddings=512)
QUICK_MODEL = MoEConfig(vocab_size=256, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=2,
                        head_dim=32, num_experts=4, max_position_embeddings=512)
SERVE = '[engine]\nkind = "vllm"\nmax_batch = 16\n[trainer]\nrouter_replay = false\n'
PROMPT = list(range(3, 19))
BACKGROUND = SamplingParams(n=4, temperature=1.0, max_tokens=400, seed=1)  # requests decoding during each swap


def bench_swap(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    rounds = 1 if quick else 3
    config = QUICK_MODEL if quick else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blobs = BlobStore(root / "blobs")
        versions = []
        for seed in range(rounds + 1):
            torch.manual_seed(seed)
            versions.append(blobs.put(state_dict_bytes(MoEModel(config))))
        torch.manual_seed(0)
        save(MoEModel(config), root / "model")
        raw_s = min(_time_raw_read(blobs.path(ref)) for ref in versions for _ in range(2))
        builtin_s = asyncio.run(_time_swaps(_builtin(root / "model", blobs), versions))
        vllm_s, why_no_vllm = _vllm_swaps(root, blobs, versions)
    nbytes = versions[0].nbytes
    print_json({
        "bench": "swap", "quick": quick, "rounds": rounds, "params": sum(p.numel() for p in MoEModel(config).parameters()),
        "blob_mb": round(nbytes / 1e6, 1), "raw_read_s": round(raw_s, 4),
        "raw_read_mb_per_s": round(nbytes / 1e6 / raw_s, 1),
        "builtin_swap_s": round(builtin_s, 4),
        "vllm_swap_s": None if vllm_s is None else round(vllm_s, 4),
        **({"vllm_missing": why_no_vllm} if why_no_vllm else {}),
        "vllm_ratio": None if vllm_s is None else round(raw_s / vllm_s, 3),
        "ratio": round(raw_s / builtin_s, 3),
    })
    return 0


def _time_raw_read(path: Path) -> float:
    start = time.perf_counter()
    load_file(path)
    return time.perf_counter() - start


def _builtin(model_dir: Path, blobs: BlobStore) -> BuiltinEngine:
    from reel.runtime.model.weights import load

    return BuiltinEngine(load(model_dir), max_batch=16, blobs=blobs, version=-1)


async def _time_swaps(engine: Engine, versions: list[BlobRef]) -> float:
    """Best time from BlobRef in hand to the engine serving it, with requests decoding meanwhile."""
    best = float("inf")
    async with engine:
        await engine.update_weights(versions[0], 0)
        for version, ref in enumerate(versions[1:], start=1):
            background = asyncio.create_task(engine.generate(PROMPT, BACKGROUND))
            await asyncio.sleep(0.2)  # decoding when the swap lands
            start = time.perf_counter()
            await engine.update_weights(ref, version)
            probe, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
            seconds = time.perf_counter() - start
            if probe.spans != [(0, version)]:
                raise RuntimeError(f"after the swap to version {version} the engine sampled under {probe.spans}")
            best = min(best, seconds)
            await background
    return best


def _vllm_swaps(root: Path, blobs: BlobStore, versions: list[BlobRef]) -> tuple[float | None, str | None]:
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed (bash ops/install_vllm.sh)"
    from reel.producers.vllm_http import VLLMHTTPEngine
    from reel.runtime.launch.vllm_serve import local_vllm

    with local_vllm(config_mod.loads(SERVE), root / "model", root / "vllm.log", blobs.root) as url:
        engine = VLLMHTTPEngine(root / "model", url=url, blobs=blobs, version=-1, routed_experts=False)
        return asyncio.run(_time_swaps(engine, versions)), None
