"""How `reel simulate` results look: the comparison with a measured run, a rich table, a PNG.

Staleness histograms are compared by total-variation distance: half the L1 distance between the
two token distributions (0 = identical, 1 = disjoint).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
from rich.console import Group
from rich.table import Table

from reel.replay.simulate import Scenario, SimResult
from reel.replay.workload import Measured, Workload

__all__ = ["Row", "Comparison", "compare", "tv_distance", "view", "plot"]


class Row(msgspec.Struct, kw_only=True):
    """One simulated scenario; `measured` and `comparison` when a real run had this configuration."""

    label: str
    scenario: Scenario
    result: SimResult
    measured: Measured | None = None
    comparison: Comparison | None = None


class Comparison(msgspec.Struct, kw_only=True):
    wall_error: float  # (predicted - measured) / measured
    trainer_idle_error: float  # predicted - measured, in shares
    rollout_idle_error: float | None
    staleness_tv: float


def tv_distance(p: dict[int, int], q: dict[int, int]) -> float:
    total_p, total_q = sum(p.values()), sum(q.values())
    if not total_p or not total_q:
        return 0.0 if total_p == total_q else 1.0
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0) / total_p - q.get(k, 0) / total_q) for k in keys)


def compare(result: SimResult, measured: Measured) -> Comparison:
    rollout = None if measured.rollout_idle is None else result.rollout_idle - measured.rollout_idle
    return Comparison(wall_error=(result.wall_s - measured.wall_s) / measured.wall_s,
                      trainer_idle_error=result.trainer_idle - measured.trainer_idle, rollout_idle_error=rollout,
                      staleness_tv=tv_distance(result.staleness, measured.staleness))


def _mean_staleness(hist: dict[int, int]) -> float:
    tokens = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / tokens if tokens else 0.0


def _shares(hist: dict[int, int]) -> str:
    tokens = sum(hist.values()) or 1
    return " ".join(f"{k}:{v / tokens:.2f}" for k, v in sorted(hist.items()))


def caveats(workload: Workload, scenario: Scenario) -> list[str]:
    """What the calibration log cannot tell about this scenario, said instead of guessed."""
    found = []
    if workload.pipeline.async_level == 0 and scenario.pipeline.async_level > 0 and workload.split_in_step:
        found.append("calibrated on a synchronous log from before the mismatch role, where the trainer ran the "
                     "mismatch split inside its step and no token was of an older version: that split (one more "
                     "scoring pass over the batch per older version among its tokens; +35% to +94% trainer CPU per "
                     "token measured) never ran, so the simulated trainer is too fast in this asynchronous scenario "
                     "(logs since the mismatch role have its own events, which the simulation replays)")
    overlaps = workload.decode.shared_slowdown or workload.trainer.shared_slowdown
    if workload.pipeline.async_level == 0 and scenario.pipeline.async_level > 0 and not scenario.dedicated \
            and not overlaps and workload.cores is None:
        found.append("calibrated on a synchronous log without CPU times (written before Reel recorded them), "
                     "which never overlaps rollout and trainer: what sharing cores costs is unknown and "
                     "simulated as free, so the wall time is a lower bound; re-run the config with this Reel, "
                     "or calibrate on an asynchronous run of this machine")
    return found


def _ranks(rows: list[Row]) -> str:
    s = rows[0].scenario if rows else None
    if s is None or not s.rank_efficiency_source:
        return ""
    return f"; rank efficiency {s.rank_efficiency:.2f} ({s.rank_efficiency_source})"


def view(workload: Workload, rows: list[Row]) -> Group:
    d, t = workload.decode, workload.trainer
    shared = "" if not (d.shared_slowdown or t.shared_slowdown) else (
        f"; while sharing cores: decode x{1 + d.shared_slowdown:.2f}, trainer x{1 + t.shared_slowdown:.2f}")
    if (c := workload.cores) is not None:
        pools = (f"the trainer on {_cores(c.trainer_cores)} of its own ({c.trainer_background:.1f} other runnable "
                 f"threads), the workers on {_cores(c.cores)}" if c.apart else _cores(c.cores))
        shared += (f" (from CPU times: {pools}, {c.background:.1f} other runnable threads; the trainer used "
                   f"{c.trainer_rate:.2f} cores computing, a worker {c.worker_rate:.2f} decoding)")
    if (m := workload.split) is not None:
        shared += (f"; mismatch role: a split {1e3 * m.base_s:.0f} ms + {1e6 * m.pass_s_per_token:.1f} µs x tokens "
                   f"per scoring pass ({m.splits} splits)")
    calibration = (f"calibrated on {workload.run_dir}: decode step {1e3 * d.base_s:.2f} ms + "
                   f"{1e3 * d.per_seq_s:.3f} ms x sequences + {1e6 * d.per_prefill_token_s:.1f} µs x prefill "
                   f"tokens ({d.intervals} intervals{_around_engine(d.group_s)}); trainer compute "
                   f"{1e3 * t.base_s:.0f} ms + {1e6 * t.per_token_s:.1f} µs x tokens + {1e6 * t.per_position_s:.1f} µs x "
                   f"padded positions + {1e9 * t.per_score_s:.1f} ns x attention scores, publish "
                   f"{1e3 * t.publish_s:.0f} ms; swap {1e3 * workload.swap_s:.0f} ms{shared}; "
                   f"{len(workload.groups)} logged groups{_episodes(workload)}{_ranks(rows)}")
    notes = "".join(f"\nnote: {c}" for c in (caveats(workload, rows[0].scenario) if rows else []))
    table = Table(title=calibration + notes, title_justify="left")
    for column in ("scenario", "", "steps/h", "wall s", "trainer idle", "rollout idle", "staleness mean",
                   "staleness shares", "dropped", "redis busy", "bottleneck"):
        table.add_column(column, justify="right")
    for row in rows:
        r = row.result
        table.add_row(row.label, "simulated", f"{r.steps_per_hour:.0f}", f"{r.wall_s:.1f}", f"{r.trainer_idle:.1%}",
                      f"{r.rollout_idle:.1%}", f"{_mean_staleness(r.staleness):.2f}", _shares(r.staleness),
                      f"{r.dropped_share:.1%}", f"{r.redis_busy:.1%}", r.bottleneck)
        m, c = row.measured, row.comparison
        if m is None or c is None:
            continue
        table.add_row("", "measured", f"{m.steps_per_hour:.0f}", f"{m.wall_s:.1f}", f"{m.trainer_idle:.1%}",
                      "-" if m.rollout_idle is None else f"{m.rollout_idle:.1%}",
                      f"{_mean_staleness(m.staleness):.2f}", _shares(m.staleness), f"{m.dropped_share:.1%}", "", "")
        table.add_row("", "error", "", f"{c.wall_error:+.1%}", f"{c.trainer_idle_error:+.1%}",
                      "-" if c.rollout_idle_error is None else f"{c.rollout_idle_error:+.1%}", "",
                      f"TV {c.staleness_tv:.3f}", "", "", "", end_section=True)
    return Group(table)


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


def _around_engine(group_s: float) -> str:
    """A round's group's work around the engine, fitted apart from the decode steps (replay/workload.py)."""
    return f"; a round's group {1e3 * group_s:.1f} ms around the engine, not simulated" if group_s > 0 else ""


def _episodes(workload: Workload) -> str:
    """Model turns per episode, when the workload has multi-turn episodes."""
    turns = [(len(sample) + 1) // 2 for group in workload.groups for sample in group.samples]
    if max(turns) == 1:
        return ""
    # The env's answers between model turns (the last wait, after the final turn, scores it).
    waits = [w for group in workload.groups for sample in group.env_s for w in sample[:-1]]
    tools = f"; tool waits median {1e3 * float(np.median(waits)):.0f} ms, at most {max(waits):.2f} s" if waits else ""
    return f", {sum(turns) / len(turns):.2f} model turns per episode (at most {max(turns)}){tools}"


def plot(rows: list[Row], path: Path) -> None:
    """Steps/hour, idle shares and staleness per scenario (measured beside simulated where known)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(15.0, 1.2 * len(rows)), 4.8))
    ax_rate, ax_idle, ax_stale = fig.subplots(1, 3)
    ticks, axis_label = _ticks([row.label for row in rows])
    x = np.arange(len(rows))
    measured = [row.measured for row in rows]
    known = any(m is not None for m in measured)
    width = 0.4 if known else 0.8
    ax_rate.bar(x - 0.2 if known else x, [r.result.steps_per_hour for r in rows], width, label="simulated",
                color="tab:blue")
    if known:
        ax_rate.bar(x + 0.2, [m.steps_per_hour if m else 0 for m in measured], width, label="measured",
                    color="tab:gray")
    ax_rate.set(title="trainer steps per hour")
    ax_rate.legend(fontsize=8)
    for offset, key, color in ((-0.2, "trainer_idle", "tab:orange"), (0.2, "rollout_idle", "tab:green")):
        ax_idle.bar(x + offset, [getattr(r.result, key) for r in rows], 0.4, color=color,
                    label=f"{key.replace('_', ' ')} (simulated)")
        if known:
            ax_idle.plot(x + offset, [getattr(m, key) if m and getattr(m, key) is not None else np.nan
                                      for m in measured], "kx", label="measured" if key == "trainer_idle" else None)
    ax_idle.set(title="idle share of wall time", ylim=(0, 1))
    ax_idle.legend(fontsize=8)
    versions = sorted({k for row in rows for k in row.result.staleness})
    bottom = np.zeros(len(rows))
    for v in versions:
        share = np.array([row.result.staleness.get(v, 0) / (sum(row.result.staleness.values()) or 1) for row in rows])
        ax_stale.bar(x, share, 0.8, bottom=bottom, label=f"{v} behind")
        bottom += share
    ax_stale.set(title="staleness: share of trained tokens (simulated)", ylim=(0, 1))
    ax_stale.legend(fontsize=8)
    for ax in (ax_rate, ax_idle, ax_stale):
        ax.set_xticks(x, ticks, rotation=30 if len(rows) > 4 else 0, fontsize=8)
        ax.set_xlabel(axis_label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _ticks(labels: list[str]) -> tuple[list[str], str]:
    """Sweep labels "k1=a k2=b" become ticks "a, b" under an axis label "k1, k2"."""
    parts = [[item.partition("=") for item in label.split()] for label in labels]
    if all(len(p) == len(parts[0]) and all(sep for _, sep, _ in p) for p in parts):
        return [", ".join(v for _, _, v in p) for p in parts], ", ".join(k for k, _, _ in parts[0])
    return labels, ""
