"""`reel`: parse arguments, then hand over to the module that does the work.

Handlers are named "module:function" and imported only when their command runs, so `reel
config show` answers without importing torch. A handler takes the parsed arguments and returns
an exit code. A `ReelError` becomes one line on stderr and exit code 2 (config) or 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bus.errors import ReelError

# `reel bench NAME` -> handler; each prints one JSON line with a `ratio` key.
BENCHES = {
    "bus": "bus.bench:bench_bus",
    "log": "bus.bench:bench_log",
    "r3": "runtime.model.bench:bench_r3",
    "fp8": "runtime.model.bench:bench_fp8",
    "engine": "producers.bench:bench_engine",
    "swap": "producers.bench_swap:bench_swap",
    "async": "runtime.bench_async:bench_async",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reel", description="Event-sourced asynchronous RL for MoE models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a config end to end on this machine")
    run.add_argument("config")
    run.add_argument("--out", default=None, help="run directory (default: <run.out_dir>/<run.name>)")
    run.add_argument("--resume", action="store_true", help="continue a stopped run from its log")
    run.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live view")
    run.set_defaults(handler="runtime.launch:main_run")

    role = sub.add_parser("role", help="start one role of a run (multi-node use)")
    role.add_argument("name", choices=["trainer", "rollout", "archiver"])
    role.add_argument("--run", required=True, dest="run_dir", help="run directory")
    role.add_argument("--worker", type=int, default=0, help="rollout worker index")
    role.add_argument("--bus", default=None, help="Redis URL (default: REEL_BUS_URL, else the run dir's bus_url); "
                      "argv is visible to every user, so pass a URL with a password through REEL_BUS_URL")
    role.set_defaults(handler="runtime.launch:main_role")

    config = sub.add_parser("config", help="inspect a config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config with defaults")
    show.add_argument("config")
    show.set_defaults(handler="runtime.cli:config_show")

    log = sub.add_parser("log", help="inspect a run's on-disk event log")
    log_sub = log.add_subparsers(dest="log_command", required=True)
    verify = log_sub.add_parser("verify", help="check every record's CRC")
    verify.add_argument("--run", required=True, dest="run_dir")
    verify.set_defaults(handler="replay.logtools:verify")
    cat = log_sub.add_parser("cat", help="print a stream's events as JSON lines")
    cat.add_argument("--run", required=True, dest="run_dir")
    cat.add_argument("--stream", required=True)
    cat.set_defaults(handler="replay.logtools:cat")

    bench = sub.add_parser("bench", help="run a benchmark; prints one JSON line")
    bench.add_argument("name", choices=sorted(BENCHES))
    bench.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    bench.set_defaults(handler="runtime.cli:run_bench")

    replay = sub.add_parser("replay", help="re-execute and analyse logged training steps")
    replay_sub = replay.add_subparsers(dest="replay_command", required=True)
    step = replay_sub.add_parser("step", help="re-execute step N bit for bit and analyse its batch")
    step.add_argument("step", type=int)
    step.add_argument("--run", required=True, dest="run_dir")
    step.add_argument("--json", action="store_true")
    step.add_argument("--plot", default=None, metavar="FILE.png")
    step.set_defaults(handler="replay.cli:main_step")
    rng = replay_sub.add_parser("range", help="per-step figures over A..B")
    rng.add_argument("range", metavar="A..B")
    rng.add_argument("--run", required=True, dest="run_dir")
    rng.add_argument("--json", action="store_true")
    rng.add_argument("--plot", default=None, metavar="FILE.png")
    rng.add_argument("--recompute", action="store_true", help="recompute KL by re-executing each step")
    rng.set_defaults(handler="replay.cli:main_range")

    sim = sub.add_parser("simulate", help="capacity planning: simulate the pipeline on a run's measured speeds")
    sim.add_argument("--run", required=True, dest="run_dir", help="run directory whose log calibrates the model")
    sim.add_argument("--rollout-workers", type=int, default=None)
    sim.add_argument("--trainer-ranks", type=int, default=None,
                     help="trainer compute divided by ranks x --rank-efficiency (FSDP modelled as scaling)")
    sim.add_argument("--rank-efficiency", type=float, default=0.9)
    sim.add_argument("--async-level", type=int, default=None)
    sim.add_argument("--max-off-policy", type=int, default=None)
    sim.add_argument("--speedup-rollout", type=float, default=1.0)
    sim.add_argument("--speedup-trainer", type=float, default=1.0)
    sim.add_argument("--redis-us-per-event", type=float, default=0.0,
                     help="Redis CPU per event in µs, from `reel bench bus` (0 = not modelled)")
    sim.add_argument("--dedicated", action="store_true",
                     help="rollout and trainer on their own hardware: no slowdown fitted for shared cores")
    sim.add_argument("--steps", type=int, default=None, help="trainer steps to simulate (default: the run's)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the group resampling")
    sim.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                     help="one scenario per value (repeat for a grid); keys: rollout-workers, trainer-ranks, async-level, "
                          "max-off-policy, speedup-rollout, speedup-trainer")
    sim.add_argument("--against", default=None, metavar="DIR",
                     help="simulate DIR's configuration and compare with what DIR measured")
    sim.add_argument("--json", action="store_true")
    sim.add_argument("--plot", default=None, metavar="FILE.png")
    sim.set_defaults(handler="replay.simulate_cli:main")

    top = sub.add_parser("top", help="live terminal view of a run")
    top.add_argument("--run", dest="run_dir", default=None, help="run directory")
    top.add_argument("--bus", default=None, help="Redis URL (with --name)")
    top.add_argument("--name", default=None, help="run name on --bus")
    top.add_argument("--once", action="store_true", help="print the current state and exit")
    top.set_defaults(handler="consumers.metrics:main_top")

    metrics = sub.add_parser("metrics", help="export a run's metrics")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", required=True)
    serve = metrics_sub.add_parser(
        "serve", help="Prometheus text exposition",
        description="Serve the run's figures (steps, rewards, losses, KL, staleness, throughput, dead letters; "
                    "no events, weights or secrets) as Prometheus text on http://ADDR:PORT/metrics, unauthenticated.")
    serve.add_argument("--run", required=True, dest="run_dir")
    serve.add_argument("--port", type=int, default=9464)
    serve.add_argument("--addr", default="127.0.0.1",
                       help="interface to bind (default 127.0.0.1, this machine only; 0.0.0.0 = every interface)")
    serve.add_argument("--bus", default=None)
    serve.set_defaults(handler="consumers.metrics:main_serve")
    export = metrics_sub.add_parser("export", help="one JSON line per step")
    export.add_argument("--run", required=True, dest="run_dir")
    export.add_argument("--jsonl", required=True)
    export.set_defaults(handler="consumers.metrics:main_export")

    retrain = sub.add_parser("retrain", help="train a new policy offline from a run's log")
    retrain.add_argument("--from", required=True, dest="from_dir")
    retrain.add_argument("--out", required=True)
    retrain.add_argument("--config", default=None, help="TOML overriding keys of the source run's config")
    retrain.add_argument("--steps", type=int, default=None)
    retrain.add_argument("--epochs", type=int, default=1)
    retrain.add_argument("--shuffle", type=int, default=None, metavar="SEED")
    retrain.add_argument("--init", default=None, help="initial weights (HF layout) instead of the run's")
    retrain.set_defaults(handler="consumers.retrain:main")

    launch = sub.add_parser("launch", help="launch on a cluster scheduler")
    launch_sub = launch.add_subparsers(dest="launch_command", required=True)
    slurm = launch_sub.add_parser("slurm", help="submit the whole pipeline as one Slurm heterogeneous job")
    slurm.add_argument("config")
    slurm.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default="01:00:00")
    slurm.add_argument("--account", default=None)
    slurm.add_argument("--run-dir", default=None, help="shared run directory (default: <out_dir>/<name>)")
    slurm.add_argument("--rollout-nodes", type=int, default=1)
    slurm.add_argument("--trainer-nodes", type=int, default=1)
    slurm.add_argument("--gpus-per-node", type=int, default=0)
    slurm.set_defaults(handler="runtime.slurm:main_submit")
    for verb in ("status", "cancel"):
        v = launch_sub.add_parser(verb, help=f"{verb} a submitted run")
        v.add_argument("run_dir")
        v.set_defaults(handler=f"runtime.slurm:main_{verb}")
    return p


def _call(target: str, args: argparse.Namespace) -> int:
    module, function = target.split(":")
    return int(getattr(importlib.import_module(module), function)(args) or 0)


def config_show(args: argparse.Namespace) -> int:
    from runtime import config

    print(config.to_toml(config.load(args.config)), end="")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return _call(BENCHES[args.name], args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _call(args.handler, args)
    except ReelError as exc:
        from runtime.config import ConfigError

        print(f"reel: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        print("reel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
