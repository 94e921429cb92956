"""`vllm serve` starts on a `reel export` directory and generates what Reel's model generates
(the CPU build of vLLM; head_dim 32, the smallest its CPU attention takes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.producers.engine import SamplingParams
from reel.producers.vllm_http import VLLMHTTPEngine
from reel.replay.export import export
from reel.runtime.config import run as config_mod
from reel.runtime.launch.vllm_serve import local_vllm
from reel.runtime.model.weights import load
from runbuilder import build_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERVE = """
[engine]
kind = "vllm"
max_batch = 4
[trainer]
router_replay = false
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("export-vllm")
    run_dir = build_run(tmp / "run", {"run": {"name": "served", "steps": 2},
                                      "model": {"head_dim": 32, "max_position_embeddings": 64}})
    return export(run_dir, None, tmp / "model")


async def test_vllm_serves_an_exported_policy(exported: Path, tmp_path: Path) -> None:
    model = load(exported).eval()
    prompt = [1, 20, 7, 33, 12]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    with local_vllm(config_mod.loads(SERVE), exported, tmp_path / "vllm.log", tmp_path / "blobs") as url:
        async with VLLMHTTPEngine(exported, url=url, blobs=BlobStore(tmp_path / "blobs"), version=-1,
                                  routed_experts=False) as engine:
            greedy, = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert greedy.tokens == ids[len(prompt):]
