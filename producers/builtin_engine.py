"""The built-in engine: continuous batching over a preallocated KV cache, on any torch device.

One decode step = one `forward_cached` call (runtime/model/cached_forward.py) over flat tokens: the
whole prompt of every newly admitted sequence plus the last sampled token of every running one.
Sequences join between steps when a KV slot is free and leave when they finish, so short and long
completions never wait for each other and nothing is padded. Each sample has its own seeded
`torch.Generator` (producers/sampling.py), so what it draws does not depend on which other
sequences share its steps.

Threading: the asyncio task `_serve` owns all queues; the math of a step (forward, sampling,
bookkeeping of the running sequences) runs on one worker thread while the event loop keeps
talking to Redis (torch ops and the C kernels release the GIL). Weight swaps
(producers/builtin_weights.py) run on the same thread between two steps, so a step never sees
half-loaded weights.

Bursts: one hand-off to the worker thread runs one step over every pending token, then keeps
decoding (tokens stay tensors; Python bookkeeping once per burst) until a sequence finishes or the
loop has something to do between two steps: a weight update, an admissible request, a
cancellation, or close. Free KV slots are handed out lowest first and running sequences kept in
slot order, so a decode step reads one compact range of cache rows.

Shape legend: N flat tokens of a step, B running sequences in a step, V vocabulary,
L MoE layers, K experts per token.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from reel.bus.blobs import BlobBackend
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest
from reel.producers.engine import Completion, Engine, EngineClosed, EngineError, EngineStats, SamplingParams, routing_dtype
from reel.producers.builtin_weights import EngineWeights
from reel.producers.sampling import Sampler, Uniforms
from reel.runtime.model.cached_forward import forward_cached
from reel.runtime.model.kvcache import new_cache
from reel.runtime.model.model import MoEModel

__all__ = ["BuiltinEngine"]

log = logging.getLogger("reel.engine")
_RATE_WINDOW_S = 5.0  # tokens/s is measured over the steps of the last few seconds


class _Request:
    __slots__ = ("prompt", "params", "sequences", "future", "unfinished")

    def __init__(self, prompt: list[int], params: SamplingParams, future: asyncio.Future[list[Completion]]):
        self.prompt = prompt
        self.params = params
        self.future = future
        self.sequences = [_Sequence(self, i) for i in range(params.n)]
        self.unfinished = params.n


class _Sequence:
    """One sample of a request, from waiting to finished."""

    __slots__ = ("request", "seed", "uniforms", "slot", "pending", "position", "tokens", "logprobs",
                 "routing", "spans", "finish_reason", "admitted_at", "seconds")

    def __init__(self, request: _Request, index: int):
        self.request = request
        self.seed = request.params.seed + index
        self.uniforms: Uniforms | None = None  # the seeded stream, made on admission on the model's device
        self.slot = -1  # KV cache slot while running
        self.pending: list[int] = list(request.prompt)  # fed at the next step: the prompt, then the last token
        self.position = 0  # tokens already in this slot's cache
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routing: list[np.ndarray] = []  # [n, L, K] per step, one row per token fed
        self.spans: list[tuple[int, int]] = []
        self.finish_reason = ""
        self.admitted_at = 0.0  # monotonic time it got a KV slot
        self.seconds = 0.0  # admission to last token


class BuiltinEngine(Engine):
    def __init__(self, model: MoEModel, *, max_batch: int = 64, max_seq_len: int = 0,
                 blobs: BlobBackend | None = None, version: int = 0, max_prefill_tokens: int = 4096,
                 threads: int = 1):
        # Fixed at construction.
        self.model = model.eval()
        self.max_batch = max_batch  # KV cache slots = sequences decoded together
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings  # prompt + completion
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens admitted per step (bounds step latency)
        self.blobs = blobs  # where BlobRef weights are fetched from
        self.device = next(model.parameters()).device
        self._routing_dtype = routing_dtype(model.config.num_experts)
        self._cache = new_cache(model, max_batch, self.max_seq_len)
        self._weights = EngineWeights(model, blobs, self.max_seq_len)  # published versions, copied in place
        # The step thread's own torch thread count: an OpenMP team driven from a non-main thread was
        # 2x slower per decode step here at 2 threads than at 1 (tiny MoE, 2 cores); raise it for
        # models whose matmuls are big enough to split.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="reel-engine", initializer=torch.set_num_threads,
                                            initargs=(threads,))
        # Changed by the serving loop (event loop thread), or by the step thread while the loop awaits it.
        self.version = version
        self._free_slots = list(range(max_batch))  # a heap: the lowest free slot first
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._updates: list[tuple[Mapping[str, torch.Tensor] | bytes | WeightManifest, int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._cancelled = False  # a request was cancelled since the last `_drop_cancelled`
        self._failure: EngineError | None = None  # why serving stopped, when a step or weight swap failed
        # Counters for stats().
        self._started_at = 0.0
        self._steps = 0
        self._generated = 0
        self._busy_s = 0.0  # seconds in bursts
        self._by_batch: dict[int, list[float]] = {}  # sequences -> [steps, prefilled prompt tokens, seconds]
        self._forward = 0  # tokens fed through the model
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # ---- Engine interface -------------------------------------------------------------------

    async def start(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise EngineClosed("the engine was closed; make a new one")
        if self._task is None:
            self._started_at = time.monotonic()
            self._task = asyncio.create_task(self._serve(), name="reel-engine")

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        params.validate()
        prompt = [int(t) for t in prompt_ids]
        if not 1 <= len(prompt) <= self.max_seq_len:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit engine.max_seq_len = "
                              f"{self.max_seq_len}; shorten the prompt or raise engine.max_seq_len")
        await self.start()
        request = _Request(prompt, params, asyncio.get_running_loop().create_future())
        request.future.add_done_callback(self._on_request_done)
        self._waiting.extend(request.sequences)
        self._wake.set()
        # Cancelling the caller cancels the future; the loop then drops the request's sequences.
        return await request.future

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | BlobRef | WeightManifest,
                             version: int, *, ref: BlobRef | None = None) -> None:
        if isinstance(weights, (BlobRef, WeightManifest)) and self.blobs is None:
            raise EngineError("update_weights got weights in a blob store but the engine has none")
        if isinstance(weights, BlobRef):
            weights = await asyncio.to_thread(self.blobs.get, weights)  # verifies sha256, off the step path
        elif isinstance(weights, WeightManifest):  # every shard verified while the old version serves
            weights = await asyncio.to_thread(self._weights.verified, weights, self.version)
        await self.start()
        done = asyncio.get_running_loop().create_future()
        self._updates.append((weights, version, done))
        self._wake.set()
        await done

    def stats(self) -> EngineStats:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
            self._recent.popleft()
        window = min(_RATE_WINDOW_S, now - self._started_at)
        rate = sum(n for _, n in self._recent) / window if self._recent and window > 0 else 0.0
        return EngineStats(version=self.version, tokens_per_s=rate, running=len(self._running),
                           waiting=len(self._waiting), kv_slots_used=self.max_batch - len(self._free_slots),
                           kv_slots_total=self.max_batch, steps=self._steps, generated_tokens=self._generated,
                           busy_s=self._busy_s, forward_tokens=self._forward,
                           batches=tuple((b, int(n), int(x), t) for b, (n, x, t) in sorted(self._by_batch.items())))

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.shield(asyncio.to_thread(self._executor.shutdown, wait=True))
        self._fail_all(EngineClosed("the engine closed before the request finished"))

    # ---- serving loop (event loop thread) ---------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self._updates:  # an update leaves the queue once live, so a failure reaches its caller
                    weights, version, done = self._updates[0]
                    await loop.run_in_executor(self._executor, self._weights.load, weights, self.version)
                    self.version = version
                    self._updates.pop(0)
                    if not done.done():
                        done.set_result(None)
                self._drop_cancelled()
                self._admit()
                if not self._running:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                started, counted = time.monotonic(), (self._steps, self._generated, self._forward)
                finished = await loop.run_in_executor(self._executor, self._burst)
                self._count_burst(time.monotonic() - started, *counted)
                self._finish(finished)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every waiter gets the error, and so does every later call
            log.exception("engine stopped")
            self._failure = EngineError(f"engine failed: {type(exc).__name__}: {exc}")
            self._fail_all(self._failure)

    def _admit(self) -> None:
        budget = self.max_prefill_tokens
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            if len(seq.pending) > budget and budget < self.max_prefill_tokens:
                break  # this step's prefill is full; the prompt joins the next step
            self._waiting.popleft()
            budget -= len(seq.pending)
            seq.slot = heapq.heappop(self._free_slots)
            seq.uniforms = Uniforms(seq.seed, self.device)
            seq.admitted_at = time.monotonic()
            self._running.append(seq)
        self._running.sort(key=lambda s: s.slot)

    def _on_request_done(self, future: asyncio.Future[list[Completion]]) -> None:
        if future.cancelled():
            self._cancelled = True

    def _drop_cancelled(self) -> None:
        self._cancelled = False
        if any(s.request.future.done() for s in self._waiting):
            self._waiting = collections.deque(s for s in self._waiting if not s.request.future.done())
        kept = []
        for seq in self._running:
            if seq.request.future.done():
                heapq.heappush(self._free_slots, seq.slot)
            else:
                kept.append(seq)
        self._running = kept

    def _finish(self, finished: list[_Sequence]) -> None:
        now = time.monotonic()
        for seq in finished:
            seq.seconds = now - seq.admitted_at
            heapq.heappush(self._free_slots, seq.slot)
            request = seq.request
            request.unfinished -= 1
            if request.unfinished == 0 and not request.future.done():
                request.future.set_result([_completion(s) for s in request.sequences])

    def _fail_all(self, error: EngineError) -> None:
        for seq in [*self._running, *self._waiting]:
            if not seq.request.future.done():
                seq.request.future.set_exception(error)
        for _, _, done in self._updates:
            if not done.done():
                done.set_exception(error)
        self._running, self._waiting, self._updates = [], collections.deque(), []

    # ---- the step thread --------------------------------------------------------------------

    def _interrupted(self) -> bool:
        """Whether the serving loop has work between two steps (read from the step thread)."""
        return bool(self._updates or (self._waiting and self._free_slots) or self._cancelled or self._closed)

    @torch.inference_mode()
    def _burst(self) -> list[_Sequence]:
        """One step over every pending token, then decode steps until a sequence finishes or the
        loop is needed; returns the finished sequences."""
        seqs, dev = self._running, self.device
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for seq in seqs:
            n = len(seq.pending)
            ids += seq.pending
            slots += [seq.slot] * n
            positions += range(seq.position, seq.position + n)
            last.append(len(ids) - 1)
        out = forward_cached(
            self.model, torch.tensor(ids, device=dev), torch.tensor(slots, device=dev),
            torch.tensor(positions, device=dev), self._cache, return_routing=True)
        # Decode steps that cannot end a sequence by length: each adds one token and one position.
        params = [seq.request.params for seq in seqs]
        after = [(len(s.tokens) + 1, s.position + len(s.pending)) for s in seqs]
        room = min(min(p.max_tokens - n, self.max_seq_len - pos) for p, (n, pos) in zip(params, after))
        sample = Sampler(params, [s.uniforms for s in seqs], self.model.config.vocab_size, dev, draws=1 + room)
        tokens_B, logprobs_B, stopped = sample(out.logits[torch.tensor(last, device=dev)])
        self._forward += len(ids) - len(seqs)  # the prompts' extra tokens; _count_step adds one per sequence
        self._count_step(len(seqs))
        tokens, logprobs, routing = [tokens_B], [logprobs_B], []
        slot_B = torch.tensor([s.slot for s in seqs], device=dev)
        pos_B = torch.tensor([pos for _, pos in after], device=dev)
        for _ in range(room):
            if stopped or self._interrupted():
                break
            step = forward_cached(self.model, tokens_B, slot_B, pos_B, self._cache, return_routing=True)
            tokens_B, logprobs_B, stopped = sample(step.logits)
            tokens.append(tokens_B)
            logprobs.append(logprobs_B)
            routing.append(step.routing)
            pos_B = pos_B + 1
            self._count_step(len(seqs))
        sample.settle()
        return self._record(seqs, out.routing, last, tokens, logprobs, routing)

    def _count_burst(self, seconds: float, steps: int, generated: int, forward: int) -> None:
        """A burst decodes the same sequences at every step (its first also prefills the new ones' prompts):
        its seconds are those of steps at one batch size, what `reel simulate` fits a step's cost on."""
        self._busy_s += seconds
        steps = self._steps - steps
        if steps == 0:
            return
        sampled = self._generated - generated
        row = self._by_batch.setdefault(sampled // steps, [0, 0, 0.0])
        row[0] += steps
        row[1] += self._forward - forward - sampled
        row[2] += seconds

    def _count_step(self, sampled: int) -> None:
        self._steps += 1
        self._generated += sampled
        self._forward += sampled
        self._recent.append((time.monotonic(), sampled))

    def _record(self, seqs: list[_Sequence], first_routing_NLK: torch.Tensor, last: list[int],
                tokens: list[torch.Tensor], logprobs: list[torch.Tensor], routing: list[torch.Tensor]):
        """A burst's tokens, logprobs and routing into its sequences; returns those that finished."""
        first_NLK = first_routing_NLK.to("cpu").numpy().astype(self._routing_dtype)
        decode_SBLK = torch.stack(routing).to("cpu").numpy().astype(self._routing_dtype) if routing else None
        tokens_BS = list(zip(*torch.stack(tokens).tolist()))
        logprobs_BS = list(zip(*torch.stack(logprobs).tolist()))
        finished = []
        start = 0
        for b, seq in enumerate(seqs):
            end = last[b] + 1
            seq.routing.append(first_NLK[start:end])
            if decode_SBLK is not None:
                seq.routing.append(decode_SBLK[:, b])
            seq.position += end - start + len(tokens) - 1
            start = end
            if not seq.spans or seq.spans[-1][1] != self.version:
                seq.spans.append((len(seq.tokens), self.version))
            seq.tokens += tokens_BS[b]
            seq.logprobs += logprobs_BS[b]
            seq.pending = [seq.tokens[-1]]
            p = seq.request.params
            if seq.tokens[-1] in p.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= p.max_tokens or seq.position >= self.max_seq_len:  # cache row full
                seq.finish_reason = "length"
            if seq.finish_reason:
                finished.append(seq)
        self._running = [s for s in seqs if not s.finish_reason]
        return finished


def _completion(seq: _Sequence) -> Completion:
    return Completion(tokens=seq.tokens, logprobs=seq.logprobs, finish_reason=seq.finish_reason,
                      routing=np.concatenate(seq.routing), spans=seq.spans, seed=seq.seed,
                      seconds=seq.seconds)
