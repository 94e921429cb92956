"""`reel bench fsdp`: the same MoE and batches trained on 1 process and on 2 FSDP2 ranks.

Figures: per-rank peak bytes of parameters + gradients + AdamW state (measured after each step,
when all three are held; `ratio` = 1 process / 2 ranks, target >= 1.8), seconds per step of both,
and max |Δ| between the weights after the last step (not zero: the ranks' gradient sums round
differently from one process; ~1e-5 expected). The 2-rank side runs as `python -m
reel.runtime.bench_fsdp OUT` under torchrun (gloo on CPU, NCCL on CUDA); rank 0 writes its figures and
weights to OUT. Inputs are random tokens with made-up rewards and logprobs: the step's cost and
memory do not depend on what the tokens say.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load

from reel.bus.events import Sample, Tensor, Trajectory
from reel.bus.jsonout import print_json
from reel.runtime import distributed
from reel.runtime.batch import Batch, Group, build_batch
from reel.runtime.config import Config, from_dict
from reel.runtime.distributed import World
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.parallelize import apply_fsdp
from reel.runtime.train_step import TrainState, full_weights, make_optimizer, train_step

MODEL = MoEConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
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


def _held_bytes(state: TrainState) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (local shards of DTensors)."""
    def local(t: torch.Tensor) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    total = 0
    for p in state.model.parameters():
        total += local(p) + (local(p.grad) if p.grad is not None else 0)
        total += sum(local(v) for v in state.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return total


def measure(world: World, model_cfg: MoEConfig, groups: int) -> tuple[int, float, bytes]:
    """(peak held bytes on this rank, seconds per step, the final weights on rank 0)."""
    torch.manual_seed(0)
    model = apply_fsdp(MoEModel(model_cfg), world)
    config = _config(groups)
    state = TrainState(model, make_optimizer(model, config.trainer), 0)
    peak, seconds = 0, []
    for batch in _batches(model_cfg, groups, STEPS):
        started = time.perf_counter()
        state, _ = train_step(state, batch, config, world)
        seconds.append(time.perf_counter() - started)
        peak = max(peak, _held_bytes(state))
    return peak, min(seconds[1:] or seconds), full_weights(state.model, world)  # the first step pays for lazy init


def bench_fsdp(args: argparse.Namespace) -> int:
    model_cfg, groups = (QUICK, 2) if args.quick else (MODEL, 4)
    threads = 1
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="reel-bench-fsdp-") as tmp:
        argv = [sys.executable, *distributed.torchrun_argv(2, "reel.runtime.bench_fsdp"), tmp] + ["quick"] * args.quick
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        two = json.loads((Path(tmp) / "figures.json").read_text())
        two_weights = load((Path(tmp) / "weights.safetensors").read_bytes())
    one_bytes, one_seconds, one_weights = measure(distributed.LOCAL, model_cfg, groups)
    one = load(one_weights)
    diff = max(float((one[k] - two_weights[k]).abs().max()) for k in one)
    print_json({
        "bench": "fsdp", "params": sum(p.numel() for p in MoEModel(model_cfg).parameters()),
        "tokens_per_step": groups * 8 * 16, "steps": STEPS, "backend": two["backend"],
        "one_rank_peak_bytes": one_bytes, "two_rank_peak_bytes_per_rank": two["peak_bytes"],
        "one_rank_step_s": round(one_seconds, 4), "two_rank_step_s": round(two["step_s"], 4),
        "max_abs_weight_diff": diff, "ratio": round(one_bytes / two["peak_bytes"], 3),
    })
    return 0


def _rank_main(out: str, quick: str = "") -> None:
    """One rank of the 2-rank side (under torchrun)."""
    world = distributed.from_env()
    model_cfg, groups = (QUICK, 2) if quick else (MODEL, 4)
    torch.set_num_threads(1)
    peak, seconds, weights = measure(world, model_cfg, groups)
    peaks = [distributed.all_sum(world, float(peak) if r == world.rank else 0.0) for r in range(world.size)]
    if world.rank == 0:
        backend = torch.distributed.get_backend()
        (Path(out) / "figures.json").write_text(json.dumps({"peak_bytes": int(max(peaks)), "step_s": seconds,
                                                            "backend": backend}))
        (Path(out) / "weights.safetensors").write_bytes(weights)
    distributed.shutdown(world)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
