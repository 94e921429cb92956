"""The inference engine interface rollout workers talk to, and the types that cross it.

Two engines implement it: `reel.producers.builtin_engine.BuiltinEngine` (any torch device, the CPU
path) and `reel.producers.vllm.VLLMEngine` (vLLM's AsyncLLM, production GPUs). The interface follows
what vLLM can deliver, so the two are interchangeable:

- a request is token ids in, token ids out (no text); `n` samples of one prompt, sample i drawn
  with its own generator seeded with `seed + i`, so a sample does not depend on its batch;
- `Completion.logprobs[i]` is log mu(token_i): the log-probability of the sampled token under the
  distribution it was actually drawn from, i.e. softmax(logits / temperature) restricted to the
  top-p nucleus and renormalised over it (vLLM's `logprobs_mode="processed_logprobs"`). Greedy
  (temperature 0) reports log softmax(logits), as vLLM does (it treats greedy as temperature 1);
- `Completion.routing` is the expert ids of every token that went through a forward pass:
  [P + C - 1, moe_layers, top_k] (prompt and completion; the last sampled token is never fed
  back, matching vLLM's `routed_experts`), uint8 when expert ids fit, else uint16;
- `Completion.spans` is [(first completion token index, policy version)], ascending, first index 0:
  token i was sampled from logits computed under the version of the last span starting at or
  before i. Weight updates happen between decode steps; running sequences keep their KV cache
  (computed under older weights) and continue under the new version (DESIGN.md "Policy versions").

Errors: `EngineError(ReelError)` for a request the engine cannot serve (prompt too long, bad
sampling parameters); `EngineClosed(EngineError)` is raised by `generate` when the engine shuts down
before the request finished. Cancelling a `generate` call aborts its request and frees its slots.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from reel.bus.errors import ReelError
from reel.bus.events import BlobRef

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "Completion", "EngineStats", "Engine", "EngineError", "EngineClosed",
           "routing_dtype"]

class EngineError(ReelError):
    """A request the engine cannot serve; the message names the parameter."""


class EngineClosed(EngineError):
    """The engine shut down before the request finished."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    n: int = 1  # samples of the prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    max_tokens: int = 16  # completion tokens at most (fewer when a stop token is sampled)
    stop_token_ids: tuple[int, ...] = ()  # sampling one of these ends the sample (the token is kept)
    seed: int = 0  # sample i draws from a generator seeded with seed + i

    def validate(self) -> None:
        if self.n < 1:
            raise EngineError(f"sampling n = {self.n} must be at least 1")
        if self.temperature < 0:
            raise EngineError(f"sampling temperature = {self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"sampling top_p = {self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise EngineError(f"sampling max_tokens = {self.max_tokens} must be at least 1")


@dataclass
class Completion:
    """One sample of a request."""

    tokens: list[int]  # completion token ids [C]
    logprobs: list[float]  # log mu(token) per completion token [C] (see the module docstring)
    finish_reason: str  # "stop": a stop token was sampled (it is kept) | "length": max_tokens or cache full
    routing: np.ndarray  # expert ids [P + C - 1, moe_layers, top_k], uint8 | uint16
    spans: list[tuple[int, int]] = field(default_factory=list)  # [(first token index, version)]
    seed: int = 0  # the seed of this sample's generator
    seconds: float = 0.0  # from admission (a KV slot) to the last token; 0 when the engine does not measure it


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    version: int  # policy version new tokens are sampled under
    tokens_per_s: float  # generated tokens per second over the last few seconds
    running: int  # sequences being decoded
    waiting: int  # sequences waiting for a KV slot
    kv_slots_used: int
    kv_slots_total: int
    steps: int  # decode steps run since start
    generated_tokens: int  # completion tokens sampled since start
    busy_s: float = 0.0  # seconds spent running decode steps since start (0 when not measured)
    forward_tokens: int = 0  # tokens fed through the model since start: prompts and sampled tokens
    version_spans_assumed: int = 0  # samples whose policy-version spans were assumed (vLLM sent none)
    # Decode steps by batch size since start: (sequences, steps, prompt tokens prefilled, seconds) for each
    # batch size the engine ran; empty when it does not time its steps by batch (vLLM).
    batches: tuple[tuple[int, int, int, float], ...] = ()


def routing_dtype(num_experts: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest dtype that holds expert ids (what travels in RoutingTrace)."""
    return np.uint8 if num_experts <= 256 else np.uint16


class Engine(abc.ABC):
    """An async engine: `generate` may be awaited from many tasks at once; the engine batches them."""

    version: int  # the policy version new tokens are sampled under

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving (idempotent)."""

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of the prompt, in sample order, once all of them have finished."""

    @abc.abstractmethod
    async def update_weights(self, weights: Mapping[str, torch.Tensor] | BlobRef, version: int, *,
                             ref: BlobRef | None = None) -> None:
        """Swap in new weights (HF tensor names) between two decode steps; returns once they are live.

        A BlobRef is a safetensors blob in the engine's blob store; its sha256 is verified before use.
        A WeightManifest (bus/weight_manifest.py) is verified shard by shard before anything is copied:
        a bad shard raises WeightLoadError and the old version keeps serving. `ref` is where that
        manifest is stored (WeightsPublished.weights): an engine whose workers read versions from the
        store by hash (vLLM) names it to them, and refuses a manifest without it.
        Running requests continue under `version` from their next token; none is dropped or restarted.
        """

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's load and throughput."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving; unfinished `generate` calls raise EngineClosed."""

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
