"""`reel`: parse arguments, then hand over to the module that does the work.

Handlers are named "module:function" and imported only when their command runs, so `reel
config show` answers without importing torch. A handler takes the parsed arguments and returns
an exit code. A `ReelError` becomes one line on stderr and exit code 2 (config) or 1; `reel replay`
keeps exit 1 for "a step did not reproduce", so its errors exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from reel.bus.errors import ReelError, printable
from reel.bus.events import STREAMS

# `reel bench NAME` -> handler; each prints one JSON line with a `ratio` key.
BENCHES = {
    "bus": "reel.bus.bench_cluster:bench_bus_any",
    "log": "reel.bus.bench:bench_log",
    "blobs": "reel.bus.blob_backends.bench:bench_blobs",
    "r3": "reel.runtime.model.bench:bench_r3",
    "fp8": "reel.runtime.model.bench:bench_fp8",
    "engine": "reel.producers.bench:bench_engine",
    "swap": "reel.producers.bench_swap:bench_swap",
    "async": "reel.runtime.bench_async:bench_async",
    "fsdp": "reel.runtime.bench_fsdp:bench_fsdp",
}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default unless it is None/False (their help says what absence means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Every (sub)parser formats help the same way; subparsers inherit this class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


def _command(sub, name: str, help: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose help starts with `help` and ends with its examples."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return sub.add_parser(name, help=help, description=help, epilog=epilog)


def _version() -> str:
    try:
        return importlib.metadata.version("reel-rl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (source checkout, not pip-installed)"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="reel", description="Event-sourced asynchronous RL for MoE models.",
                epilog="examples:\n  reel run examples/reverse_text.toml\n  reel replay step 3 --run runs/reverse_text")
    p.add_argument("--version", action="version", version=f"reel {_version()}")
    p.set_defaults(errors_exit_2=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = _command(sub, "run", "run a config end to end on this machine",
                   "reel run examples/reverse_text.toml", "reel run examples/reverse_text.toml --resume --no-live")
    run.add_argument("config", help="TOML config file")
    run.add_argument("--out", default=None, help="run directory (default: <run.out_dir>/<run.name>)")
    run.add_argument("--resume", action="store_true", help="continue a stopped run from its log")
    run.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live view")
    run.set_defaults(handler="reel.runtime.launch.supervisor:main_run")

    role = _command(sub, "role", "start one role of a run (multi-node use)",
                    "reel role trainer --run /shared/runs/r1 --bus redis://head:6379",
                    "reel role rollout --run /shared/runs/r1 --worker 2 --bus redis://head:6379")
    role.add_argument("name", choices=["trainer", "rollout", "archiver"], help="which role to start")
    role.add_argument("--run", required=True, dest="run_dir", help="run directory")
    role.add_argument("--worker", type=int, default=0, help="rollout worker index")
    role.add_argument("--bus", default=None, help="Redis URL (default: REEL_BUS_URL, else the run dir's bus_url); "
                      "argv is visible to every user, so pass a URL with a password through REEL_BUS_URL")
    role.set_defaults(handler="reel.runtime.launch.supervisor:main_role")

    config = _command(sub, "config", "inspect a config", "reel config show examples/reverse_text.toml")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    show = _command(config_sub, "show", "print the resolved config with defaults, as TOML",
                    "reel config show examples/reverse_text.toml > resolved.toml")
    show.add_argument("config", help="TOML config file")
    show.set_defaults(handler="reel.runtime.launch.cli:config_show")

    log = _command(sub, "log", "inspect a run's on-disk event log", "reel log verify --run runs/reverse_text")
    log_sub = log.add_subparsers(dest="log_command", required=True, metavar="COMMAND")
    verify = _command(log_sub, "verify", "check every record's CRC", "reel log verify --run runs/reverse_text")
    verify.add_argument("--run", required=True, dest="run_dir", help="run directory")
    verify.set_defaults(handler="reel.replay.logtools:verify")
    cat = _command(log_sub, "cat", "print a stream's events as JSON lines",
                   "reel log cat --run runs/reverse_text --stream steps | head",
                   "reel log cat --run runs/calc_tool --stream trajectories --decode | head -1")
    cat.add_argument("--run", required=True, dest="run_dir", help="run directory")
    cat.add_argument("--stream", required=True, choices=STREAMS, help="which stream to print")
    cat.add_argument("--decode", action="store_true", help="add the text of token ids (the run's tokenizer)")
    cat.set_defaults(handler="reel.replay.logtools:cat")

    bench = _command(sub, "bench", "run a benchmark; prints one JSON line with a `ratio` against its baseline",
                     "reel bench bus", "reel bench engine --quick")
    bench.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    bench.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    bench.add_argument("--partitions", type=int, default=0, metavar="P",
                       help="bus only: the pipeline on a local 3-master Redis Cluster with 1 and P partitions")
    bench.add_argument("--from-run", default=None, metavar="DIR",
                       help="r3, fp8: measure on a run's latest weights and prompts (default: random weights)")
    bench.set_defaults(handler="reel.runtime.launch.cli:run_bench")

    replay = _command(sub, "replay", "re-execute and analyse logged training steps",
                      "reel replay step 3 --run runs/reverse_text", "reel replay range 1..10 --run runs/reverse_text")
    replay.set_defaults(errors_exit_2=True)  # exit 1 means "did not reproduce" here
    replay_sub = replay.add_subparsers(dest="replay_command", required=True, metavar="COMMAND")
    step = _command(replay_sub, "step",
                    "re-execute step N bit for bit and analyse its batch; exit 1 if it does not reproduce, 2 on errors",
                    "reel replay step 3 --run runs/reverse_text",
                    "reel replay step 3 --run runs/reverse_text --json --plot step3.png")
    step.add_argument("step", type=int, help="step number (as in the steps stream)")
    step.add_argument("--run", required=True, dest="run_dir", help="run directory")
    step.add_argument("--json", action="store_true", help="print the report as one JSON object")
    step.add_argument("--plot", default=None, metavar="FILE.png", help="also save a figure (default: no figure)")
    step.add_argument("--ranks", type=int, default=None,
                      help="re-execute on this many ranks (default: the step's recorded world size)")
    step.set_defaults(handler="reel.replay.cli:main_step")
    rng = _command(replay_sub, "range",
                   "per-step figures over A..B; with --recompute exit 1 if any step does not reproduce",
                   "reel replay range 1..10 --run runs/reverse_text",
                   "reel replay range 1..10 --run runs/reverse_text --recompute --json")
    rng.add_argument("range", metavar="A..B", help="first and last step, inclusive")
    rng.add_argument("--run", required=True, dest="run_dir", help="run directory")
    rng.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    rng.add_argument("--plot", default=None, metavar="FILE.png", help="also save a figure (default: no figure)")
    rng.add_argument("--recompute", action="store_true", help="recompute KL by re-executing each step")
    rng.add_argument("--ranks", type=int, default=None,
                     help="with --recompute: ranks to re-execute on (default: the recorded world size)")
    rng.set_defaults(handler="reel.replay.cli:main_range")
    bis = _command(replay_sub, "bisect", "first step where a logged metric crosses a threshold, and why; "
                   "exit 1 if it never does (re-executes on one process)",
                   "reel replay bisect --run runs/moe_mismatch --metric grad_norm --above 5",
                   "reel replay bisect --run runs/moe_mismatch --metric kl_k3 --above 0.01 --json")
    bis.add_argument("--run", required=True, dest="run_dir", help="run directory")
    bis.add_argument("--metric", required=True, help="a StepCommitted metrics key, loss, grad_norm or staleness_mean")
    side = bis.add_mutually_exclusive_group(required=True)
    side.add_argument("--above", type=float, default=None, metavar="X", help="first step with metric > X (default: use --below)")
    side.add_argument("--below", type=float, default=None, metavar="X", help="first step with metric < X (default: use --above)")
    bis.add_argument("--before", type=int, default=3, help="steps before the crossing to re-execute (baseline)")
    bis.add_argument("--after", type=int, default=1, help="steps after the crossing to re-execute")
    bis.add_argument("--json", action="store_true", help="print the result as one JSON object")
    bis.add_argument("--plot", default=None, metavar="FILE.png", help="also save a figure (default: no figure)")
    bis.set_defaults(handler="reel.replay.cli:main_bisect")

    cmp = _command(sub, "compare", "two runs side by side: reward, KL, grad norm, staleness, weights",
                   "reel compare runs/a runs/b", "reel compare runs/a runs/b --json --plot ab.png")
    cmp.add_argument("run_a", metavar="RUN_A", help="first run directory")
    cmp.add_argument("run_b", metavar="RUN_B", help="second run directory")
    cmp.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    cmp.add_argument("--plot", default=None, metavar="FILE.png", help="also save a figure (default: no figure)")
    cmp.set_defaults(handler="reel.replay.cli:main_compare")

    sim = _command(sub, "simulate", "capacity planning: simulate the pipeline on a run's measured speeds",
                   "reel simulate --run runs/reverse_text --rollout-workers 4",
                   "reel simulate --run runs/reverse_text --sweep async-level=0,1,2 --plot sweep.png")
    sim.add_argument("--run", required=True, dest="run_dir", help="run directory whose log calibrates the model")
    sim.add_argument("--rollout-workers", type=int, default=None, help="rollout workers (default: the run's)")
    sim.add_argument("--trainer-ranks", type=int, default=None,
                     help="trainer compute divided by ranks x --rank-efficiency (FSDP modelled as scaling; "
                          "default: the run's)")
    sim.add_argument("--rank-efficiency", type=float, default=0.9, help="scaling efficiency per added trainer rank")
    sim.add_argument("--async-level", type=int, default=None, help="rollout.async_level (default: the run's)")
    sim.add_argument("--max-off-policy", type=int, default=None,
                     help="trainer.max_off_policy_steps (default: the run's)")
    sim.add_argument("--speedup-rollout", type=float, default=1.0, help="rollout speed factor")
    sim.add_argument("--speedup-trainer", type=float, default=1.0, help="trainer speed factor")
    sim.add_argument("--redis-us-per-event", type=float, default=0.0,
                     help="Redis CPU per event in µs, from `reel bench bus` (0 = not modelled)")
    sim.add_argument("--dedicated", action="store_true",
                     help="rollout and trainer on their own hardware: no slowdown fitted for shared cores")
    sim.add_argument("--steps", type=int, default=None, help="trainer steps to simulate (default: the run's)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the group resampling")
    sim.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                     help="one scenario per value (repeat for a grid; default: one scenario); keys: rollout-workers, "
                          "trainer-ranks, async-level, max-off-policy, speedup-rollout, speedup-trainer")
    sim.add_argument("--against", default=None, metavar="DIR",
                     help="simulate DIR's configuration and compare with what DIR measured (default: no comparison)")
    sim.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sim.add_argument("--plot", default=None, metavar="FILE.png", help="also save a figure (default: no figure)")
    sim.set_defaults(handler="reel.replay.simulate_cli:main")

    top = _command(sub, "top", "live terminal view of a run",
                   "reel top --run runs/reverse_text", "reel top --bus redis://head:6379 --name reverse_text --once")
    top.add_argument("--run", dest="run_dir", default=None, help="run directory (default: use --bus and --name)")
    top.add_argument("--bus", default=None, help="Redis URL, with --name (default: the run directory's bus)")
    top.add_argument("--name", default=None, help="run name on --bus (default: the run directory's)")
    top.add_argument("--once", action="store_true", help="print the current state and exit")
    top.set_defaults(handler="reel.consumers.metrics:main_top")

    metrics = _command(sub, "metrics", "export a run's metrics", "reel metrics serve --run runs/reverse_text")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", required=True, metavar="COMMAND")
    serve = _command(metrics_sub, "serve", "serve Prometheus text exposition on ADDR:PORT/metrics (127.0.0.1 by default)",
                     "reel metrics serve --run runs/reverse_text",
                     "prometheus --config.file=ops/prometheus/prometheus.yml  # scrapes :9464")
    serve.add_argument("--run", required=True, dest="run_dir", help="run directory")
    serve.add_argument("--port", type=int, default=9464, help="HTTP port")
    serve.add_argument("--bus", default=None, help="Redis URL (default: the run directory's bus)")
    serve.add_argument("--addr", default="127.0.0.1",
                       help="interface to bind (default 127.0.0.1, this machine only; 0.0.0.0 = every interface); "
                            "it serves figures only (no events, weights or secrets), unauthenticated")
    serve.set_defaults(handler="reel.consumers.metrics:main_serve")
    export = _command(metrics_sub, "export", "write one JSON line per step",
                      "reel metrics export --run runs/reverse_text --jsonl steps.jsonl")
    export.add_argument("--run", required=True, dest="run_dir", help="run directory")
    export.add_argument("--jsonl", required=True, help="output file (JSON lines)")
    export.set_defaults(handler="reel.consumers.metrics:main_export")

    retrain = _command(sub, "retrain", "train a new policy offline from a run's log",
                       "reel retrain --from runs/reverse_text --out runs/retrained",
                       "reel retrain --from runs/reverse_text --out runs/r2 --epochs 3 --shuffle 7")
    retrain.add_argument("--from", required=True, dest="from_dir", help="source run directory")
    retrain.add_argument("--out", required=True, help="new run directory")
    retrain.add_argument("--config", default=None,
                         help="TOML overriding keys of the source run's config (default: no overrides)")
    retrain.add_argument("--steps", type=int, default=None, help="trainer steps (default: all logged batches x --epochs)")
    retrain.add_argument("--epochs", type=int, default=1, help="passes over the logged batches")
    retrain.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                         help="shuffle batches with SEED (default: logged order)")
    retrain.add_argument("--init", default=None, help="initial weights (HF layout; default: the source run's)")
    retrain.add_argument("--ranks", type=int, default=1, help="train on this many ranks (FSDP2 under torchrun)")
    retrain.set_defaults(handler="reel.consumers.retrain:main")

    launch = _command(sub, "launch", "launch on a cluster scheduler",
                      "reel launch slurm examples/reverse_text.toml --partition gpu", "reel launch status --run runs/reverse_text")
    launch_sub = launch.add_subparsers(dest="launch_command", required=True, metavar="COMMAND")
    slurm = _command(launch_sub, "slurm", "submit the whole pipeline as one Slurm heterogeneous job",
                     "reel launch slurm examples/reverse_text.toml --dry-run",
                     "reel launch slurm examples/reverse_text_vllm.toml --partition gpu --gpus-per-node 8 --time 04:00:00")
    slurm.add_argument("config", help="TOML config file")
    slurm.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting")
    slurm.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    slurm.add_argument("--time", default="01:00:00", help="job time limit, HH:MM:SS")
    slurm.add_argument("--account", default=None, help="Slurm account (default: your default account)")
    slurm.add_argument("--run-dir", default=None, help="shared run directory (default: <out_dir>/<name>)")
    slurm.add_argument("--rollout-nodes", type=int, default=1, help="nodes of the rollout component")
    slurm.add_argument("--trainer-nodes", type=int, default=1, help="nodes of the trainer component")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs requested per node (0 = CPU only)")
    slurm.set_defaults(handler="reel.runtime.launch.slurm:main_submit")
    for verb in ("status", "cancel"):
        v = _command(launch_sub, verb, f"{verb} a submitted run", f"reel launch {verb} --run runs/reverse_text")
        v.add_argument("--run", required=True, dest="run_dir", help="run directory the job was submitted with")
        v.set_defaults(handler=f"reel.runtime.launch.slurm:main_{verb}")
    return p


def _call(target: str, args: argparse.Namespace) -> int:
    module, function = target.split(":")
    return int(getattr(importlib.import_module(module), function)(args) or 0)


def config_show(args: argparse.Namespace) -> int:
    from reel.runtime import config

    print(config.to_toml(config.load(args.config)), end="")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return _call(BENCHES[args.name], args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _call(args.handler, args)
    except ReelError as exc:
        from reel.runtime.config import ConfigError

        print(f"reel: {printable(str(exc))}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) or args.errors_exit_2 else 1
    except KeyboardInterrupt:
        print("reel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
