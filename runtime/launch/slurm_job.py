"""What a `reel launch slurm` job is asked for (JobOptions, from the command line) and what refuses it before
anything is rendered: every check names the config key or flag to change."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import NamedTuple

from reel.runtime.config.keys import ConfigError
from reel.runtime.config.sections import Config
from reel.runtime.launch import vllm_args

SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")  # run directories go unquoted into #SBATCH lines


class JobOptions(NamedTuple):
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    rollout_nodes: int = 1
    trainer_nodes: int = 1
    gpus_per_node: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> JobOptions:
        return cls(args.time, args.partition, args.account, args.rollout_nodes, args.trainer_nodes,
                   args.gpus_per_node)



def check(c: Config, run_dir: Path, opts: JobOptions) -> None:
    """Refuse a job that cannot run, naming the key or flag to change."""
    _require(SAFE_PATH.fullmatch(str(run_dir)) is not None,
             f"--run-dir {run_dir} has characters a job script cannot carry; use letters, digits and _ . / + -")
    _require(not c.bus.url or c.bus.cluster, f"bus.url = {c.bus.url!r}: `reel launch slurm` starts the run's own "
                                             f"Redis on the control node; remove bus.url (or set bus.cluster = true "
                                             f"to use the Redis Cluster it names)")
    for flag, text in (("--time", opts.time), ("--partition", opts.partition), ("--account", opts.account)):
        _require(text is None or re.fullmatch(r"[A-Za-z0-9_:.,-]+", text) is not None,
                 f"{flag} {text!r} is not a Slurm {flag[2:]} (letters, digits and _ : . , - only)")
    for flag, value in (("--rollout-nodes", opts.rollout_nodes), ("--trainer-nodes", opts.trainer_nodes)):
        _require(value >= 1, f"{flag} {value} must be at least 1")
    _require(opts.gpus_per_node >= 0, f"--gpus-per-node {opts.gpus_per_node} must be >= 0")
    ranks, nodes = c.trainer.ranks, opts.trainer_nodes
    if opts.gpus_per_node:
        _require(ranks == 1 or ranks == nodes * opts.gpus_per_node,
                 f"trainer.ranks = {ranks} but --trainer-nodes {nodes} x --gpus-per-node {opts.gpus_per_node} "
                 f"start {nodes * opts.gpus_per_node} ranks (one per GPU); set trainer.ranks to that or leave it 1")
    else:
        _require(ranks % nodes == 0, f"trainer.ranks = {ranks} does not split evenly over --trainer-nodes "
                                     f"{nodes}; make it a multiple of the node count")
    if c.engine.kind == "builtin":
        _require(c.rollout.workers >= opts.rollout_nodes,
                 f"--rollout-nodes {opts.rollout_nodes} exceeds rollout.workers = {c.rollout.workers}: a node "
                 f"would run no worker; lower --rollout-nodes or raise rollout.workers")
        return
    _require(bool(c.model.path), "engine.kind = \"vllm\" on Slurm needs model.path (the HF-layout directory "
                                 "every vLLM node loads at start; later weights come from WeightsPublished)")
    _require(not (c.engine.pd_disaggregation and opts.rollout_nodes != 1),
             "with engine.pd_disaggregation = true the pools' sizes are engine.prefill_nodes and "
             "engine.decode_nodes; drop --rollout-nodes")
    for pool in vllm_args.pools(c, opts.rollout_nodes):
        vllm_args.check_layout(c, pool, opts.gpus_per_node)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
