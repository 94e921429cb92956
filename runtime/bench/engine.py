"""`reel bench engine`: built-in engine tokens/s ÷ transformers `generate` tokens/s, same run.

Both sides decode the same tiny MoE weights (Reel's `save` -> Qwen3MoeForCausalLM.from_pretrained)
over the same prompts of mixed lengths, greedy, every sequence exactly `max_tokens` long (no stop
token). transformers gets its best static setup: one left-padded batch with its KV cache. The
engine gets the same prompts as concurrent requests (continuous batching, no padding; in fp32 on
the CPU its steps run the C forward, runtime/model/native.py). `agree` is the share of sequences
whose greedy tokens are identical on both sides (a sanity check: both run fp32, so only near-ties
may differ). The two sides run alternately (rounds) and each keeps its best, so a burst of noise
on a shared machine does not decide the ratio.

Beside them, a figure without a target: `vllm_tokens_per_s`, the same prompts sent to a real
`vllm serve` of the same weights through Reel's HTTP engine (where vLLM is installed; its CPU
build on a machine without a GPU, which is not what vLLM is built for). The model has head_dim 32
because vLLM's CPU attention has no kernel for 16.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from reel.bus.jsonout import print_json
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import SamplingParams
from reel.runtime.model import native
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import save

SEED = 0
VOCAB = 49  # the character tokenizer's vocabulary


def run(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    prompts_n, max_tokens, max_prompt = (16, 16, 24) if quick else (64, 64, 48)
    torch.manual_seed(SEED)
    model = MoEModel(MoEConfig(vocab_size=VOCAB, head_dim=32, initializer_range=0.1)).eval()
    rng = random.Random(SEED)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, max_prompt))] for _ in range(prompts_n)]

    rounds = 1 if quick else 3
    engine_s, torch_ops_s, hf_s = [], [], []
    for _ in range(rounds):
        seconds, engine_out = _time_engine(model, prompts, max_tokens)
        engine_s.append(seconds)
        with _torch_ops():
            torch_ops_s.append(_time_engine(model, prompts, max_tokens)[0])
        seconds, hf_out = _time_transformers(model, prompts, max_tokens)
        hf_s.append(seconds)
    tokens = prompts_n * max_tokens
    engine_tps, hf_tps = tokens / min(engine_s), tokens / min(hf_s)
    vllm_s = _time_vllm(model, prompts, max_tokens, rounds)
    print_json({
        "bench": "engine", "quick": quick, "prompts": prompts_n, "max_tokens": max_tokens, "rounds": rounds,
        "threads": torch.get_num_threads(), "native": native.usable(model, torch.zeros(1)),
        "engine_tokens_per_s": round(engine_tps, 1),
        # the same engine with the torch-ops forward (REEL_NATIVE=0): what the C forward adds
        "engine_torch_ops_tokens_per_s": round(tokens / min(torch_ops_s), 1),
        "transformers_tokens_per_s": round(hf_tps, 1),
        "vllm_tokens_per_s": None if vllm_s is None else round(tokens / vllm_s, 1),
        "agree": sum(a == b for a, b in zip(engine_out, hf_out)) / prompts_n,
        "ratio": round(engine_tps / hf_tps, 3),
    })
    return 0


@contextlib.contextmanager
def _torch_ops() -> Iterator[None]:
    previous = os.environ.get("REEL_NATIVE")
    os.environ["REEL_NATIVE"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["REEL_NATIVE"]
        else:
            os.environ["REEL_NATIVE"] = previous


def _time_engine(model: MoEModel, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def run() -> tuple[float, list[list[int]]]:
        max_len = max(map(len, prompts)) + max_tokens
        async with BuiltinEngine(model, max_batch=len(prompts), max_seq_len=max_len) as engine:
            await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            start = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return time.perf_counter() - start, [c.tokens for (c,) in results]

    return asyncio.run(run())


def _time_transformers(model: MoEModel, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the JSON line is the bench's only output
    with tempfile.TemporaryDirectory() as tmp:
        save(model, tmp)
        hf = Qwen3MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        hf.generate(input_ids=input_ids[:1], attention_mask=mask[:1], max_new_tokens=4, **kwargs)  # warm-up
        start = time.perf_counter()
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, **kwargs)
        seconds = time.perf_counter() - start
    return seconds, out[:, width:].tolist()


def _time_vllm(model: MoEModel, prompts: list[list[int]], max_tokens: int, rounds: int) -> float | None:
    """Best seconds of a real `vllm serve` on the same weights and prompts (None without vLLM)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from reel.producers.vllm_http import VLLMHTTPEngine
    from reel.runtime.config import run as config_mod
    from reel.runtime.launch.vllm_serve import local_vllm

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    serve = config_mod.loads(f'[engine]\nkind = "vllm"\nmax_batch = {len(prompts)}\n'
                             f'[trainer]\nrouter_replay = false\n')

    async def run(url: str, model_dir: Path) -> float:
        best = float("inf")
        async with VLLMHTTPEngine(model_dir, url=url, routed_experts=False, version=0) as engine:
            await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            for _ in range(rounds):
                start = time.perf_counter()
                await asyncio.gather(*(engine.generate(p, params) for p in prompts))
                best = min(best, time.perf_counter() - start)
        return best

    with tempfile.TemporaryDirectory() as tmp:
        save(model, tmp)
        with local_vllm(serve, Path(tmp), Path(tmp) / "vllm.log", Path(tmp) / "blobs") as url:
            return asyncio.run(run(url, Path(tmp)))
