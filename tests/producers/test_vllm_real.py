"""Reel's vLLM engines against a real vLLM (the CPU build `ops/install_vllm.sh` installs; fp32, token ids).

One `vllm serve` for the session (tests/producers/conftest.py), started with the same command line
`reel run` uses (vllm_args.local_serve_argv), on a tiny random Qwen3-MoE written by Reel's own `save`
(tests/support/vllm_setup.py; one dense layer, so vLLM serves Reel's `mlp_only_layers` too). Logprobs are checked against Reel's own
forward on the same weights. What a real server cannot be made to do (a dropped connection, a 5xx)
stays with the protocol tests in test_vllm_http.py. Routed-expert capture needs a GPU (Model
Runner V2): on this CPU router replay is refused before vLLM starts, which is tested here too.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import re
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest, encode_manifest
from reel.producers.engine import Completion, EngineError, SamplingParams
from reel.producers.vllm import VLLMEngine
from reel.runtime.config import run as config_mod
from reel.runtime.launch import vllm_args
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import hub_tensors, state_dict_bytes
from reel.runtime.weights.delta import full_of, publish_delta
from reel.runtime.weights.load import WeightLoadError
from reel.runtime.weights.publish import publish_version
from vllm_setup import RUN, TINY, http_engine, push, reel_logprobs, tiny_model
from weight_setup import ranks_version
from paths import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [5, 17, 33, 2, 60, 41, 8]


@pytest.mark.parametrize("key", [None, "Bearer wrong-key", "bearer"])
def test_the_server_refuses_every_control_call_without_the_runs_key(server, server_blobs, key) -> None:
    """vLLM's own --api-key leaves the dev-mode routes open; Reel's middleware does not."""
    blobs = BlobStore(server_blobs)
    ref = blobs.put(b"not even safetensors")
    calls = [("POST", "/pause", None), ("POST", "/resume", None),
             ("POST", "/collective_rpc", {"method": "reel_load_weights", "args": [str(blobs.path(ref)), ref.sha256]}),
             ("POST", "/update_weight_version", {"new_version": "1000000000"}), ("GET", "/get_world_size", None),
             ("GET", "/v1/models", None), ("POST", "/inference/v1/generate", {}), ("GET", "/metrics", None)]
    headers = {"Authorization": key} if key else {}
    with httpx.Client(base_url=server, trust_env=False, timeout=30) as client:
        for method, path, body in calls:
            assert client.request(method, path, json=body, headers=headers).status_code == 401, path
        assert client.get("/health").status_code == 200  # the readiness probe stays open
        authorized = {"Authorization": f"Bearer {os.environ['VLLM_API_KEY']}"}
        assert client.get("/v1/models", headers=authorized).status_code == 200


def _greedy_tokens(model: MoEModel, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _manifest(blobs: BlobStore, model: MoEModel, version: int) -> tuple[BlobRef, WeightManifest]:
    """`model` published as the trainer publishes it, in shards of 32 KiB (several for the tiny model)."""
    return publish_version(blobs, hub_tensors(model.state_dict(), model.config), version=version, step=version,
                           shard_bytes=32 << 10)


async def test_http_greedy_and_sampled_logprobs_match_reels_forward(models, served, server, server_blobs) -> None:
    assert served.version_at_start == -1  # a fresh server says "default": no Reel version
    blobs = BlobStore(server_blobs)
    async with http_engine(models, server, blobs) as engine:
        await push(engine, models[2], blobs, 0)  # not the weights it started with: the load must really happen
        assert await engine._server_version(server) == 0
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24))
        assert greedy.tokens == _greedy_tokens(models[2], PROMPT, 24)
        assert greedy.spans == [(0, 0)] and greedy.finish_reason == "length"
        assert greedy.routing.shape == (0, len(TINY.moe_layers), TINY.num_experts_per_tok)
        sampled = await engine.generate(PROMPT, SamplingParams(n=3, temperature=0.8, max_tokens=32, seed=7))
        for sample in sampled:
            want = reel_logprobs(models[2], PROMPT, sample.tokens, temperature=0.8)
            torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=1e-4, rtol=0)


async def test_http_a_manifest_swap_serves_what_a_one_blob_swap_serves(models, server, server_blobs) -> None:
    blobs = BlobStore(server_blobs)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=11)
    async with http_engine(models, server, blobs) as engine:
        await push(engine, models[2], blobs, 40)
        by_blob = await engine.generate(PROMPT, params)
        await push(engine, models[1], blobs, 41)  # other weights between: the manifest load must really happen
        ref, manifest = _manifest(blobs, models[2], 42)
        assert len(manifest.shards) > 2
        await engine.update_weights(manifest, 42, ref=ref)
        assert await engine._server_version(server) == 42
        by_manifest = await engine.generate(PROMPT, params)
    assert [c.tokens for c in by_manifest] == [c.tokens for c in by_blob]
    assert [c.logprobs for c in by_manifest] == [c.logprobs for c in by_blob]  # the same weights, bit for bit
    assert all(c.spans == [(0, 42)] for c in by_manifest)
    for sample in by_manifest:
        torch.testing.assert_close(torch.tensor(sample.logprobs), reel_logprobs(models[2], PROMPT, sample.tokens),
                                   atol=1e-4, rtol=0)


def _changed(model: MoEModel, by: float) -> MoEModel:
    """`model` with a few elements changed (the delta is smaller than the version): some of lm_head,
    two rows of k_proj (part of vLLM's fused qkv_proj) and rows of one expert of layer 0 (one of
    vLLM's FusedMoE layer's experts, packed on CPU)."""
    new = copy.deepcopy(model)
    params = dict(new.named_parameters())
    with torch.no_grad():
        params["lm_head.weight"][:, :8] += by
        params["model.layers.0.self_attn.k_proj.weight"][:2] += by / 2
        params["model.layers.0.mlp.experts.up_proj"][1, :4] += by / 2
    return new


def _delta(blobs: BlobStore, new: MoEModel, base: WeightManifest, version: int) -> tuple[BlobRef, WeightManifest]:
    full = _manifest(blobs, new, version)[1]
    return publish_delta(blobs, hub_tensors(new.state_dict(), new.config), base, full, shard_bytes=32 << 10)


def _loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the worker said it loaded, per update (the engine's log lines), and forget them."""
    lines = [r.getMessage() for r in caplog.records if r.name == "reel.vllm" and " load, " in r.getMessage()]
    caplog.clear()
    return lines


async def test_http_a_delta_swap_serves_the_bits_of_a_full_swap(models, server, server_blobs, caplog) -> None:
    """The worker rebuilds only the layers a delta touches, from the held version's shards; a worker
    that missed the base, or whose delta is corrupted, loads the version's full shards."""
    caplog.set_level(logging.INFO, logger="reel.vllm")
    blobs = BlobStore(server_blobs)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=13)
    new = _changed(models[1], 0.5)
    async with http_engine(models, server, blobs) as engine:
        base_ref, base = _manifest(blobs, models[1], 50)
        full_ref, full = _manifest(blobs, new, 51)
        delta_ref, delta = _delta(blobs, new, base, 51)
        assert delta.base_version == 50 and len(delta.shards) < len(full.shards)
        await engine.update_weights(base, 50, ref=base_ref)
        await engine.update_weights(full, 51, ref=full_ref)
        by_full = await engine.generate(PROMPT, params)
        await engine.update_weights(base, 50, ref=base_ref)
        _loads(caplog)
        await engine.update_weights(delta, 51, ref=delta_ref)
        by_delta = await engine.generate(PROMPT, params)
        loaded, = _loads(caplog)
        assert "delta load" in loaded, loaded
        delta_read = float(re.search(r"([\d.]+) MB of shards read", loaded).group(1))
        full_read = sum(s.blob.nbytes for s in full.shards) / 1e6
        assert delta_read < full_read / 2, (delta_read, full_read)
        print(f"bytes read per swap: delta {delta_read} MB, full {full_read:.3f} MB")
        # Missed a version: the delta's base (52) is not what the worker holds (51).
        newer = _changed(new, 0.25)
        missed_ref, missed = _delta(blobs, newer, _manifest(blobs, new, 52)[1], 53)
        await engine.update_weights(missed, 53, ref=missed_ref)
        assert "full load" in (line := _loads(caplog)[0]) and "not the delta's base 52" in line, line
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
        assert greedy.spans == [(0, 53)] and greedy.tokens == _greedy_tokens(newer, PROMPT, 16)
        # A corrupted delta on the held version: nothing changes until the full shards are loaded.
        newest = _changed(newer, 0.5)
        bad_ref, bad = _delta(blobs, newest, _manifest(blobs, newer, 53)[1], 54)
        _damage(blobs, bad, "corrupt", Path())
        await engine.update_weights(bad, 54, ref=bad_ref)
        assert "full load" in (line := _loads(caplog)[0]) and "is corrupted" in line, line
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
        assert greedy.spans == [(0, 54)] and greedy.tokens == _greedy_tokens(newest, PROMPT, 16)
        # Its full shards corrupted too (sent to the worker directly): refused, version 54 serves on.
        worst_ref, worst = _delta(blobs, _changed(newest, 1.0), _manifest(blobs, newest, 54)[1], 55)
        _damage(blobs, worst, "corrupt", Path())
        _damage(blobs, full_of(worst), "corrupt", Path())
        with pytest.raises(EngineError, match="HTTP 500"):
            await engine._each("/collective_rpc", body={"method": "reel_load_manifest", "args": [worst_ref.sha256]})
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
        assert greedy.tokens == _greedy_tokens(newest, PROMPT, 16)
    assert [c.tokens for c in by_delta] == [c.tokens for c in by_full]
    assert [c.logprobs for c in by_delta] == [c.logprobs for c in by_full]  # the same weights, bit for bit
    assert all(c.spans == [(0, 51)] for c in by_delta)


async def test_http_a_version_in_pieces_serves_what_a_whole_one_serves(models, server, server_blobs) -> None:
    """Tensors N trainer ranks wrote as row pieces are put together for vLLM's loaders, bit for bit."""
    blobs = BlobStore(server_blobs)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=11)
    async with http_engine(models, server, blobs) as engine:
        ref, whole = _manifest(blobs, models[2], 55)
        await engine.update_weights(whole, 55, ref=ref)
        by_whole = await engine.generate(PROMPT, params)
        await push(engine, models[1], blobs, 56)  # other weights between: the pieces must really load
        pieces = ranks_version(blobs, models[2], 57)
        assert any(r[:2] != (0, r[2]) for s in pieces.shards for r in s.rows)
        await engine.update_weights(pieces, 57, ref=blobs.put(encode_manifest(pieces)))
        by_pieces = await engine.generate(PROMPT, params)
    assert [c.tokens for c in by_pieces] == [c.tokens for c in by_whole]
    assert [c.logprobs for c in by_pieces] == [c.logprobs for c in by_whole]


def _damage(blobs: BlobStore, manifest: WeightManifest, damage: str, tmp_path: Path) -> WeightManifest:
    shard = manifest.shards[min(1, len(manifest.shards) - 1)]
    path = blobs.path(shard.blob)
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "missing":
        path.unlink()
    else:  # a ref naming a file outside the store
        outside = tmp_path / "outside.safetensors"
        outside.write_bytes(path.read_bytes())
        moved = msgspec.structs.replace(
            shard, blob=BlobRef(uri=outside.as_uri(), sha256=shard.blob.sha256, nbytes=shard.blob.nbytes))
        return msgspec.structs.replace(manifest, shards=[manifest.shards[0], moved, *manifest.shards[2:]])
    return manifest


@pytest.mark.parametrize(("damage", "reason"), [("corrupt", "is corrupted"), ("missing", "not found"),
                                                ("outside", "outside the blob store")])
async def test_http_a_bad_shard_is_refused_and_the_old_version_keeps_serving(models, server, server_blobs, tmp_path,
                                                                             damage: str, reason: str) -> None:
    blobs = BlobStore(server_blobs)
    async with http_engine(models, server, blobs) as engine, http_engine(models, server, blobs, push_weights=False) as follower:
        await push(engine, models[1], blobs, 60)
        _, manifest = _manifest(blobs, tiny_model(7), 61)
        damaged = _damage(blobs, manifest, damage, tmp_path)
        ref = blobs.put(encode_manifest(damaged))  # as published: WeightsPublished names the manifest's blob
        with pytest.raises(WeightLoadError, match=reason):  # what the rollout worker dead-letters
            await engine.update_weights(damaged, 61, ref=ref)
        with pytest.raises(WeightLoadError, match=reason):  # a follower does not wait for it
            await follower.update_weights(damaged, 61, ref=ref)
        assert await engine._server_version(server) == 60
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
    assert greedy.spans == [(0, 60)] and greedy.tokens == _greedy_tokens(models[1], PROMPT, 16)


@pytest.mark.parametrize("damage", ["corrupt", "outside"])
async def test_the_worker_itself_refuses_a_bad_manifest_before_any_weight_changes(models, server, server_blobs,
                                                                                  tmp_path, damage: str) -> None:
    """Whoever holds the run's key can call /collective_rpc directly: the worker checks every shard too."""
    blobs = BlobStore(server_blobs)
    async with http_engine(models, server, blobs) as engine:
        await push(engine, models[1], blobs, 70)
        _, manifest = _manifest(blobs, tiny_model(8), 71)
        ref = blobs.put(encode_manifest(_damage(blobs, manifest, damage, tmp_path)))
        with pytest.raises(EngineError, match="HTTP 500"):
            await engine._each("/collective_rpc", body={"method": "reel_load_manifest", "args": [ref.sha256]})
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
    assert greedy.tokens == _greedy_tokens(models[1], PROMPT, 16)


async def test_http_seeded_samples_reproduce(models, server, server_blobs) -> None:
    blobs = BlobStore(server_blobs)
    async with http_engine(models, server, blobs) as engine:
        await push(engine, models[1], blobs, 3)
        params = SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=1234)
        first = await engine.generate(PROMPT, params)
        again = await engine.generate(PROMPT, params)
        assert [c.tokens for c in first] == [c.tokens for c in again]
        assert [c.logprobs for c in first] == [c.logprobs for c in again]
        assert len({tuple(c.tokens) for c in first}) > 1  # sample i has its own seed (seed + i)
        assert [c.seed for c in first] == [1234, 1235, 1236, 1237]


async def test_http_seeded_prompts_longer_than_a_default_step_budget_are_served(models, server, server_blobs) -> None:
    """16 seeded 200-token prompts at once (3200 tokens) exceed vLLM's default 2048-token step:
    split, a seeded prefill kills the CPU engine; the command line `reel run` uses keeps them whole."""
    blobs = BlobStore(server_blobs)
    long_prompt = [(7 * i) % 90 + 3 for i in range(200)]
    async with http_engine(models, server, blobs) as engine:
        await push(engine, models[1], blobs, 5)
        params = SamplingParams(n=16, temperature=1.0, max_tokens=4, seed=99)
        samples = await engine.generate(long_prompt, params)
        assert len(samples) == 16 and all(len(s.tokens) == 4 for s in samples)


async def test_http_weight_push_mid_generation_changes_outputs_and_spans_say_where(models, server,
                                                                                  server_blobs) -> None:
    blobs = BlobStore(server_blobs)
    old, new = models[1], models[2]
    async with http_engine(models, server, blobs) as engine:
        # 1000 greedy tokens take vLLM's CPU build a second or more; a busy machine can admit the
        # request late, so a push that came before its first token is tried again, later.
        for attempt, wait_s in enumerate((0.2, 0.6, 1.2)):
            v = 10 + 2 * attempt
            await push(engine, old, blobs, v)
            running = asyncio.create_task(engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1000)))
            await _until(lambda: engine._running > 0)
            await asyncio.sleep(wait_s)
            await push(engine, new, blobs, v + 1)
            completion: Completion = (await running)[0]
            if len(completion.spans) == 2:
                break
        assert len(completion.spans) == 2, f"no push landed mid-generation in 3 tries: {completion.spans}"
        (start_old, v_old), (swap, v_new) = completion.spans
        assert (start_old, v_old, v_new) == (0, v, v + 1) and 0 < swap < len(completion.tokens)
        # Before the swap: the old weights' tokens and logprobs. After it: the new weights decide.
        assert completion.tokens[:swap] == _greedy_tokens(old, PROMPT, swap)
        torch.testing.assert_close(torch.tensor(completion.logprobs[:swap]),
                                   reel_logprobs(old, PROMPT, completion.tokens[:swap]), atol=1e-4, rtol=0)
        after = reel_logprobs(old, PROMPT, completion.tokens)[swap:]
        assert (after - torch.tensor(completion.logprobs[swap:])).abs().max() > 1e-2
        fresh, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
        assert fresh.spans == [(0, v + 1)] and fresh.tokens == _greedy_tokens(new, PROMPT, 16)


async def test_http_cancelled_request_is_aborted_on_the_server(models, server, server_blobs) -> None:
    blobs = BlobStore(server_blobs)
    generated, asked = "vllm:generation_tokens_total", 16 * 1000
    async with http_engine(models, server, blobs) as engine:
        await push(engine, models[1], blobs, 20)
        # The server decodes 16 x 1000 tokens in a second or two, sooner than a test process starved of the CPU
        # (CI) cancels them. So once it decodes, it is paused with the request kept (as for a weight update)
        # and the cancel lands in flight; a request it finished before the pause is asked again (3 times at most).
        try:
            for _ in range(3):
                before = await _metric(server, generated)
                running = asyncio.create_task(engine.generate(PROMPT, SamplingParams(n=16, temperature=1.0,
                                                                                     max_tokens=1000)))
                while not running.done() and await _metric(server, generated) == before:
                    await asyncio.sleep(0.05)
                await _control(server, "/pause", {"mode": "keep", "clear_cache": "false"})
                await asyncio.sleep(0.5)  # the tokens decoded before the pause reach the count
                if await _metric(server, generated) - before < asked:
                    break
                await _control(server, "/resume")
                await running
            else:
                pytest.fail(f"the server finished {asked} tokens before each of 3 pauses")
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
        finally:
            await _control(server, "/resume")  # the server is shared: never leave it paused
        # The server stopped decoding them: its token count settles short of 16 x 1000.
        settled, last = None, -1.0
        while settled is None:
            await asyncio.sleep(1.0)
            now = await _metric(server, generated)
            settled, last = (now if now == last else None), now
        assert 0 < settled - before < asked, settled - before


async def test_http_follower_waits_for_the_version_worker_0_pushes(models, server, server_blobs) -> None:
    blobs = BlobStore(server_blobs)
    async with http_engine(models, server, blobs) as pusher, http_engine(models, server, blobs, push_weights=False) as follower:
        await push(pusher, models[1], blobs, 30)
        ref = blobs.put(state_dict_bytes(models[2]))
        waiting = asyncio.create_task(follower.update_weights(ref, 31))
        await asyncio.sleep(2.0)
        assert not waiting.done() and follower.version == -1
        await pusher.update_weights(ref, 31)
        await asyncio.wait_for(waiting, 30)
        assert follower.version == 31
        sample, = await follower.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        assert sample.spans == [(0, 31)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU captures routed experts: test_vllm_http's gpu test")
def test_router_replay_is_refused_on_a_cpu_vllm(models, tmp_path) -> None:
    """Routed-expert capture needs Model Runner V2 (GPU): refused with the key to change, never a crash."""
    with pytest.raises(EngineError, match="trainer.router_replay"):
        asyncio.run(VLLMEngine(models[0], precision="fp32", blobs=BlobStore(tmp_path), routed_experts=True).start())
    with pytest.raises(config_mod.ConfigError, match="trainer.router_replay = false"):
        vllm_args.check_local_server(config_mod.loads(RUN.replace("router_replay = false", "router_replay = true")))
    with pytest.raises(config_mod.ConfigError, match="engine.precision"):
        vllm_args.check_local_server(config_mod.loads(RUN.replace("max_batch = 16", 'precision = "bf16"')))


async def test_inprocess_asyncllm_matches_reels_forward_and_names_versions(models, tmp_path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    async with VLLMEngine(models[0], max_batch=8, precision="fp32", blobs=blobs, version=-1,
                          routed_experts=False) as engine:
        await push(engine, models[2], blobs, 0)
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
        assert greedy.tokens == _greedy_tokens(models[2], PROMPT, 16)
        assert greedy.spans == [(0, 0)]  # a Reel version, not vLLM's "default"
        sampled, = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16, seed=3))
        torch.testing.assert_close(torch.tensor(sampled.logprobs), reel_logprobs(models[2], PROMPT, sampled.tokens),
                                   atol=1e-4, rtol=0)
        ref, manifest = _manifest(blobs, models[1], 1)
        await engine.update_weights(manifest, 1, ref=ref)  # the manifest path, in process
        greedy, = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
        assert greedy.spans == [(0, 1)] and greedy.tokens == _greedy_tokens(models[1], PROMPT, 16)


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _control(server: str, path: str, params: dict[str, str] | None = None) -> None:
    """A control call with the run's key (pause, resume)."""
    async with httpx.AsyncClient(trust_env=False) as client:
        key = os.environ["VLLM_API_KEY"]
        answer = await client.post(server + path, params=params, headers={"Authorization": f"Bearer {key}"})
    answer.raise_for_status()


async def _metric(server: str, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics."""
    async with httpx.AsyncClient(trust_env=False) as client:
        key = os.environ["VLLM_API_KEY"]
        answer = await client.get(server + "/metrics", headers={"Authorization": f"Bearer {key}"})
    answer.raise_for_status()  # without the key it is a 401 page, whose metrics would all read 0
    text = answer.text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


async def test_the_liveness_probe_reads_a_real_servers_answers_and_a_frozen_one_gives_none(models, server, server_blobs,
                                                                                           tmp_path) -> None:
    """runtime/launch/server_probe.py on a real `vllm serve`: idle, generating, then frozen (SIGSTOP of the API
    server): no answer within the probe's timeout, so its beat ages and liveness names it."""
    from reel.runtime.heartbeat import read_beats
    from reel.runtime.launch import server_probe
    from reel.runtime.launch.liveness import Liveness

    probe = server_probe.ServerProbe("vllm", server, tmp_path, os.environ["VLLM_API_KEY"])
    assert probe.probe()
    idle = read_beats(tmp_path)["vllm"]
    assert (idle.phase, idle.waiting) == ("idle", True), idle  # vLLM's metrics were read: no request now
    async with http_engine(models, server, BlobStore(server_blobs)) as engine:
        await push(engine, models[1], BlobStore(server_blobs), 0)
        await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
    assert probe.probe()
    moved = read_beats(tmp_path)["vllm"]
    assert (moved.phase, moved.progress_count) == ("generating", 1), moved  # generation_tokens_total moved
    import psutil  # vLLM's own dependency

    port = int(server.rsplit(":", 1)[1])
    pid, = {c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}  # the API server
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert not probe.probe()  # no answer: nothing written
        assert time.monotonic() - started < server_probe.PROBE_TIMEOUT_S + 5
        liveness = Liveness(tmp_path, stall_s=1, drop_stale=False)
        verdict = liveness.decide(time.time() + 2)
        assert verdict.restart == ["vllm"] and verdict.lines[0].startswith("reel: vllm has made no progress for ")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert probe.probe()  # answers again


def test_the_vllm_example_learns_through_a_frozen_server_and_every_step_replays_bitwise(tmp_path, capsys) -> None:
    """examples/reverse_text_vllm.toml as a user runs it (`reel run` starts and stops its `vllm serve`), 25
    of its 50 steps, with the server frozen (SIGSTOP) early on: the probe's beat ages, the server is killed
    and started again with the rollout worker, and the run goes on. Its reward rises from 0.45 at the warm
    start to about 0.8 by step 25, the log verifies and every step replays bitwise. (One run for both: each
    `vllm serve` start costs the suite about a minute.)"""
    import json
    import subprocess
    import sys

    from reel.bus.events import StepCommitted, Trajectory
    from reel.bus.run_log import RunLog
    from reel.runtime.heartbeat import read_beats
    from reel.runtime.launch.cli import main

    run_dir, steps = tmp_path / "run", 25
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "run", str(REPO / "examples" / "reverse_text_vllm.toml"),
            "--out", str(run_dir), "--no-live", "--set", f"run.steps={steps}", "--set", "run.stall_s=8"]
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while (beat := read_beats(run_dir / "roles").get("rollout-0")) is None or beat.progress_count < 2:
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, "rollout worker 0 never published"
        time.sleep(0.2)
    frozen = int((run_dir / "roles" / "vllm.pid").read_text())
    os.kill(frozen, signal.SIGSTOP)
    out = run.communicate(timeout=900)[0]
    assert run.returncode == 0, out
    assert "reel: vllm has made no progress for " in out
    assert out.count("reel: killed vllm, which had stalled, and started it again") == 1, out
    assert "reel: killed rollout-0, whose vLLM server was restarted, and started it again" in out
    assert int((run_dir / "roles" / "vllm.pid").read_text()) != frozen
    assert "Application startup complete" in (run_dir / "roles" / "vllm.log").read_text()
    assert "vLLM server" in (run_dir / "roles" / "rollout-0.log").read_text()  # sampled through the HTTP engine

    with RunLog(run_dir, readonly=True) as log:
        commits = [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]
        spans = [s.spans for _, e in log.events("trajectories") if isinstance(e, Trajectory) for s in e.samples]
    assert [c.step for c in commits] == list(range(1, steps + 1))
    rewards = [c.metrics["reward_mean"] for c in commits]
    assert sum(rewards[-5:]) / 5 >= 0.7 and sum(rewards[-5:]) >= sum(rewards[:5]) + 1.0, rewards
    assert all(v >= 0 for sample in spans for _, v in sample)  # vLLM's labels were Reel versions throughout
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["replay", "range", f"1..{steps}", "--run", str(run_dir), "--recompute", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [row["recomputed"]["bitwise"] for row in rows] == [True] * steps
