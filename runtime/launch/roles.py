"""`reel role NAME`: what each role process runs, and with which arguments.

The supervisor (and a Slurm job) starts every role as `reel role NAME RUN_DIR`; this is where the
name becomes the role's entry point. Each import is inside its branch, so a role process imports
only its own side (a rollout worker never imports the trainer) and `reel --help` imports neither.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from reel.runtime.launch.run_dir import RunDirError, load_run_config, read_bus_url, use_cluster_client


def main_role(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    config = load_run_config(run_dir)
    use_cluster_client(config)
    url = args.bus or os.environ.get("REEL_BUS_URL") or read_bus_url(run_dir, args.name)
    match args.name:
        case "archiver":
            from reel.consumers import archiver

            return int(archiver.main(run_dir, url, config.run.name, config.bus.partitions) or 0)
        case "trainer":
            from reel.consumers import trainer

            return int(trainer.main(run_dir, url) or 0)
        case "rollout":
            from reel.producers import rollout

            return int(rollout.main(run_dir, url, args.worker) or 0)
        case "eval":  # started when [eval] every > 0
            from reel.producers import evaluator

            return int(evaluator.main(run_dir, url) or 0)
        case "sink":
            if args.sink is None:
                raise RunDirError("reel role sink needs --sink wandb|tensorboard|mlflow")
            from reel.consumers.sinks import cli as sinks

            return int(sinks.role_main(run_dir, url, args.sink) or 0)
    raise RunDirError(f"reel role {args.name}: no such role; the roles are archiver, trainer, rollout, eval, sink")
