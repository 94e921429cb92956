"""A vLLM without weight_versions: spans fall back to the start version, with a warning and a count
that reaches WorkerStats, the metrics snapshot and Prometheus."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import WorkerStats
from reel.consumers.aggregates import RunAggregates
from reel.producers.engine import SamplingParams
from reel.producers.vllm_http import VLLMHTTPEngine
from reel.runtime.model.config import MoEConfig
from vllm_peer import Peer, vllm_response


async def test_missing_weight_versions_are_warned_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(MoEConfig(vocab_size=50).to_hf_dict()))
    with_spans = vllm_response(1, [3, 4], [-1.0, -0.5], [{"version": "5", "start": 0, "end": 2}], routing=False)
    answers = iter([vllm_response(1, [3], [-1.0], None, routing=False), with_spans,
                    vllm_response(1, [3], [-1.0], None, routing=False)])
    peer = Peer(answer=lambda body: next(answers))
    try:
        async with VLLMHTTPEngine(tmp_path / "model", url=peer.url, servers=[], blobs=BlobStore(tmp_path / "blobs"),
                                  version=5, routed_experts=False) as engine:
            with caplog.at_level(logging.WARNING, logger="reel.vllm"):
                for _ in range(3):
                    await engine.generate([1], SamplingParams(max_tokens=2))
            assert engine.stats().version_spans_assumed == 2
    finally:
        peer.close()
    warnings = [r.getMessage() for r in caplog.records if "weight_versions" in r.getMessage()]
    assert len(warnings) == 1 and "assumed to be the one it started under (5)" in warnings[0]


def test_the_count_reaches_the_metrics_snapshot():
    aggregates = RunAggregates("r")
    aggregates.apply(WorkerStats(run="r", producer="rollout:0", seq=0, worker="rollout:0", tokens_per_s=1.0, running=0,
                               waiting=0, policy_version=1, groups_published=0, version_spans_assumed=3))
    (view,) = aggregates.snapshot().workers
    assert view.version_spans_assumed == 3
