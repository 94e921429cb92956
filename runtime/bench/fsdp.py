"""`reel bench fsdp`: the same MoE and batches trained on 1 process and on 2 FSDP2 ranks.

Figures: per-rank measured peak memory of building the model and training STEPS steps
(runtime/bench/common/peak_memory.py: peak RSS above the process's RSS before the model existed on CPU,
torch.cuda.max_memory_allocated on CUDA; parameters, gradients, AdamW state, activations,
all-gather buffers and allocator slack all included); `ratio` = 1 process / 2 ranks of it (target
>= 1.8, reported as measured even when below; the weights' gather that compares the sides comes after
the measured steps: the trainer publishes per-rank pieces). Also the counted bytes of parameters +
gradients + AdamW state (`*_held_bytes`: what FSDP's sharding halves by construction), each peak in
parts (`*_peak_parts`: parameters, gradients, optimizer state, activations, the rest), seconds per
step of both, and max |Δ| between the weights after the last step (not zero: the ranks' gradient sums
round differently from one process; ~1e-5 expected). A one-process trainer runs on CPU, so on a
CUDA machine the 2-rank side (NCCL) is measured on the GPU and no ratio is printed (`memory` says
why); `--quick` hides CUDA from both sides. Each side runs in a fresh process, `python -m
reel.runtime.bench.fsdp OUT [quick]`, the 2-rank one under torchrun (gloo on CPU, NCCL on CUDA),
so neither inherits the other's heap; rank 0 writes its figures and weights to OUT. Inputs are
random tokens with made-up rewards and logprobs: the step's cost and memory do not depend on what
the tokens say.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
from safetensors.torch import load

from reel.bus.events import Sample, Tensor, Trajectory
from reel.bus.jsonout import print_json
from reel.runtime.train import distributed, torchrun
from reel.runtime.train.batch import Batch, Group, build_batch
from reel.runtime.config.sections import Config
from reel.runtime.config.run import from_dict
from reel.runtime.train.distributed import World
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.parallelize import apply_fsdp
from reel.runtime.bench.common.peak_memory import (MALLOC_ENV, Held, PeakMemory, SavedForBackward, held_bytes,
                                                   release_free_memory)
from reel.runtime.train.step import TrainState, full_weights, make_optimizer, train_step

# 12 layers, as deep models are what FSDP is for: one gathered layer (what a rank holds beyond its
# shards while that layer runs) is 1/6 of a rank's share of the parameters; with 4 layers it was 1/2.
MODEL = MoEConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
QUICK = MoEConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
STEPS = 3


def _config(groups: int) -> Config:
    return from_dict({"trainer": {"batch_groups": groups}, "rollout": {"concurrency": groups}})


def _batches(model: MoEConfig, groups: int, steps: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    L, K = len(model.moe_layers), model.num_experts_per_tok
    out = []
    for step in range(steps):
        made = []
        for g in range(groups):
            prompt = torch.randint(3, model.vocab_size, (16,), generator=gen)
            samples, routing = [], []
            for s in range(8):
                completion = torch.randint(3, model.vocab_size, (16,), generator=gen)
                logp = -torch.rand(16, generator=gen) * 5
                samples.append(Sample(tokens=Tensor.from_torch(completion.int()), logprobs=Tensor.from_torch(logp),
                                      reward=float(torch.rand((), generator=gen)), finish_reason="stop", seed=s,
                                      spans=[(0, 0)]))
                ids = torch.stack([torch.randperm(model.num_experts, generator=gen)[:K] for _ in range(31 * L)])
                routing.append(ids.view(31, L, K).numpy().astype(np.uint8))
            made.append(Group(Trajectory(run="bench", producer="bench:0", seq=g, group_id=f"{step}-{g}", env="bench",
                                         prompt=Tensor.from_torch(prompt.int()), samples=samples, worker="0"),
                              routing))
        out.append(build_batch(made))
    return out


class Figures(msgspec.Struct):
    """One side's figures, as rank 0 writes them (the per-rank maxima)."""

    peak_bytes: int  # measured peak memory of one rank (PeakMemory)
    memory: str  # what measured it: "cpu" (resident set) or "cuda" (allocator)
    held: Held  # counted parameters, gradients and optimizer state of one rank
    activation_bytes: int  # the most bytes saved for backward at once (SavedForBackward)
    grads_with_activations: int  # gradient bytes alive at that moment
    step_s: float
    backend: str

    def parts(self) -> dict[str, int]:
        """The peak in parts as they stood when activations peaked (the end of a forward, gradients
        not yet made); `rest`: what else the peak held (transients, gathered layer, buffers, slack)."""
        counted = dict(params=self.held.params, grads=self.grads_with_activations, optimizer=self.held.optimizer,
                       activations=self.activation_bytes)
        return counted | {"rest": self.peak_bytes - sum(counted.values())}


def measure(world: World, model_cfg: MoEConfig, groups: int) -> tuple[Figures, bytes]:
    """This rank's figures and the final weights (on rank 0)."""
    config = _config(groups)
    batches = _batches(model_cfg, groups, STEPS)  # inputs exist before the baseline: not counted
    _warm_up(world, model_cfg, config, batches[0])
    torch.manual_seed(0)
    mark = PeakMemory.start(world.device)
    model = apply_fsdp(MoEModel(model_cfg), world)
    state = TrainState(model, make_optimizer(model, config.trainer), 0)
    held, seconds = Held(), []
    with SavedForBackward(model.parameters) as saved:
        for batch in batches:
            started = time.perf_counter()
            state, _ = train_step(state, batch, config, world)
            seconds.append(time.perf_counter() - started)
            now = held_bytes(state.model.parameters(), state.optimizer)
            held = now if now.total > held.total else held
    peak = mark.peak_bytes()
    weights = full_weights(state.model, world)  # to compare the sides (not training: the trainer publishes pieces)
    backend = torch.distributed.get_backend() if world.distributed else "none"
    # The first step pays for lazy init.
    return Figures(peak, mark.device, held, saved.peak, saved.grads_at_peak, min(seconds[1:] or seconds),
                   backend), weights


def _warm_up(world: World, model_cfg: MoEConfig, config: Config, batch: Batch) -> None:
    """One step on a throwaway model, then its memory handed back: the code pages and one-off
    buffers a first step faults in are resident before the baseline, not counted as the step's."""
    model = apply_fsdp(MoEModel(model_cfg), world)
    train_step(TrainState(model, make_optimizer(model, config.trainer), 0), batch, config, world)
    del model
    gc.collect()
    release_free_memory()


def run(args: argparse.Namespace) -> int:
    model_cfg, groups = (QUICK, 2) if args.quick else (MODEL, 4)
    threads = 1
    with tempfile.TemporaryDirectory(prefix="reel-bench-fsdp-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **MALLOC_ENV)
        env.pop("WORLD_SIZE", None)
        if args.quick:  # the smoke run compares like with like anywhere: both sides on CPU
            env["CUDA_VISIBLE_DEVICES"] = ""
        sides = {1: [sys.executable, "-m", "reel.runtime.bench.fsdp"],
                 2: [sys.executable, *torchrun.torchrun_argv(2, "reel.runtime.bench.fsdp")]}
        for size, argv in sides.items():
            done = subprocess.run([*argv, tmp, *["quick"] * args.quick], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
        one, two = (msgspec.json.decode((Path(tmp) / f"figures-{n}.json").read_bytes(), type=Figures) for n in (1, 2))
        one_weights, two_weights = (load((Path(tmp) / f"weights-{n}.safetensors").read_bytes()) for n in (1, 2))
    diff = max(float((one_weights[k] - two_weights[k]).abs().max()) for k in one_weights)
    comparable = one.memory == two.memory
    print_json({
        "bench": "fsdp", "params": sum(p.numel() for p in MoEModel(model_cfg).parameters()),
        "tokens_per_step": groups * 8 * 16, "steps": STEPS, "backend": two.backend,
        "memory": one.memory if comparable else f"{one.memory} (1 process) vs {two.memory} (2 ranks): no ratio",
        "one_rank_peak_bytes": one.peak_bytes, "two_rank_peak_bytes_per_rank": two.peak_bytes,
        "one_rank_held_bytes": one.held.total, "two_rank_held_bytes_per_rank": two.held.total,
        "held_ratio": round(one.held.total / two.held.total, 3),
        # the peaks in parts, as they stood when activations peaked: counted state, measured activations, the rest
        "one_rank_peak_parts": one.parts(), "two_rank_peak_parts_per_rank": two.parts(),
        "one_rank_step_s": round(one.step_s, 4), "two_rank_step_s": round(two.step_s, 4),
        "max_abs_weight_diff": diff,
        "ratio": round(one.peak_bytes / two.peak_bytes, 3) if comparable else None,
    })
    return 0


def _rank_main(out: str, quick: str = "") -> None:
    """One side: a single process, or one rank of the 2-rank side (under torchrun)."""
    world = distributed.from_env()
    model_cfg, groups = (QUICK, 2) if quick else (MODEL, 4)
    torch.set_num_threads(1)
    figures, weights = measure(world, model_cfg, groups)
    peak, params, grads, optimizer, activations, alive = (_max_over_ranks(world, x) for x in (
        figures.peak_bytes, figures.held.params, figures.held.grads, figures.held.optimizer, figures.activation_bytes,
        figures.grads_with_activations))
    if world.rank == 0:
        figures = msgspec.structs.replace(figures, peak_bytes=peak, held=Held(params, grads, optimizer),
                                          activation_bytes=activations, grads_with_activations=alive)
        (Path(out) / f"figures-{world.size}.json").write_bytes(msgspec.json.encode(figures))
        (Path(out) / f"weights-{world.size}.safetensors").write_bytes(weights)
    distributed.shutdown(world)


def _max_over_ranks(world: World, value: int) -> int:
    return int(max(distributed.all_sum(world, float(value) if r == world.rank else 0.0) for r in range(world.size)))


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
