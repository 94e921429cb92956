"""Version 0 of a run's policy: `[init] from = DIR`, model.path's checkpoint as it is, or a
supervised warm-start on the task (from random weights, or from model.path when asked).

Either way it ends up in `RUN_DIR/init/` (HF layout: config.json + model.safetensors), written once
by whichever role gets there first (atomic rename), so every node and every later replay starts
from the same bytes. The warm-start itself needs the task's environment, which lives on the
rollout side: the caller passes it in (`WarmStart`; the shell hands the trainer
producers/warmstart.py's), since runtime/ never imports producers/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from reel.bus.errors import ReelError
from reel.runtime.config.sections import Config
from reel.runtime.config.run import warmup_steps
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import contained, load, save, shard_files
from reel.runtime.work_progress import PROGRESS_FILE, reporting_to

# A supervised warm-start: config -> (version-0 model, its mean sampled reward). It needs the envs and the
# engine, so the shell passes producers/warmstart.py's `warm_start` in (runtime/launch/roles.py).
WarmStart = Callable[[Config], tuple[MoEModel, float]]
INFO_FILE = "init.json"  # beside the weights: where they came from and, for a warm-start, its reward


class InitError(ReelError):
    """The initial policy cannot be produced as configured."""


def init_dir(run_dir: Path) -> Path:
    return run_dir / "init"


def ensure_initial_policy(run_dir: Path, config: Config, warm_start: WarmStart) -> Path:
    """RUN_DIR/init with version-0 weights, creating it if this is the first role to ask (with
    `warm_start` when the config asks for one)."""
    target = init_dir(run_dir)
    if (target / "config.json").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".init.", dir=run_dir))
    try:
        if config.init.from_dir:
            source = Path(config.init.from_dir)
            if not (source / "config.json").is_file():
                raise InitError(f"init.from = {str(source)!r} has no config.json; point it at an HF-layout model directory")
            save(load(source), staging)
            info = {"source": str(source.resolve())}
        elif config.model.path and warmup_steps(config) == 0:
            link_checkpoint(Path(config.model.path), staging)
            info = {"source": str(Path(config.model.path).resolve())}
        else:
            with reporting_to(run_dir / "roles" / PROGRESS_FILE):  # the launcher shows it (runtime/work_progress.py)
                model, reward = warm_start(config)
            save(model, staging)
            info = {"source": "warm-start", "warmup_steps": warmup_steps(config), "reward_mean": reward}
        (staging / INFO_FILE).write_text(json.dumps(info))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def link_checkpoint(source: Path, target: Path) -> None:
    """config.json, the shard index and the shards of `source` into `target`: hard links where the
    filesystem allows (a real checkpoint is big), else copies. Their bytes are version 0."""
    files = [source / "config.json", *shard_files(source)]  # every name checked before anything is linked
    if (source / "model.safetensors.index.json").is_file():
        files.append(source / "model.safetensors.index.json")
    for f in files:
        contained(source, f)
    for f in files:
        try:  # the file itself, not a cache's symlink to it: init/ holds regular files only
            os.link(f.resolve(), target / f.name)
        except OSError:
            shutil.copyfile(f, target / f.name)


def initial_reward(run_dir: Path) -> float | None:
    """Mean sampled reward of the warm-start (None for `[init] from` weights)."""
    try:
        return json.loads((init_dir(run_dir) / INFO_FILE).read_text()).get("reward_mean")
    except FileNotFoundError:
        return None


def load_initial_model(run_dir: Path) -> MoEModel:
    target = init_dir(run_dir)
    if not (target / "config.json").is_file():
        raise InitError(f"{run_dir} has no initial policy yet ({target} is missing); start the trainer first")
    return load(target)


# The files whose code decides a training step's result.
STEP_CODE = ("batch.py", "train_step.py", "loss.py", "checkpoint.py", "model/*.py")


def code_version() -> str:
    """Hash of the code that decides a training step's result, for replay diagnostics."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for pattern in STEP_CODE for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
