"""What a step's result depends on besides config and code: the trainer's layout and its libraries.

The config hash leaves trainer.ranks, expert_parallel and context_parallel out (a replay on another
layout is a deviation to measure, not another config), and the code version hashes Reel's files
only. Both are recorded in RunStarted and every StepCommitted, so a replay that does not reproduce
names each one that changed instead of blaming the machine.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

import torch

from reel.bus.events import StepCommitted
from reel.runtime.config.sections import Config

LAYOUT_KEYS = ("ranks", "expert_parallel", "context_parallel")  # of [trainer]


def layout(config: Config) -> dict[str, int]:
    return {key: getattr(config.trainer, key) for key in LAYOUT_KEYS}


@functools.cache  # fixed for the life of a process; the metadata lookup scans sys.path
def library_versions() -> dict[str, str]:
    """torch, CUDA, NCCL and vLLM versions here ("" = absent); vLLM is looked up, not imported."""
    nccl = ""
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = ""
    try:
        vllm = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm = ""
    return {"torch": str(torch.__version__), "cuda": torch.version.cuda or "", "nccl": nccl, "vllm": vllm}


def cpu_count() -> int:
    """Cores this process may run on (its affinity), what the simulator shares among roles."""
    return len(cpus())


def nice() -> int:
    """This process's CPU priority (0 default, 19 lowest): the share of a contended core it gets (the simulator)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def cpus() -> list[int]:
    """Which cores this process may run on (its affinity): roles pinned apart share none (the simulator)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def differences(commit: StepCommitted, config: Config) -> list[str]:
    """Each recorded layout key and library version that differs here, as "what: then -> now"."""
    found = [f"trainer.{key} {then} at the commit, {now} here"
             for key, then in commit.layout.items() if (now := layout(config).get(key, then)) != then]
    here = library_versions()
    found += [f"{name} {then or 'absent'} at the commit, {here[name] or 'absent'} here"
              for name, then in commit.libraries.items() if name in here and here[name] != then]
    return found
