"""One rank of the FSDP2 tests (tests/runtime/train/test_fsdp.py), started by torchrun on gloo.

    fsdp_peer.py steps OUT [EP] [CP]  3 steps of test_train_step's model and batches (EP, CP: trainer.expert_parallel,
                                  trainer.context_parallel, default 1); rank 0 writes OUT/weights.safetensors
                                  and OUT/results.json (digests in the pieces scheme), and the last step's
                                  digest in the canonical scheme to OUT/canonical.txt
    fsdp_peer.py save RUN OUT [EP] 2 steps, then a DCP checkpoint into RUN; rank 0 writes the
                                  manifest (RUN/manifest.json) and the full state (OUT/state.safetensors)
    fsdp_peer.py load RUN OUT [EP] a fresh state loads RUN/manifest.json; rank 0 writes the full state
    fsdp_peer.py publish OUT [EP]  1 step, then every rank writes its own shards of version 1 into OUT/blobs
                                  (runtime/weights/rank_publish.py); then the full state is gathered and published
                                  from rank 0 alone; then version 2 (a few elements changed) as each rank's
                                  delta; rank 0 writes the three refs to OUT/published.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from reel.bus.blob_backends.file import BlobStore
from reel.runtime.train import distributed
from reel.runtime.checkpoint import sharded as sharded_checkpoint
from reel.runtime.train.batch import build_batch
from reel.runtime.config.sections import Config
from reel.runtime.model.model import MoEModel
from reel.runtime.model.parallelize import parallelize
from reel.runtime.model.weights import hub_tensors
from reel.runtime.weights.rank_publish import RankPublisher
from reel.runtime.train.step import TrainState, full_weights, make_optimizer, train_step
from reel.runtime.weights.digest import CANONICAL, weights_digest
from reel.runtime.weights.publish import publish_version
from train_setup import MODEL, step_config, random_groups

MICRO_BATCH_TOKENS = 24  # several micro-batches per rank, of different counts across ranks


def config(expert_parallel: int = 1, ranks: int = 2, context_parallel: int = 1) -> Config:
    return step_config(micro_batch_tokens=MICRO_BATCH_TOKENS, ranks=ranks, expert_parallel=expert_parallel,
                   context_parallel=context_parallel)


def fresh_state(world: distributed.World, cfg: Config) -> TrainState:
    torch.manual_seed(0)
    model = parallelize(MoEModel(MODEL), world, cfg.trainer.expert_parallel, cfg.trainer.context_parallel)
    return TrainState(model, make_optimizer(model, cfg.trainer), 0)


def batches(n: int) -> list:
    torch.manual_seed(1)
    sampler = MoEModel(MODEL)
    return [build_batch(random_groups(sampler, seed, n_groups=3)) for seed in range(n)]


def full_state(state: TrainState) -> dict[str, torch.Tensor]:
    """Weights and AdamW state, unsharded, as flat names (a collective on N ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=options)
    flat = {f"model.{k}": v.contiguous() for k, v in model_sd.items()}
    for name, values in optim_sd.get("state", {}).items():
        flat.update({f"optim.{name}.{k}": torch.as_tensor(v).contiguous() for k, v in values.items()})
    return flat


def main(mode: str, *paths: str) -> None:
    world = distributed.from_env()
    ep_arg = {"steps": 1, "save": 2, "load": 2, "publish": 1}[mode]  # the optional EP argument's position
    ep, cp = (int(paths[i]) if len(paths) > i else 1 for i in (ep_arg, ep_arg + 1))
    cfg = config(ep, world.size, cp)
    state = fresh_state(world, cfg)
    if mode == "steps":
        out = Path(paths[0])
        results = []
        for batch in batches(3):
            state, result = train_step(state, batch, cfg, world)
            results.append({"loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics,
                            "sha": result.weights_sha256})
        experts = state.model.model.layers[0].mlp.experts
        weights = full_weights(state.model, world)  # a collective: every rank gathers, rank 0 gets the bytes
        canonical = weights_digest(state.model, world, CANONICAL)  # what a replay of an older log computes
        if world.rank == 0:
            (out / "weights.safetensors").write_bytes(weights)
            (out / "canonical.txt").write_text(canonical)
            (out / "results.json").write_text(json.dumps(results))
            (out / "experts.json").write_text(json.dumps({"class": type(experts).__name__,
                                                          "local_shape": list(experts.gate_proj.to_local().shape)}))
    elif mode == "save":
        run, out = Path(paths[0]), Path(paths[1])
        for batch in batches(2):
            state, _ = train_step(state, batch, cfg, world)
        manifest = sharded_checkpoint.save(state, world, run)
        full = full_state(state)
        if world.rank == 0:
            (run / "manifest.json").write_bytes(manifest)
            save_file(full, out / "state.safetensors")
    elif mode == "load":
        run, out = Path(paths[0]), Path(paths[1])
        state = sharded_checkpoint.load((run / "manifest.json").read_bytes(), state, world, run, source="test")
        full = full_state(state)
        if world.rank == 0:
            save_file(full, out / "state.safetensors")
    elif mode == "publish":
        out = Path(paths[0])
        state, _ = train_step(state, batches(1)[0], cfg, world)
        blobs = BlobStore(out / "blobs")
        publisher = RankPublisher(world, msgspec.structs.replace(
            cfg, trainer=msgspec.structs.replace(cfg.trainer, weight_delta=True)))
        ranks = publisher.publish(state.model, 1, blobs)  # no gather: shard descriptions only
        full = distributed.full_state_dict(state.model)  # the reference: rank 0 gathers and writes every shard
        with torch.no_grad():  # version 2: one element of each rank's rows of every parameter changed
            for p in state.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.numel():
                    local.view(-1)[0] += 1.0
        delta = publisher.publish(state.model, 2, blobs)
        if world.rank == 0:
            assert ranks is not None and delta is not None
            gathered, _ = publish_version(blobs, hub_tensors(full, MODEL), version=1, step=1)
            (out / "published.json").write_bytes(msgspec.json.encode({"ranks": ranks[0], "gathered": gathered,
                                                                       "delta": delta[0]}))
    distributed.shutdown(world)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
