"""Every `reel` command and its arguments, for cli.py's parser.

Handlers are named "module:function" (the CLI's lazy dispatch): a command imports its module only
when it runs, so `reel --help` and `reel config show` never import torch.
"""

from __future__ import annotations

import argparse
import importlib.metadata

from reel.bus.events import STREAMS
from reel.runtime.bench import bench_modules


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="reel", description="Event-sourced asynchronous RL for MoE models.",
                epilog="examples:\n  reel run examples/reverse_text.toml\n  reel replay step 3 --run runs/reverse_text")
    p.add_argument("--version", action="version", version=f"reel {_version()}")
    p.set_defaults(errors_exit_2=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _run_commands(sub)
    _log_commands(sub)
    _replay_commands(sub)
    _top_commands(sub)
    _retrain_commands(sub)
    _launch_commands(sub)
    return p


def _run_commands(sub) -> None:
    """Commands that start or set up a run: run, init, role, config."""
    run = _command(sub, "run", "run a config end to end on this machine",
                   "reel run examples/reverse_text.toml", "reel run examples/reverse_text.toml --resume --no-live")
    run.add_argument("config", help="TOML config file")
    run.add_argument("--out", default=None, help="run directory (default: <run.out_dir>/<run.name>)")
    run.add_argument("--resume", action="store_true", help="continue a stopped run from its log")
    run.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live view")
    run.add_argument("--set", action="append", default=None, metavar="SECTION.KEY=VALUE",
                     help="override one config key (repeatable; a TOML value); recorded in the run's config.toml "
                          "(default: none)")
    run.add_argument("--defaults", action="store_true", help="accept an empty config: run every default")
    run.set_defaults(handler="reel.runtime.launch.supervisor:main_run")

    init = _command(sub, "init", "write a starting config for a task, on a tiny MoE or an HF model directory",
                    "reel init --task reverse_text --out reverse.toml",
                    "reel init --from-model ~/models/Qwen3-30B-A3B --task arith --out qwen_arith.toml")
    init.add_argument("--task", default="reverse_text",
                      help="env.name: reverse_text, sort_digits, arith, calc_tool or package.module:factory")
    init.add_argument("--from-model", default=None, metavar="DIR",
                      help="an HF Qwen3-MoE checkpoint directory to train (default: a tiny MoE from keys)")
    init.add_argument("--out", default="reel.toml", help="the config file to write (must not exist)")
    init.set_defaults(handler="reel.runtime.launch.init_config:main")

    role = _command(sub, "role", "start one role of a run (multi-node use)",
                    "reel role trainer --run /shared/runs/r1 --bus redis://head:6379",
                    "reel role rollout --run /shared/runs/r1 --worker 2 --bus redis://head:6379")
    role.add_argument("name", choices=["trainer", "rollout", "archiver", "sink", "eval", "mismatch"],
                      help="which role to start")
    role.add_argument("--run", required=True, dest="run_dir", help="run directory")
    role.add_argument("--worker", type=int, default=0, help="rollout worker index")
    role.add_argument("--sink", choices=["wandb", "tensorboard", "mlflow"], default=None,
                      help="sink role: which tracker (default: none; a sink role needs it)")
    role.add_argument("--bus", default=None, help="Redis URL (default: REEL_BUS_URL, else the run dir's bus_url); "
                      "argv is visible to every user, so pass a URL with a password through REEL_BUS_URL")
    role.set_defaults(handler="reel.runtime.launch.roles:main_role")

    config = _command(sub, "config", "inspect a config", "reel config show examples/reverse_text.toml")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    show = _command(config_sub, "show", "print the resolved config with defaults, as TOML",
                    "reel config show examples/reverse_text.toml > resolved.toml")
    show.add_argument("config", help="TOML config file")
    show.set_defaults(handler="reel.runtime.launch.cli:config_show")
    schema = _command(config_sub, "schema", "every config key with its type, default and help (Markdown; "
                      "docs/reference/config.md is this output)", "reel config schema", "reel config schema --json")
    schema.add_argument("--json", action="store_true", help="one JSON list of {key, type, default, help}")
    schema.set_defaults(handler="reel.runtime.config.schema:main")


def _log_commands(sub) -> None:
    """Commands on a run's log and the benches: log, bench."""
    log = _command(sub, "log", "inspect a run's on-disk event log", "reel log verify --run runs/reverse_text")
    log_sub = log.add_subparsers(dest="log_command", required=True, metavar="COMMAND")
    verify = _command(log_sub, "verify", "check every record's CRC", "reel log verify --run runs/reverse_text")
    verify.add_argument("--run", required=True, dest="run_dir", help="run directory")
    verify.set_defaults(handler="reel.replay.logtools:verify")
    repair = _command(log_sub, "repair", "keep the longest valid prefix of each damaged stream (after copying "
                      "the log) and say what was dropped", "reel log repair --run runs/reverse_text")
    repair.add_argument("--run", required=True, dest="run_dir", help="run directory (of a stopped run)")
    repair.set_defaults(handler="reel.replay.log_repair:main")
    cat = _command(log_sub, "cat", "print a stream's events as JSON lines",
                   "reel log cat --run runs/reverse_text --stream steps | head",
                   "reel log cat --run runs/calc_tool --stream trajectories --decode | head -1")
    cat.add_argument("--run", required=True, dest="run_dir", help="run directory")
    cat.add_argument("--stream", required=True, choices=STREAMS, help="which stream to print")
    cat.add_argument("--decode", action="store_true", help="add the text of token ids (the run's tokenizer)")
    cat.set_defaults(handler="reel.replay.logtools:cat")
    gc = _command(log_sub, "gc", "delete the weight versions the retention policy lets go (bus/retention.py)",
                  "reel log gc --run runs/reverse_text", "reel log gc --run runs/reverse_text --dry-run")
    gc.add_argument("--run", required=True, dest="run_dir", help="run directory")
    gc.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    gc.set_defaults(handler="reel.replay.gc:gc")
    du = _command(log_sub, "du", "bytes of a run by kind, per step and per trained token, and an extrapolation",
                  "reel log du --run runs/reverse_text", "reel log du --run runs/reverse_text --json")
    du.add_argument("--run", required=True, dest="run_dir", help="run directory")
    du.add_argument("--json", action="store_true", help="one JSON line instead of the tables")
    du.add_argument("--steps", type=int, default=1000, help="steps of the extrapolated runs")
    du.add_argument("--tokens-per-step", type=int, default=1_000_000, help="trained tokens per extrapolated step")
    du.set_defaults(handler="reel.replay.du:du")

    benches = bench_modules()
    bench = _command(sub, "bench", "run a benchmark; prints one JSON line with a `ratio` against its baseline",
                     "reel bench bus", "reel bench engine --quick")
    bench.description += "\n\nbenchmarks (runtime/bench/, one module each):\n" + "\n".join(
        f"  {name:<10} {line}" for name, line in sorted(benches.items()))
    bench.add_argument("name", choices=sorted(benches), help="which benchmark")
    bench.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    bench.add_argument("--partitions", type=int, default=0, metavar="P",
                       help="bus only: the pipeline on a local 3-master Redis Cluster with 1 and P partitions")
    bench.add_argument("--from-run", default=None, metavar="DIR",
                       help="r3, fp8: measure on a run's latest weights and prompts (default: random weights)")
    bench.add_argument("--workload", choices=["slow-tool", "long-tail"], default="slow-tool",
                       help="async only: multi-turn episodes whose tool calls wait a heavy-tailed wall time "
                            "(default), or one-turn answers with a long-tail length")
    bench.add_argument("--keep", default=None, metavar="DIR",
                       help="async only: keep the runs' directories (DIR/async0, DIR/async2; DIR/async0-2, ... with "
                            "--repeats) to inspect, replay or `reel simulate` (default: a temporary directory, removed)")
    bench.add_argument("--steps", type=int, default=None, metavar="N",
                       help="async only: steps per run (default 40, 8 with --quick)")
    bench.add_argument("--repeats", type=int, default=1, metavar="N",
                       help="async only: run N sync/async pairs in turn and report medians, each pair's walls and "
                            "the simulator's error against the median async wall (default 1)")
    bench.set_defaults(handler="reel.runtime.launch.cli:run_bench")


def _replay_commands(sub) -> None:
    """Commands that re-execute and analyse: replay, compare, simulate."""
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
    sim.add_argument("--rank-efficiency", type=float, default=None,
                     help="trainer throughput of N ranks = N x this (default: from --rank-efficiency-from, else 0.9, "
                          "assumed)")
    sim.add_argument("--rank-efficiency-from", default=None, nargs="+", metavar="PATH",
                     help="fit the rank efficiency from a `reel bench fsdp` JSON line (1-process vs 2-rank s/step), "
                          "or from two run directories of the same config on 1 rank and on N (compute s/token; "
                          "default: none)")
    sim.add_argument("--async-level", type=int, default=None, help="rollout.async_level (default: the run's)")
    sim.add_argument("--max-off-policy", type=int, default=None,
                     help="trainer.max_off_policy_steps (default: the run's)")
    sim.add_argument("--speedup-rollout", type=float, default=1.0, help="rollout speed factor")
    sim.add_argument("--speedup-trainer", type=float, default=1.0, help="trainer speed factor")
    sim.add_argument("--redis-us-per-event", type=float, default=0.0,
                     help="Redis CPU per event in µs, from `reel bench bus` (0 = not modelled)")
    sim.add_argument("--dedicated", action="store_true",
                     help="rollout and trainer on their own hardware: no slowdown fitted for shared cores")
    sim.add_argument("--background", type=float, default=None,
                     help="other runnable threads sharing the machine's cores (0 = the run alone; needs a log with "
                          "CPU times; default: as fitted on the log)")
    sim.add_argument("--steps", type=int, default=None, help="trainer steps to simulate (default: the run's)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the group resampling")
    sim.add_argument("--repeats", type=int, default=8,
                     help="simulate this many draws of groups (seeds --seed, --seed + 1, ...) and report their mean")
    sim.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                     help="one scenario per value (repeat for a grid; default: one scenario); keys: rollout-workers, "
                          "trainer-ranks, async-level, max-off-policy, speedup-rollout, speedup-trainer, background")
    sim.add_argument("--against", default=None, metavar="DIR",
                     help="simulate DIR's configuration and compare with what DIR measured (default: no comparison)")
    sim.add_argument("--set", action="append", default=None, metavar="SECTION.KEY=VALUE",
                     help="override a config key the simulation models (rollout.workers, trainer.ranks, "
                          "rollout.async_level, trainer.max_off_policy_steps, run.steps; repeatable; default: none)")
    sim.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sim.add_argument("--plot", default=None, metavar="FILE.png", help="also save a figure (default: no figure)")
    sim.set_defaults(handler="reel.replay.simulate_cli:main")


def _top_commands(sub) -> None:
    """Commands that watch and score a run: top, eval, metrics, report."""
    top = _command(sub, "top", "live terminal view of a run",
                   "reel top --run runs/reverse_text", "reel top --bus redis://head:6379 --name reverse_text --once")
    top.add_argument("--run", dest="run_dir", default=None, help="run directory (default: use --bus and --name)")
    top.add_argument("--bus", default=None, help="Redis URL, with --name (default: the run directory's bus)")
    top.add_argument("--name", default=None, help="run name on --bus (default: the run directory's)")
    top.add_argument("--once", action="store_true", help="print the current state and exit")
    top.set_defaults(handler="reel.consumers.metrics:main_top")

    ev = _command(sub, "eval", "held-out scores of one policy version (the eval role's figures), as one JSON line",
                  "reel eval --run runs/rg_spell_backward --version 20",
                  "reel eval --run runs/rg_spell_backward --weights model.safetensors --prompts 64")
    ev.add_argument("--run", required=True, dest="run_dir", help="run directory (its config's [eval] and env)")
    which = ev.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", type=int, default=None, help="a policy version the run published (default: use --weights)")
    which.add_argument("--weights", default=None, metavar="FILE", help="a safetensors file of the run's model (default: use --version)")
    ev.add_argument("--prompts", type=int, default=None, help="held-out prompts (default: the config's eval.prompts)")
    ev.set_defaults(handler="reel.producers.evaluator:main_cli")

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
    for tracker, what in (("tensorboard", "TensorBoard event files"), ("mlflow", "an MLflow run (local store or tracking URI)"),
                          ("wandb", "W&B offline run files (sync them with `wandb sync`)")):
        sink = _command(metrics_sub, tracker, f"write every step's figures, eval results and the config into {what}; "
                        "resumes where it stopped", f"reel metrics {tracker} --run runs/reverse_text",
                        f"reel metrics {tracker} --run runs/reverse_text --follow")
        sink.add_argument("--run", required=True, dest="run_dir", help="run directory")
        sink.add_argument("--follow", action="store_true", help="keep writing until the run finishes (default: what is there now)")
        sink.add_argument("--bus", default=None, help="Redis URL (default: the run directory's bus)")
        if tracker == "mlflow":
            sink.add_argument("--tracking-uri", default=None,
                              help="MLflow tracking URI (default: metrics.mlflow_tracking_uri, else SQLite in the run directory)")
            sink.add_argument("--experiment", default=None, help="MLflow experiment (default: metrics.mlflow_experiment)")
        else:
            sink.add_argument("--out", default=None, help=f"output directory (default: metrics.{tracker}_dir, "
                              "else under RUN_DIR/tracking)")
        if tracker == "wandb":
            sink.add_argument("--project", default=None, help="W&B project (default: metrics.wandb_project)")
        sink.set_defaults(handler="reel.consumers.sinks.cli:main")

    report = _command(sub, "report", "one self-contained HTML page of a run (charts, evals, config), from its log",
                      "reel report --run runs/reverse_text -o report.html",
                      "reel replay bisect --run runs/moe_mismatch --metric kl_k3 --above 0.03 --json > why.json; "
                      "reel report --run runs/moe_mismatch -o report.html --bisect why.json")
    report.add_argument("--run", required=True, dest="run_dir", help="run directory")
    report.add_argument("-o", "--output", required=True, metavar="FILE.html", help="the HTML file to write")
    report.add_argument("--bisect", default=None, metavar="FILE.json",
                        help="include the findings of `reel replay bisect --json` (default: none)")
    report.add_argument("--timeline", default=None, metavar="FILE.png",
                        help="also write the timeline of trainer phases and worker busy/tool-wait/idle as a PNG "
                        "(default: only in the HTML page)")
    report.set_defaults(handler="reel.replay.html_report:main")


def _retrain_commands(sub) -> None:
    """Commands that make a new policy from a run: retrain, export."""
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
    retrain.add_argument("--set", action="append", default=None, metavar="SECTION.KEY=VALUE",
                         help="override one key of the new run's config (repeatable; after --config; default: none)")
    retrain.add_argument("--rescore", action="store_true",
                         help="score every logged sample again with the env reward of the (--config overridden) "
                              "config before training, e.g. another env.options.reward (single-turn samples)")
    retrain.set_defaults(handler="reel.runtime.launch.retrain_cli:main")

    export = _command(sub, "export", "write a policy version as a Hugging Face model directory (transformers, vLLM)",
                      "reel export --run runs/reverse_text --out models/reverse_text",
                      "reel export --run runs/reverse_text --step 20 --out models/step20")
    export.add_argument("--run", required=True, dest="run_dir", help="run directory")
    export.add_argument("--step", type=int, default=None,
                        help="the policy after this step; 0 = the initial policy (default: the last committed step)")
    export.add_argument("--out", required=True, help="new directory to write (must not exist or be empty)")
    export.set_defaults(handler="reel.replay.export:main")


def _launch_commands(sub) -> None:
    """Commands for clusters and examples: launch, example."""
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

    example = _command(sub, "example", "the example configs shipped with Reel",
                       "reel example list", "reel example copy reverse_text")
    example_sub = example.add_subparsers(dest="example_command", required=True, metavar="COMMAND")
    listing = _command(example_sub, "list", "each example's name and what it does", "reel example list")
    listing.set_defaults(handler="reel.runtime.launch.examples:main_list")
    copy = _command(example_sub, "copy", "copy an example config, and any env package it needs, into DIR",
                    "reel example copy reverse_text", "reel example copy calc_tool my_runs")
    copy.add_argument("name", metavar="NAME", help="example name (see `reel example list`)")
    copy.add_argument("dir", nargs="?", default=".", metavar="DIR", help="directory to write into (made if missing)")
    copy.set_defaults(handler="reel.runtime.launch.examples:main_copy")
