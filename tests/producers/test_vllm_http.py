"""The vLLM HTTP engine's own logic, without vLLM: the generate request body (exact JSON), parsing of
a response in vLLM's documented format built from real numpy arrays (np.save + base64), spans from
weight_versions, the pause / load / version / resume order across servers and the resume after a
failure, cancel -> abort, close -> EngineClosed, and the `vllm serve` line that loads Reel's weights.

`Peer` (tests/support/vllm_peer.py) is a small real HTTP server that records the calls it receives and answers
as vLLM's API documents (shared notes on the vLLM API). It is a test peer for protocol behaviour
only: it samples nothing, and says nothing about whether vLLM itself behaves so. The real server is
exercised by the `gpu` test at the end, which starts `vllm serve` where vLLM and CUDA are.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobError
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightShard, encode_manifest
from reel.producers.engine import EngineClosed, EngineError, SamplingParams
from reel.producers.make_engine import make_engine
from reel.producers.vllm import known_spans
from reel.producers.vllm_worker import LOAD_MANIFEST, LOAD_WEIGHTS, ReelWorkerExtension
from reel.producers.vllm_auth import RequireKey
from reel.producers.vllm_http import GENERATE, VLLMHTTPEngine, generate_body, parse_generate_response
from reel.runtime.config import run as config
from reel.runtime.launch import vllm_args
from reel.runtime.launch.vllm_args import Pool
from reel.runtime.model.config import MoEConfig
from reel.runtime.weights.load import WeightLoadError
from reel.runtime.weights.publish import publish_version
from vllm_peer import K, L, Peer, vllm_response


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(**kwargs: Any) -> Peer:
        made.append(Peer(**kwargs))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(MoEConfig(vocab_size=50).to_hf_dict()))
    return directory


def engine(model_dir: Path, url: str, servers: list[str] | None = None, **kwargs: Any) -> VLLMHTTPEngine:
    return VLLMHTTPEngine(model_dir, url=url, servers=servers or [], blobs=BlobStore(model_dir.parent / "blobs"),
                          version=kwargs.pop("version", 7), **kwargs)


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 5 s")


def test_generate_body_is_the_documented_json() -> None:
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=12, stop_token_ids=(2,), seed=100)
    assert generate_body([5, 6, 7], params, 0, 4, 7, "reel-ab-3") == {
        "request_id": "reel-ab-3", "token_ids": [5, 6, 7],
        "sampling_params": {"n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 12, "seed": 100, "logprobs": 0,
                            "stop_token_ids": [2], "ignore_eos": True, "detokenize": False,
                            "routed_experts_prompt_start": 0},
        "cache_salt": "v7", "output_mode": "tokens", "stream": False}
    # A later run of the group's samples starts at its first sample's seed (vLLM's child i: seed + i).
    later = generate_body([5], params, 3, 1, 7, "reel-ab-4")["sampling_params"]
    assert (later["n"], later["seed"]) == (1, 103)


async def test_a_group_is_one_request_split_at_max_batch_with_each_sample_seeded(peers, model_dir: Path) -> None:
    peer = peers()
    async with engine(model_dir, peer.url, max_batch=4) as e:
        samples = await e.generate([1, 2], SamplingParams(n=10, max_tokens=2, seed=50))
    bodies = [c.body["sampling_params"] for c in peer.calls if c.path == GENERATE]
    assert sorted((b["seed"], b["n"]) for b in bodies) == [(50, 4), (54, 4), (58, 2)]
    assert [s.seed for s in samples] == list(range(50, 60))


def test_choices_that_are_not_the_requested_samples_are_refused() -> None:
    body = vllm_response(2, [1], [-1.0], [], n=3)
    body["choices"].pop()
    with pytest.raises(EngineError, match=r"answered choices \[1, 2\] for 3 samples"):
        parse_generate_response(json.dumps(body).encode(), "here", 3)


def test_a_recorded_response_parses_to_tokens_logprobs_routing_and_spans() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    body = vllm_response(4, [9, 8, 7, 6, 2], [-0.1, -0.2, -0.3, -0.4, -0.5], spans)
    (out,) = parse_generate_response(json.dumps(body).encode(), "here", 1)
    assert out.tokens == [9, 8, 7, 6, 2] and out.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert out.finish_reason == "stop" and out.spans == [(0, 3), (2, 4)]
    assert out.routing.dtype == np.uint16 and out.routing.shape == (8, L, K)
    assert out.routing.tolist() == (np.arange(8 * L * K) % 8).reshape(8, L, K).tolist()


def test_weight_version_labels_that_are_no_reel_version_take_the_version_before() -> None:
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3},
             {"version": "default", "start": 3, "end": 5}]
    (out,) = parse_generate_response(json.dumps(vllm_response(4, [9, 8, 7, 6, 2], [-0.1] * 5, spans)).encode(),
                                     "here", 1)
    assert out.spans == [(0, None), (2, 4), (3, None)]
    assert known_spans(out.spans, 3) == [(0, 3), (2, 4)]
    assert known_spans([], 3) == [(0, 3)]


def test_routed_experts_are_cut_to_the_moe_layers(tmp_path: Path) -> None:
    """vLLM returns a row per hidden layer, dense ones included; Reel keeps the MoE layers."""
    (tmp_path / "config.json").write_text(json.dumps(MoEConfig(vocab_size=50, num_hidden_layers=3,
                                                               mlp_only_layers=[1]).to_hf_dict()))
    e = VLLMHTTPEngine(tmp_path, url="http://h:1", blobs=None, routed_experts=True)
    every_layer = np.arange(4 * 3 * 2).reshape(4, 3, 2)
    routing = e._routing(every_layer, 4)
    assert routing.shape == (4, 2, 2) and routing.tolist() == every_layer[:, [0, 2], :].tolist()


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c.update(routed_experts="not base64!"), "not a base64 .npy"),
    (lambda c: c.pop("token_ids"), r"token_ids"),
])
def test_a_body_reel_cannot_read_names_the_server(change: Callable[[dict], Any], message: str) -> None:
    body = vllm_response(2, [1], [-1.0], [])
    change(body["choices"][0])
    with pytest.raises(EngineError, match=message) as raised:
        parse_generate_response(json.dumps(body).encode(), "vLLM server http://h:8000: POST /inference/v1/generate", 1)
    assert "http://h:8000" in str(raised.value)


async def test_no_weight_versions_means_the_start_version_and_no_routing_is_empty_without_replay(
        peers, model_dir: Path) -> None:
    peer = peers(answer=lambda body: vllm_response(1, [3], [-1.0], None, routing=False))
    async with engine(model_dir, peer.url, version=5, routed_experts=False) as e:
        (completion,) = await e.generate([1], SamplingParams(max_tokens=1))
    assert completion.spans == [(0, 5)] and completion.routing.shape == (0, L, K)


@pytest.mark.parametrize(("prompt_len", "routing", "message"), [
    (2, False, "--enable-return-routed-experts"),  # router replay needs routing
    (3, True, r"shape \(3, 2, 2\); expected \(2, 2, 2\)"),  # one row per token but the last sampled one
])
async def test_routing_missing_or_misaligned_is_refused(peers, model_dir: Path, prompt_len: int, routing: bool,
                                                         message: str) -> None:
    peer = peers(answer=lambda body: vllm_response(prompt_len, [3], [-1.0], [], routing=routing))
    async with engine(model_dir, peer.url) as e:
        with pytest.raises(EngineError, match=message):
            await e.generate([1, 2], SamplingParams(max_tokens=1))


async def test_a_dropped_generate_connection_is_sent_once_more_then_reported(peers, model_dir: Path) -> None:
    once, twice = peers(drop=1), peers(drop=2)
    async with engine(model_dir, once.url) as e:
        (completion,) = await e.generate([1], SamplingParams(max_tokens=2))
    assert completion.tokens == [4, 2] and once.paths() == [GENERATE, GENERATE]
    assert once.calls[1].body["request_id"] != once.calls[2].body["request_id"]  # calls[0]: /health
    async with engine(model_dir, twice.url) as e:
        with pytest.raises(EngineError, match=f"{twice.url}: POST {GENERATE} failed: RemoteProtocolError"):
            await e.generate([1], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("failing", ["/pause", "/collective_rpc", "/update_weight_version"])
async def test_a_failed_step_still_resumes_every_server(peers, model_dir: Path, failing: str) -> None:
    a, b = peers(), peers(fail={failing: 500})
    async with engine(model_dir, a.url, [a.url, b.url], version=-1) as e:
        ref = e.blobs.put(b"not read by this peer")
        with pytest.raises(EngineError, match=f"{b.url}: POST {failing} answered HTTP 500"):
            await e.update_weights(ref, 5)
        assert e.version == -1
    assert a.paths()[-1] == b.paths()[-1] == "/resume"


async def test_missing_endpoints_and_servers_say_what_to_set(peers, model_dir: Path) -> None:
    peer = peers(fail={"/pause": 404})
    async with engine(model_dir, peer.url) as e:
        with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
            await e.update_weights(e.blobs.put(b"w"), 1)
    peer = peers(fail={GENERATE: 403})  # what vLLM answers when started without --enable-scale-out
    async with engine(model_dir, peer.url) as e:
        with pytest.raises(EngineError, match="--enable-scale-out"):
            await e.generate([1], SamplingParams(max_tokens=1))
    gone = peers()
    gone.close()
    with pytest.raises(EngineError, match=f"vLLM server {gone.url} was not healthy after 0 s.*GET /health failed"):
        await engine(model_dir, gone.url, startup_timeout_s=0.2).start()


async def test_close_fails_unfinished_requests_with_engine_closed(peers, model_dir: Path) -> None:
    peer = peers()
    peer.release.clear()
    e = engine(model_dir, peer.url)
    await e.start()
    task = asyncio.create_task(e.generate([1], SamplingParams(max_tokens=1)))
    await until(lambda: GENERATE in peer.paths())
    await e.close()
    with pytest.raises(EngineClosed):
        await task
    with pytest.raises(EngineClosed):
        await e.generate([1], SamplingParams())
    assert "/inference/v1/abort_requests" not in peer.paths()  # closing the connection is vLLM's abort


def toml(router_replay: bool, model: str = "/m", serve_args: str = "") -> config.Config:
    return config.loads(f'[model]\npath = "{model}"\n[engine]\nkind = "vllm"\nserve_args = "{serve_args}"\n'
                        f'[trainer]\nrouter_replay = {str(router_replay).lower()}\n')


def test_make_engine_talks_http_when_the_job_exported_reel_vllm_url(monkeypatch, model_dir: Path) -> None:
    monkeypatch.setenv("REEL_VLLM_URL", "http://router:9000")
    monkeypatch.setenv("REEL_VLLM_SERVERS", "http://p:8000,http://d:8000")
    blobs = BlobStore(model_dir.parent / "blobs")
    leader, follower = (make_engine(toml(False), model_dir, blobs, worker) for worker in (0, 1))
    assert isinstance(leader, VLLMHTTPEngine) and leader.url == "http://router:9000"
    assert leader.servers == ["http://p:8000", "http://d:8000"] and leader.version == -1
    assert leader.push_weights and not follower.push_weights and not leader.routed_experts
    assert make_engine(toml(True), model_dir, blobs).routed_experts
    monkeypatch.delenv("REEL_VLLM_URL")
    if importlib.util.find_spec("vllm") is None:  # in-process AsyncLLM: says what to install
        with pytest.raises(EngineError, match="pip install"):
            make_engine(toml(True), model_dir, blobs)


@pytest.mark.parametrize("router_replay", [True, False])
def test_the_serve_line_loads_reel_weights_through_dev_endpoints(router_replay: bool) -> None:
    c, pool = toml(router_replay), Pool("rollout", 1, "--rollout-nodes")
    argv = vllm_args.serve_argv(c, pool, 0, "10.0.0.1")
    module, _, name = argv[argv.index("--worker-extension-cls") + 1].rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    assert extension is ReelWorkerExtension
    assert callable(getattr(extension, LOAD_WEIGHTS)) and callable(getattr(extension, LOAD_MANIFEST))
    assert ("--enable-return-routed-experts" in argv) == router_replay
    assert "--enable-scale-out" in argv  # the token-ids generate route answers 403 without it
    assert vllm_args.serve_env(c, pool, 0, "10.0.0.1")["VLLM_SERVER_DEV_MODE"] == "1"
    assert argv[argv.index("--host") + 1] == "10.0.0.1"  # the node's address, never 0.0.0.0
    module, _, name = argv[argv.index("--middleware") + 1].rpartition(".")
    assert getattr(importlib.import_module(module), name) is RequireKey  # the key on every route


def test_the_worker_extension_loads_only_the_runs_blob_of_that_hash(tmp_path: Path, monkeypatch) -> None:
    """Whoever calls /collective_rpc names a path and a hash: only the run's blob of that hash is read,
    through the blob store's checks, before any model is touched."""
    store = BlobStore(tmp_path / "blobs")
    ref = store.put(b"safetensors bytes")
    secret = tmp_path / "secret"
    secret.write_bytes(b"private")
    monkeypatch.delenv(vllm_args.BLOBS_ENV, raising=False)
    with pytest.raises(ValueError, match="REEL_BLOBS_DIR is not set"):
        ReelWorkerExtension().reel_load_weights(str(store.path(ref)), ref.sha256)
    monkeypatch.setenv(vllm_args.BLOBS_ENV, str(store.root))
    sha = hashlib.sha256(b"private").hexdigest()
    with pytest.raises(ValueError, match="is not the blob"):  # any file whose hash the caller supplies
        ReelWorkerExtension().reel_load_weights(str(secret), sha)
    with pytest.raises(ValueError, match="is not in the run's store"):
        ReelWorkerExtension().reel_load_weights(str(store.root / sha[:2] / sha), sha)
    store.path(ref).unlink()
    store.path(ref).symlink_to(secret)
    with pytest.raises(BlobError, match="symbolic link"):
        ReelWorkerExtension().reel_load_weights(str(store.path(ref)), ref.sha256)


def test_the_worker_extension_refuses_a_bad_manifest_before_touching_the_model(tmp_path: Path, monkeypatch) -> None:
    """The manifest and every shard come from the run's store by hash and are checked first: the
    extension has no model here, so reaching it would be an AttributeError, not these refusals."""
    store = BlobStore(tmp_path / "blobs")
    torch.manual_seed(0)
    tensors = [(f"t{i}", torch.randn(64)) for i in range(8)]
    monkeypatch.setenv(vllm_args.BLOBS_ENV, str(store.root))
    worker = ReelWorkerExtension()
    with pytest.raises(ValueError, match="weight manifest .* is not in the run's store"):
        worker.reel_load_manifest("ab" * 32)
    ref, manifest = publish_version(store, tensors, version=1, step=1, shard_bytes=512)
    outside = tmp_path / "outside"
    outside.write_bytes(store.path(manifest.shards[1].blob).read_bytes())
    shard = manifest.shards[1]
    moved = WeightShard(blob=BlobRef(uri=outside.as_uri(), sha256=shard.blob.sha256, nbytes=shard.blob.nbytes),
                        rank=0, tensors=shard.tensors)
    elsewhere = store.put(encode_manifest(msgspec.structs.replace(manifest, shards=[manifest.shards[0], moved])))
    with pytest.raises(WeightLoadError, match="outside the blob store"):
        worker.reel_load_manifest(elsewhere.sha256)
    path = store.path(shard.blob)
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    with pytest.raises(WeightLoadError, match="is corrupted"):
        worker.reel_load_manifest(ref.sha256)
    monkeypatch.delenv(vllm_args.BLOBS_ENV)
    with pytest.raises(ValueError, match="REEL_BLOBS_DIR is not set"):
        worker.reel_load_manifest(ref.sha256)


@pytest.fixture
def vllm_serve(tmp_path: Path) -> Iterator[str]:
    """`vllm serve` on a tiny Reel model with the flags and environment `reel launch slurm` renders; its URL."""
    from reel.runtime.model.model import MoEModel
    from reel.runtime.model.weights import save

    torch.manual_seed(0)
    save(MoEModel(MoEConfig(vocab_size=64, initializer_range=0.1)), tmp_path / "model")
    c = toml(True, str(tmp_path / "model"), "--enforce-eager --gpu-memory-utilization 0.3")
    pool, port = Pool("rollout", 1, "--rollout-nodes"), 18000 + os.getpid() % 1000
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *vllm_args.serve_argv(c, pool, 0, "127.0.0.1")[1:]]
    argv[argv.index("--port") + 1] = str(port)
    with open(tmp_path / "vllm.log", "wb") as out:
        env = os.environ | vllm_args.serve_env(c, pool, 0, "127.0.0.1") | {
            vllm_args.BLOBS_ENV: str(tmp_path / "blobs"), "VLLM_API_KEY": os.environ.setdefault("VLLM_API_KEY", "k")}
        server = subprocess.Popen(argv, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while not _answers(url + "/health"):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "vllm.log").read_text()[-4000:]
            time.sleep(5)
        yield url
    finally:
        server.terminate()
        server.wait(120)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                    reason="needs vLLM and CUDA")
async def test_a_real_vllm_serve_generates_and_swaps_weights(vllm_serve: str, tmp_path: Path) -> None:
    from reel.runtime.model.weights import load, state_dict_bytes

    model = load(tmp_path / "model")
    async with engine(tmp_path / "model", vllm_serve, version=-1) as e:
        await e.update_weights(e.blobs.put(state_dict_bytes(model)), 0)
        (first,) = await e.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
        assert first.spans[0] == (0, 0) and len(first.logprobs) == len(first.tokens)
        assert first.routing.shape == (3 + len(first.tokens) - 1, L, K)
        with torch.no_grad():  # new weights that always emit token 7 (tests/producers/test_engine.py's forcing model)
            model.model.embed_tokens.weight[:, 0] = 100.0
            model.model.norm.weight.zero_()
            model.model.norm.weight[0] = 1.0
            model.lm_head.weight.zero_()
            model.lm_head.weight[7, 0] = 10.0
        await e.update_weights(e.blobs.put(state_dict_bytes(model)), 1)
        (forced,) = await e.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
        assert forced.tokens == [7] * 8 and forced.spans == [(0, 1)]
