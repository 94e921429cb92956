"""`reel metrics wandb|tensorboard|mlflow --run DIR [--follow]` and the `sink` role of `reel run`.

Without --follow a sink writes what the log and the live bus hold now and exits (a finished run is
backfilled whole); with --follow it stays until the run finishes. Where it writes comes from the
run's [metrics] section, overridden by the command's options.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
from pathlib import Path

import msgspec

from reel.consumers.metrics import locate
from reel.consumers.sinks.base import EXTRA, Sink
from reel.consumers.sinks.feed import Feed, run_meta
from reel.runtime.config import run as run_config
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.sections import MetricsSection

__all__ = ["check_available", "main", "make_sink", "role_main"]

# Sink -> the modules it imports (checked before `reel run` starts anything).
LIBRARIES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "mlflow": ("mlflow", "sqlalchemy"),
             "wandb": ("wandb",)}


def check_available(sinks: list[str]) -> None:
    """Every library the configured sinks need is installed, else one line naming the extra."""
    for sink in sinks:
        missing = [m for m in LIBRARIES[sink] if importlib.util.find_spec(m.split(".")[0]) is None]
        if missing:
            raise ConfigError(f"the {sink} sink needs {', '.join(missing)}; install it with "
                                         f"pip install 'reel-rl[{EXTRA}]' (or take {sink} out of metrics.sinks)")


def make_sink(name: str, run_dir: Path, run: str, section: MetricsSection) -> Sink:
    tracking = run_dir / "tracking"
    if name == "tensorboard":
        from reel.consumers.sinks.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(Path(section.tensorboard_dir) if section.tensorboard_dir else tracking / "tensorboard")
    if name == "mlflow":
        from reel.consumers.sinks.mlflow_sink import MlflowSink, default_uri

        return MlflowSink(section.mlflow_tracking_uri or default_uri(run_dir), section.mlflow_experiment, run,
                          tracking / "mlflow-artifacts")
    from reel.consumers.sinks.wandb_sink import WandbSink

    return WandbSink(Path(section.wandb_dir) if section.wandb_dir else tracking, section.wandb_project, run)


async def feed_run(name: str, run_dir: Path, bus: str | None, *, follow: bool,
                   overrides: dict[str, str] | None = None) -> int:
    """Write run_dir's run into sink `name`; returns the steps written."""
    source = await locate(str(run_dir), bus, None)
    section = msgspec.structs.replace(run_config.load(run_dir / "config.toml").metrics, **(overrides or {}))
    check_available([name])
    sink = make_sink(name, run_dir, source.run, section)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await Feed(sink, source, run_meta(source)).run(stop, follow=follow)
    finally:
        sink.close()


def main(args: argparse.Namespace) -> int:
    name = args.metrics_command
    options = {"tensorboard_dir": getattr(args, "out", None) if name == "tensorboard" else None,
               "wandb_dir": getattr(args, "out", None) if name == "wandb" else None,
               "mlflow_tracking_uri": getattr(args, "tracking_uri", None), "mlflow_experiment": getattr(args, "experiment", None),
               "wandb_project": getattr(args, "project", None)}
    steps = asyncio.run(feed_run(name, Path(args.run_dir), args.bus, follow=args.follow,
                                 overrides={key: value for key, value in options.items() if value}))
    print(f"reel: {name} sink wrote {steps} new steps of run {args.run_dir}")
    return 0


def role_main(run_dir: Path, url: str, name: str) -> int:
    """The `sink` role: follow the run on `url` until it finishes."""
    asyncio.run(feed_run(name, run_dir, url, follow=True))
    return 0
