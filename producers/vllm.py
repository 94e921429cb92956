"""The engine interface on vLLM (production GPUs; see the shared notes on the vLLM API).

Two engines, one mapping of Reel's contract onto vLLM (the helpers here are shared by both):
    VLLMEngine        (this module) vLLM's AsyncLLM in this process
    VLLMHTTPEngine    (producers/vllm_http.py) `vllm serve` pools over HTTP (the Slurm job)

How Reel's contract maps onto vLLM:
- token ids in and out: `detokenize=False`; only `stop_token_ids` end a sample (`ignore_eos`),
  and vLLM keeps the stop token, as Reel does;
- sample i of a request is its own vLLM request with `seed + i` (vLLM's n > 1 fans out with
  seeds we could not name), sharing the prompt's KV blocks through prefix caching;
- logprobs: `logprobs_mode="processed_logprobs"`, `logprobs=0` gives the sampled token's logprob
  after temperature and top-p, i.e. log mu;
- routing: `enable_return_routed_experts` gives [P + C - 1, layers, K] logical expert ids, one row
  per hidden layer (dense ones included); Reel keeps the MoE layers. The capture needs vLLM's
  Model Runner V2 (GPU): router replay on an engine without it is refused when the engine starts;
- versions: vLLM labels weights with strings (`"default"` until told otherwise); Reel tells it
  `str(version)` after every load and reads any label that is not an integer as "no Reel version".
  The prefix cache is salted with the version a request starts under (`cache_salt`),
  so no request reuses KV blocks computed by other weights. A weight update pauses the scheduler
  with mode="keep" and clear_cache=False (running requests keep their KV and resume under the new
  weights), loads the version in every worker through `ReelWorkerExtension` (producers/vllm_worker.py:
  a manifest's shards streamed, or one safetensors blob), and resumes. A manifest version is
  verified here first, while the old version serves: a corrupted, missing or outside shard, or one
  whose tensors are not the model's, is a WeightLoadError (the rollout worker dead-letters it) and
  the workers are never asked. A delta version is checked by its full shards (what a worker that
  does not hold its base, or whose delta fails, loads); a worker that holds the base applies the delta
  itself (producers/vllm_worker.py). The workers read the manifest by the hash it is stored under
  (`update_weights(..., ref=)`, WeightsPublished.weights) and say what they loaded (logged).
  Spans come from vLLM's `weight_versions` where this vLLM has them; otherwise a sample gets the
  version it started under for all its tokens (its staleness is then over-estimated, never under).

Import-guarded: this module imports without vLLM; constructing a VLLMEngine without it raises
EngineError saying what to install.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest
from reel.producers.engine import Completion, Engine, EngineClosed, EngineError, EngineStats, SamplingParams, routing_dtype
from reel.producers.vllm_worker import LOAD_MANIFEST, LOAD_WEIGHTS
from reel.runtime.launch.vllm_args import (
    BLOBS_ENV, DTYPE, WORKER_EXTENSION, cpu_env, quantization, router_replay_unsupported,
)
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.state_dict_adapter import to_hf
from reel.runtime.weights.delta import full_of
from reel.runtime.weights.load import verify_version

log = logging.getLogger("reel.vllm")

try:
    import vllm
except ImportError:  # the CPU path never needs it
    vllm = None

__all__ = ["VLLMEngine", "VLLMEngineBase", "cache_salt", "policy_version", "sampling_options", "hub_shapes"]

_RATE_WINDOW_S = 5.0


def cache_salt(version: int) -> str:
    """The prefix-cache salt of a request started under `version`: KV blocks never cross versions."""
    return f"v{version}"


def policy_version(label: str | int | None) -> int | None:
    """Reel's policy version behind a vLLM weight-version label; None for any other label ("default")."""
    if isinstance(label, int):
        return label
    try:
        return int(label) if label is not None else None
    except ValueError:
        return None


def hub_shapes(config: MoEConfig) -> dict[str, torch.Size]:
    """Every Hub tensor the served model has, with its shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = MoEModel(config)
    return {name: t.shape for name, t in to_hf(model.state_dict(), config).items()}


def sampling_options(params: SamplingParams, first: int, n: int = 1) -> dict[str, Any]:
    """vLLM SamplingParams fields (JSON types) of samples first .. first + n - 1 as one request.

    vLLM seeds child i of a request with seed + i, so seed + first gives every sample the seed
    it would have alone (Reel's sample i: seed + i)."""
    return {"n": n, "temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
            "seed": params.seed + first, "logprobs": 0, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True, "detokenize": False}


class VLLMEngineBase(Engine):
    """What both vLLM engines share: the model's routing shape, weight hand-off, sample checks, stats."""

    # Fixed at construction.
    model_dir: Path
    max_batch: int
    blobs: BlobStore | None  # weights reach vLLM's workers as files of this store
    routed_experts: bool  # vLLM returns routing; when False a completion's routing is empty [0, L, K]
    # Changed while serving.
    version: int

    def __init__(self, model_dir: str | Path, *, max_batch: int, blobs: BlobStore | None, version: int,
                 routed_experts: bool = True):
        self.model_dir = Path(model_dir)
        self.max_batch = max_batch
        self.blobs = blobs
        self.routed_experts = routed_experts
        model = MoEConfig.from_hf_dict(json.loads((self.model_dir / "config.json").read_text()))
        self._routing_dtype = routing_dtype(model.num_experts)
        self._routing_shape = (len(model.moe_layers), model.num_experts_per_tok)
        self._moe_layers = list(model.moe_layers)
        self._hidden_layers = model.num_hidden_layers
        self._shapes = hub_shapes(model)  # what a manifest version must hold, checked before the workers load it
        self.version = version
        self._running = 0
        self._generated = 0
        self._spans_assumed = 0  # samples vLLM returned without weight_versions (spans assumed)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    async def _load_call(self, weights: Mapping[str, torch.Tensor] | BlobRef | WeightManifest,
                         ref: BlobRef | None) -> tuple[str, list[str]]:
        """(worker method, its args) that load `weights`: a manifest by the hash it is stored under
        (`ref`), verified here first (WeightLoadError: the workers are never asked), else one
        safetensors blob."""
        if self.blobs is None:
            raise EngineError("the vLLM engine needs a blob store to hand weights to its workers")
        blobs = self.blobs
        if isinstance(weights, WeightManifest):
            if ref is None:  # refused before the shards are read
                raise EngineError(f"version {weights.version}: vLLM's workers read a manifest from the run's store "
                                  "by hash; pass update_weights(..., ref=) the manifest's BlobRef "
                                  "(WeightsPublished.weights)")
            await self._verify(weights)
            return LOAD_MANIFEST, [ref.sha256]
        if not isinstance(weights, BlobRef):
            from safetensors.torch import save

            tensors = dict(weights)
            weights = await asyncio.to_thread(lambda: blobs.put(save(tensors)))
        path = blobs.path(weights)
        if not path.is_file():
            raise EngineError(f"weights blob {weights.sha256} is not at {path}, where vLLM's workers read it")
        return LOAD_WEIGHTS, [str(path), weights.sha256]

    def _loaded(self, version: int, reports: list[Any] | None) -> None:
        """Logs what each worker says it loaded (reel_load_manifest's dicts; a blob load says nothing)."""
        for worker, report in enumerate(reports or ()):
            if isinstance(report, dict):
                why = f" (not as a delta: {report['why_full']})" if report.get("why_full") else ""
                log.info("version %d on worker %d: %s load, %d tensors, %.1f MB of shards read, seconds %s%s",
                         version, worker, report.get("how"), report.get("tensors", 0),
                         report.get("read_bytes", 0) / 1e6, report.get("seconds", {}), why)

    async def _verify(self, manifest: WeightManifest) -> None:
        """WeightLoadError unless every shard the workers would load is whole and the model's (a delta:
        its full shards, which is what vLLM loads)."""
        if self.blobs is None:
            raise EngineError("the vLLM engine needs a blob store to hand weights to its workers")
        full = full_of(manifest) if manifest.base_version >= 0 else manifest
        await asyncio.to_thread(verify_version, self.blobs, full, self._shapes)

    def _completion(self, prompt_len: int, tokens: list[int], logprobs: list[float], finish_reason: str | None,
                    routing: np.ndarray | None, spans: list[tuple[int, int | None]], version: int,
                    seed: int) -> Completion:
        """One vLLM sample checked against the engine contract; `version` is the one it started under.

        `spans` are (first token, policy version) from vLLM's weight_versions; a span whose label is
        no Reel version (None) takes the version before it, the first one the version the sample
        started under.
        """
        if finish_reason not in ("stop", "length"):
            raise EngineError(f"vLLM ended a request with finish_reason {finish_reason!r}")
        if len(logprobs) != len(tokens):
            raise EngineError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        self._generated += len(tokens)
        self._recent.append((time.monotonic(), len(tokens)))
        if not spans:
            self._assume_spans(version)
        return Completion(tokens=tokens, logprobs=logprobs, finish_reason=finish_reason,
                          routing=self._routing(routing, prompt_len + len(tokens) - 1),
                          spans=known_spans(spans, version), seed=seed)

    def _assume_spans(self, version: int) -> None:
        """No weight_versions: the sample is labelled with the version it started under, which a
        weight swap during its generation makes wrong; say so (once) and count it for metrics."""
        if not self._spans_assumed:
            log.warning("vLLM returned no weight_versions; a sample's policy version is assumed to be the one "
                        "it started under (%d), wrong if weights changed while it ran; counted in "
                        "WorkerStats.version_spans_assumed (this vLLM lacks weight_versions spans)", version)
        self._spans_assumed += 1

    def _routing(self, routing: np.ndarray | None, rows: int) -> np.ndarray:
        expected = (rows, *self._routing_shape)
        if routing is None:
            if self.routed_experts:
                raise EngineError("vLLM returned no routed experts; it must run with --enable-return-routed-experts")
            return np.zeros((0, *self._routing_shape), self._routing_dtype)
        if routing.ndim == 3 and routing.shape[1] == self._hidden_layers != len(self._moe_layers):
            routing = routing[:, self._moe_layers, :]  # vLLM has a row per hidden layer, dense ones included
        if routing.shape != expected:
            raise EngineError(f"vLLM returned routed experts of shape {routing.shape}; expected {expected} "
                              f"(prompt + completion - 1 tokens, MoE layers, top-k)")
        return routing.astype(self._routing_dtype)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        params.validate()
        await self.start()
        prompt = [int(t) for t in prompt_ids]
        version = self.version
        # Samples (seed + i) in runs of at most max_batch, all tagged with the version they started
        # under: vLLM refuses a request with n above its max_num_seqs.
        runs = [(first, min(self.max_batch, params.n - first)) for first in range(0, params.n, self.max_batch)]
        parts = await asyncio.gather(*(self._samples(prompt, params, first, n, version) for first, n in runs))
        return [completion for part in parts for completion in part]

    @abc.abstractmethod
    async def _samples(self, prompt: list[int], params: SamplingParams, first: int, n: int,
                       version: int) -> list[Completion]:
        """Samples first .. first + n - 1 of a request (sample i seeded seed + i), tagged with `version`."""

    def _check_routed_experts(self) -> None:
        """Refuse to start when router replay needs a capture this machine's vLLM lacks."""
        reason = router_replay_unsupported() if self.routed_experts else None
        if reason:
            raise EngineError(reason)

    def stats(self) -> EngineStats:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
            self._recent.popleft()
        rate = sum(n for _, n in self._recent) / _RATE_WINDOW_S
        return EngineStats(version=self.version, tokens_per_s=rate, running=self._running, waiting=0,
                           kv_slots_used=min(self._running, self.max_batch), kv_slots_total=self.max_batch,
                           steps=0, generated_tokens=self._generated, version_spans_assumed=self._spans_assumed)


class VLLMEngine(VLLMEngineBase):
    def __init__(self, model_dir: str | Path, *, max_batch: int = 64, max_seq_len: int = 0, precision: str = "bf16",
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, expert_parallel: bool = False,
                 blobs: BlobStore | None = None, version: int = 0, routed_experts: bool = True):
        if vllm is None:
            raise EngineError("engine.kind = 'vllm' needs vLLM on a CUDA machine; pip install 'reel-rl[vllm]' "
                              "or set engine.kind = 'builtin'")
        super().__init__(model_dir, max_batch=max_batch, blobs=blobs, version=version, routed_experts=routed_experts)
        # Fixed at construction.
        self.max_seq_len = max_seq_len
        self.precision = precision
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.expert_parallel = expert_parallel
        # Changed while serving.
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._closed = False
        self._ids = itertools.count()

    async def start(self) -> None:
        if self._closed:
            raise EngineClosed("the vLLM engine was closed; make a new one")
        if self._llm is not None:
            return
        self._check_routed_experts()
        for key, value in cpu_env().items():
            os.environ.setdefault(key, value)
        if isinstance(self.blobs, BlobStore):  # the in-process workers load from this store only
            os.environ.setdefault(BLOBS_ENV, str(self.blobs.root))
        if self.routed_experts:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # where the routed-expert capture lives
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.model_dir), skip_tokenizer_init=True, dtype=DTYPE[self.precision],
            quantization=quantization(self.precision, self.model_dir),
            max_num_seqs=self.max_batch, max_model_len=self.max_seq_len or None, enable_prefix_caching=True,
            enable_return_routed_experts=self.routed_experts, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
            enable_expert_parallel=self.expert_parallel, enforce_eager=bool(cpu_env()))
        try:
            self._llm = AsyncLLM.from_engine_args(args)
            # A fresh engine labels its weights "default"; spans must name Reel versions.
            await self._llm.update_weight_version(str(self.version))
        except Exception as exc:
            raise EngineError(f"vLLM could not start on {self.model_dir}: {type(exc).__name__}: {exc}") from exc

    async def _samples(self, prompt: list[int], params: SamplingParams, first: int, n: int,
                       version: int) -> list[Completion]:
        return list(await asyncio.gather(*(self._sample(prompt, params, i, version) for i in range(first, first + n))))

    async def _sample(self, prompt: list[int], params: SamplingParams, index: int, version: int) -> Completion:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        options = sampling_options(params, index) | {"output_kind": RequestOutputKind.FINAL_ONLY}
        if "routed_experts_prompt_start" in getattr(VSamplingParams, "__struct_fields__", ()):
            options["routed_experts_prompt_start"] = 0  # newest vLLM: include the prompt's routing
        request = TokensPrompt(prompt_token_ids=prompt, cache_salt=cache_salt(version))
        final = None
        self._running += 1
        try:
            async for output in self._llm.generate(request, VSamplingParams(**options), f"reel-{next(self._ids)}"):
                final = output
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._closed:
                raise EngineClosed("the vLLM engine closed before the request finished") from exc
            raise EngineError(f"vLLM request failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._running -= 1
        if final is None:
            raise EngineError("vLLM ended a request without any output")
        out = final.outputs[0]
        tokens = list(out.token_ids)
        spans = [(int(s.start), policy_version(s.version)) for s in getattr(out, "weight_versions", None) or ()]
        routing = None if out.routed_experts is None else np.asarray(out.routed_experts)
        return self._completion(len(prompt), tokens, [float(step[t].logprob) for step, t in zip(out.logprobs or (), tokens)],
                                out.finish_reason, routing, spans, version, options["seed"])

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | BlobRef | WeightManifest,
                             version: int, *, ref: BlobRef | None = None) -> None:
        method, args = await self._load_call(weights, ref)
        await self.start()
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            self._loaded(version, await self._llm.collective_rpc(method, args=tuple(args)))
            await self._llm.update_weight_version(str(version))
            self.version = version
        finally:
            await self._llm.resume_generation()

    async def close(self) -> None:
        self._closed = True
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)


def known_spans(spans: list[tuple[int, int | None]], started: int) -> list[tuple[int, int]]:
    known: list[tuple[int, int]] = []
    for start, version in spans:
        version = (known[-1][1] if known else started) if version is None else version
        if not known or known[-1][1] != version:
            known.append((start, version))
    return known or [(0, started)]
