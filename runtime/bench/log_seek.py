"""`reel bench log-seek`: open a run's log and locate one step's inputs, at 10^3 .. 10^6 events.

Each log is written with the project's own writer (bus/log.py RunLog, group commits as the archiver
makes them) and indexed as the archiver indexes it (bus/logindex.py). Then a fresh process opens the
index and reads step N's StepCommitted and each of its groups' Trajectory and RoutingTrace, decoded,
N in the middle of the log: the time (best of 5) and the process's peak RSS (VmHWM: imports
included). ratio = t(10^3) / t(10^6): 1 when seeking costs the same at every size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from reel.bus.events import RoutingTrace, Sample, StepCommitted, StepTiming, Tensor, Trajectory, encode
from reel.bus.jsonout import print_json
from reel.bus.run_log import RunLog
from reel.bus.logindex import LogIndex

GROUPS_PER_STEP = 8  # a step's events: 8 trajectories, 8 routing traces, 1 commit
_BATCH = 4096  # records per group commit

_LOCATE = """
import sys, time
from pathlib import Path
from reel.bus.events import decode
from reel.bus.run_log import RunLog
from reel.bus.logindex import LogIndex

run_dir, step = Path(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(5):
    started = time.perf_counter()
    with LogIndex(RunLog(run_dir, readonly=True), run_dir) as index:
        index.sync()
        commit = decode(index.commit(step).data)
        groups = [(decode(index.group("trajectories", g).data), decode(index.group("routing", g).data))
                  for g in commit.groups]
    times.append(time.perf_counter() - started)
    assert len(groups) == len(commit.groups) and groups[0][0].group_id == commit.groups[0]
# VmHWM, not ru_maxrss: that survives exec, so it would hold the bench's own peak from before the fork.
peak_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(min(times), peak_kb * 1024)
"""


class Size(msgspec.Struct):
    events: int
    steps: int
    log_bytes: int
    write_s: float
    index_s: float
    locate_s: float
    peak_rss_bytes: int


def run(args: argparse.Namespace) -> int:
    counts = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000, 1_000_000)
    sizes = []
    with tempfile.TemporaryDirectory(prefix="reel-bench-seek-", dir=os.environ.get("REEL_BENCH_DIR")) as tmp:
        for n in counts:
            sizes.append(_measure(Path(tmp) / f"log{n}", n))
    first, last = sizes[0], sizes[-1]
    print_json({"bench": "log-seek", "sizes": sizes, "ratio": round(first.locate_s / last.locate_s, 3),
                "rss_ratio": round(last.peak_rss_bytes / first.peak_rss_bytes, 3)})
    return 0


def _measure(run_dir: Path, events: int) -> Size:
    steps = max(1, events // (2 * GROUPS_PER_STEP + 1))
    started = time.perf_counter()
    _write(run_dir, steps)
    written = time.perf_counter()
    with LogIndex(RunLog(run_dir, readonly=True), run_dir) as index:
        index.sync()
    indexed = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _LOCATE, str(run_dir), str(steps // 2 + 1)], check=True,
                         capture_output=True, text=True).stdout.split()
    log_bytes = sum(p.stat().st_size for p in (run_dir / "log").rglob("*.seg"))
    return Size(events=steps * (2 * GROUPS_PER_STEP + 1), steps=steps, log_bytes=log_bytes,
                write_s=round(written - started, 3), index_s=round(indexed - written, 3),
                locate_s=float(out[0]), peak_rss_bytes=int(out[1]))


def _write(run_dir: Path, steps: int) -> None:
    """A run's trajectories, routing and steps streams, as the archiver would have logged them."""
    rng = np.random.default_rng(0)
    tokens = Tensor.from_numpy(rng.integers(0, 32_000, 16, dtype=np.int32))
    logprobs = Tensor.from_numpy(-rng.random(16, dtype=np.float32))
    experts = Tensor.from_numpy(rng.integers(0, 8, (24, 2, 2), dtype=np.uint8))
    prompt = Tensor.from_numpy(rng.integers(0, 32_000, 8, dtype=np.int32))
    pending: dict[str, list[tuple[str, bytes]]] = {"trajectories": [], "routing": [], "steps": []}
    seq = 0
    with RunLog(run_dir) as run_log:
        for step in range(1, steps + 1):
            groups = [f"g{step}-{i}" for i in range(GROUPS_PER_STEP)]
            for g in groups:
                sample = Sample(tokens=tokens, logprobs=logprobs, reward=1.0, finish_reason="stop", seed=seq,
                                spans=[(0, step - 1)])
                pending["trajectories"].append((f"{seq + 1}-0", encode(Trajectory(
                    run="bench", producer="rollout:0", seq=seq, group_id=g, env="reverse_text", worker="rollout:0",
                    prompt=prompt, samples=[sample]))))
                pending["routing"].append((f"{seq + 2}-0", encode(RoutingTrace(
                    run="bench", producer="rollout:0", seq=seq + 1, group_id=g, experts=[experts]))))
                seq += 2
            pending["steps"].append((f"{seq + 1}-0", encode(StepCommitted(
                run="bench", producer="trainer:0", seq=seq, step=step, version=step, groups=groups, dropped=[],
                loss=0.0, grad_norm=0.0, weights_sha256="0" * 64, timing=StepTiming(0.0, 0.0, 0.0)))))
            seq += 1
            for stream, records in pending.items():
                if len(records) >= _BATCH or step == steps:
                    run_log.stream(stream).append_batch(records)
                    records.clear()
