"""The built-in engine against the model's full-sequence forward: tokens, logprobs, routing, weight swaps."""

from __future__ import annotations

import asyncio
import copy
import json
import math

import numpy as np
import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobError
from reel.bus.events import BlobRef
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import EngineClosed, EngineError, SamplingParams
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import state_dict_bytes

torch.set_num_threads(2)
VOCAB = 49
FORCED = 7  # the token the "new weights" of the update tests always produce


@pytest.fixture(scope="module")
def model() -> MoEModel:
    torch.manual_seed(0)
    # A larger init than HF's 0.02 makes logits and router scores far from ties.
    return MoEModel(MoEConfig(vocab_size=VOCAB, initializer_range=0.1)).eval()


def full_forward(model: MoEModel, ids: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logits [T, V] and routing [T, L, K] of one sequence through the uncached forward."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), return_routing=True)
    return out.logits[0], out.routing[0].numpy()


def greedy_reference(model: MoEModel, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(full_forward(model, ids)[0][-1].argmax()))
    return ids[len(prompt):]


def forcing_model(model: MoEModel) -> MoEModel:
    """A copy whose output is FORCED at every position, whatever the input.

    Dimension 0 of every embedding is large and positive, so it dominates the residual stream; the
    final norm keeps only that dimension and lm_head maps it to FORCED alone.
    """
    forced = copy.deepcopy(model)
    with torch.no_grad():
        forced.model.embed_tokens.weight[:, 0] = 100.0
        forced.model.norm.weight.zero_()
        forced.model.norm.weight[0] = 1.0
        forced.lm_head.weight.zero_()
        forced.lm_head.weight[FORCED, 0] = 10.0
    return forced


async def wait_steps(engine: BuiltinEngine, steps: int) -> None:
    target = engine.stats().steps + steps
    while engine.stats().steps < target:
        await asyncio.sleep(0.001)


async def test_greedy_matches_full_forward_with_staggered_arrivals(model: MoEModel, kernels: str) -> None:
    prompts = [[1, 5, 9], [1, 20, 21, 22, 23, 24, 25], [3], [1, 30, 31, 32], [1, 40, 41]]
    max_tokens = [12, 9, 14, 6, 10]
    # 3 slots for 5 requests: the last ones wait for a finished sequence's slot.
    engine = BuiltinEngine(model, max_batch=3, max_seq_len=32)
    tasks = []
    for prompt, n in zip(prompts, max_tokens):
        tasks.append(asyncio.create_task(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n))))
        await wait_steps(engine, 2)  # each request joins a running batch at a different step
    results = await asyncio.gather(*tasks)
    await engine.close()
    for prompt, n, (completion,) in zip(prompts, max_tokens, results):
        assert completion.tokens == greedy_reference(model, prompt, n)
        assert completion.finish_reason == "length" and completion.spans == [(0, 0)]
        logits_TV, routing_TLK = full_forward(model, prompt + completion.tokens[:-1])
        expected = torch.log_softmax(logits_TV[len(prompt) - 1:], -1)[torch.arange(n), completion.tokens]
        np.testing.assert_allclose(completion.logprobs, expected.numpy(), atol=1e-5, rtol=0)
        assert completion.routing.dtype == np.uint8
        assert completion.routing.shape == (len(prompt) + n - 1, 2, 2)
        np.testing.assert_array_equal(completion.routing, routing_TLK)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
async def test_sampled_logprob_is_that_of_the_sampling_distribution(model: MoEModel, temperature: float,
                                                                    top_p: float, kernels: str) -> None:
    prompt = [1, 11, 12, 13]
    async with BuiltinEngine(model, max_batch=4, max_seq_len=32) as engine:
        samples = await engine.generate(prompt, SamplingParams(n=4, temperature=temperature, top_p=top_p,
                                                               max_tokens=10, seed=3))
    assert [s.seed for s in samples] == [3, 4, 5, 6]
    assert len({tuple(s.tokens) for s in samples}) > 1
    for sample in samples:
        logits_TV, routing_TLK = full_forward(model, prompt + sample.tokens[:-1])
        logp_TV = torch.log_softmax(logits_TV[len(prompt) - 1:] / temperature, -1)
        for j, token in enumerate(sample.tokens):
            probs = logp_TV[j].exp()
            ranked = probs.sort(descending=True)
            nucleus = ranked.indices[(ranked.values.cumsum(0) - ranked.values) < top_p]
            assert token in nucleus.tolist()
            expected = logp_TV[j, token] - torch.logsumexp(logp_TV[j, nucleus], 0)
            assert math.isclose(sample.logprobs[j], float(expected), abs_tol=1e-5)
        np.testing.assert_array_equal(sample.routing, routing_TLK)


async def test_a_seeded_sample_does_not_depend_on_its_batch(model: MoEModel) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=42)
    async with BuiltinEngine(model, max_batch=8, max_seq_len=32) as engine:
        (alone,) = await engine.generate([1, 2, 3], params)
        crowd = [engine.generate([1, 7 + i], SamplingParams(n=2, max_tokens=12, seed=i)) for i in range(3)]
        (together,), *_ = await asyncio.gather(engine.generate([1, 2, 3], params), *crowd)
    assert alone.tokens == together.tokens


async def test_stats_count_what_reel_simulate_calibrates_on(model: MoEModel) -> None:
    async with BuiltinEngine(model, max_batch=4, max_seq_len=32) as engine:
        completions = await asyncio.gather(
            engine.generate([1, 2, 3], SamplingParams(n=2, max_tokens=5, seed=1)),
            engine.generate([4, 5], SamplingParams(n=3, max_tokens=7, seed=2)))
        stats = engine.stats()
    samples = [c for group in completions for c in group]
    generated = sum(len(c.tokens) for c in samples)
    assert stats.generated_tokens == generated
    # Every sampled token was fed once except each sample's last; every prompt token was fed once.
    assert stats.forward_tokens == generated + 2 * (3 - 1) + 3 * (2 - 1)
    assert 0 < stats.busy_s and stats.steps >= 7
    assert all(0 < c.seconds <= stats.busy_s + 1.0 for c in samples)
    # The same steps by batch size: five samples in four KV slots run at 4, then fewer as they finish.
    sizes = [b for b, *_ in stats.batches]
    assert 4 in sizes and min(sizes) < 4 and all(1 <= b <= 4 for b in sizes)
    assert sum(n for _, n, _, _ in stats.batches) == stats.steps
    assert sum(b * n for b, n, _, _ in stats.batches) == stats.generated_tokens
    assert sum(x for _, _, x, _ in stats.batches) == stats.forward_tokens - stats.generated_tokens
    assert sum(t for *_, t in stats.batches) == pytest.approx(stats.busy_s)


async def test_stop_token_ends_a_sample_and_is_kept(model: MoEModel) -> None:
    prompt = [1, 5, 9]
    reference = greedy_reference(model, prompt, 8)
    stop = reference[3]
    async with BuiltinEngine(model, max_batch=2, max_seq_len=32) as engine:
        (completion,) = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                                    stop_token_ids=(stop,)))
    first = reference.index(stop)
    assert completion.tokens == reference[:first + 1] and completion.finish_reason == "stop"
    assert completion.routing.shape[0] == len(prompt) + first


async def test_weight_update_mid_generation_keeps_every_request(model: MoEModel, tmp_path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    ref = blobs.put(state_dict_bytes(forcing_model(model)))
    prompts = [[1, 5, 9], [1, 20, 21], [2, 3, 4, 5]]
    engine = BuiltinEngine(copy.deepcopy(model), max_batch=3, max_seq_len=256, blobs=blobs)  # swapped in place
    n = 200  # long enough that the update lands mid-generation however fast the steps are
    params = SamplingParams(temperature=0.0, max_tokens=n)
    before = [asyncio.create_task(engine.generate(p, params)) for p in prompts]  # 3 run, 1 will wait
    waiting = asyncio.create_task(engine.generate([1, 8], params))
    await wait_steps(engine, 5)
    await engine.update_weights(ref, version=1)
    assert engine.version == 1
    after = await engine.generate([1, 6], SamplingParams(temperature=0.0, max_tokens=4))
    results = [r for (r,) in await asyncio.gather(*before, waiting)]
    await engine.close()

    for prompt, completion in zip(prompts, results):
        (first, v0), (switch, v1) = completion.spans
        assert (first, v0, v1) == (0, 0, 1) and 5 <= switch < n
        assert completion.tokens[:switch] == greedy_reference(model, prompt, switch)
        assert completion.tokens[switch:] == [FORCED] * (n - switch)
        assert len(completion.tokens) == n and completion.routing.shape[0] == len(prompt) + n - 1
    # The request that waited for a slot started after the swap, entirely under version 1.
    assert results[3].spans == [(0, 1)] and results[3].tokens == [FORCED] * n
    assert after[0].spans == [(0, 1)] and after[0].tokens == [FORCED] * 4


async def test_update_from_state_dict_and_a_corrupt_blob(model: MoEModel, tmp_path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    good = blobs.put(state_dict_bytes(model))
    bad = BlobRef(good.uri, "0" * 64, good.nbytes)
    engine = BuiltinEngine(copy.deepcopy(model), max_batch=2, max_seq_len=16, blobs=blobs)
    forced = forcing_model(model)
    await engine.update_weights(state_dict_adapter.to_hf(forced.state_dict(), forced.config), version=3)
    (completion,) = await engine.generate([1, 2], SamplingParams(temperature=0.0, max_tokens=3))
    assert completion.tokens == [FORCED] * 3 and completion.spans == [(0, 3)]
    with pytest.raises(BlobError):
        await engine.update_weights(bad, version=4)
    assert engine.version == 3
    await engine.update_weights(good, version=4)
    (completion,) = await engine.generate([1, 5, 9], SamplingParams(temperature=0.0, max_tokens=5))
    assert completion.tokens == greedy_reference(model, [1, 5, 9], 5)
    # Weights that do not fit the model stop the engine: it would not serve half-swapped weights.
    with pytest.raises(EngineError, match="lacks tensor"):
        await engine.update_weights({"lm_head.weight": torch.zeros(VOCAB, 64)}, version=5)
    with pytest.raises(EngineError, match="engine failed"):
        await engine.generate([1], SamplingParams())
    await engine.close()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
async def test_low_precision_engines_match_their_own_full_forward(model: MoEModel, precision: str) -> None:
    low = copy.deepcopy(model)
    low.precision = precision
    async with BuiltinEngine(low, max_batch=2, max_seq_len=32) as engine:
        (completion,) = await engine.generate([1, 5, 9], SamplingParams(temperature=0.0, max_tokens=4))
    # bf16/fp8 matmuls round differently per batch shape, so only the first token is compared exactly.
    assert completion.tokens[0] == greedy_reference(low, [1, 5, 9], 1)[0]
    assert all(math.isfinite(x) for x in completion.logprobs)


async def test_cancel_frees_the_slot_and_close_fails_the_rest(model: MoEModel) -> None:
    engine = BuiltinEngine(model, max_batch=1, max_seq_len=64)
    long = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_tokens=60)))
    await wait_steps(engine, 2)
    long.cancel()
    (short,) = await engine.generate([1, 3], SamplingParams(max_tokens=3))  # gets the freed slot
    assert len(short.tokens) == 3 and engine.stats().kv_slots_used == 0
    pending = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_tokens=60)))
    await wait_steps(engine, 1)
    await engine.close()
    with pytest.raises(EngineClosed):
        await pending
    with pytest.raises(EngineClosed):
        await engine.generate([1], SamplingParams())


async def test_requests_the_engine_cannot_serve(model: MoEModel) -> None:
    async with BuiltinEngine(model, max_batch=1, max_seq_len=8) as engine:
        with pytest.raises(EngineError, match="max_seq_len = 8"):
            await engine.generate(list(range(1, 10)), SamplingParams())
        with pytest.raises(EngineError, match="top_p"):
            await engine.generate([1], SamplingParams(top_p=0.0))
        # A sequence stops with "length" when its cache row is full, before max_tokens.
        (completion,) = await engine.generate([1, 2, 3], SamplingParams(max_tokens=50))
        assert completion.finish_reason == "length" and len(completion.tokens) == 6


def test_vllm_engine_says_how_to_install_vllm(tmp_path, monkeypatch) -> None:
    from reel.producers import vllm

    monkeypatch.setattr(vllm, "vllm", None)  # as on a machine where `import vllm` failed
    with pytest.raises(EngineError, match="pip install"):
        vllm.VLLMEngine(tmp_path)


@pytest.mark.slow  # tens of seconds: a bench run (the quick tier leaves it to CI)
def test_bench_engine_quick_prints_one_json_line(capsys: pytest.CaptureFixture) -> None:
    from reel.runtime.launch import cli

    assert cli.main(["bench", "engine", "--quick"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert result["bench"] == "engine" and result["ratio"] > 0 and result["agree"] >= 0.9
    assert result["native"] is True and result["engine_torch_ops_tokens_per_s"] > 0
