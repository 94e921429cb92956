"""Where a run's wall time went: the trainer's phases and each rollout worker's engine, on one time axis.

    trainer    per step, from its StepTiming, in the order they ran: commit (the previous step's
               commit protocol), wait (for a batch), score_old, forward_backward, optimizer, other
               (the rest of compute: batch assembly, the weight digest), publish; a step ends where
               its StepCommitted entry was added to the bus (the entry id's millisecond)
    worker W   per interval between two of its WorkerStats, the deltas of busy_s (engine decoding),
               tool_wait_s (idle while an episode waits on its env) and idle_s (idle, nothing
               waiting), drawn in that order within the interval; in logs without tool_wait_s and
               idle_s the time not busy is drawn as idle

Idle is grey everywhere, so where the pipeline waits shows at a glance. `segments` is the data
(what the tests check: a step's segments are contiguous and add up to its wall time); `svg` draws
it for the HTML report (`reel report`) and `png` for a file.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

import msgspec

from reel.bus.events import StepCommitted, WorkerStats

__all__ = ["Segment", "TRAINER_PHASES", "WORKER_PHASES", "segments", "step_phases", "svg", "png"]

# Drawing order within a trainer step; "other" = compute - score_old - forward_backward - optimizer.
TRAINER_PHASES = ("commit", "wait", "score_old", "forward_backward", "optimizer", "other", "publish")
WORKER_PHASES = ("busy", "tool_wait", "idle")
IDLE = "#c8c8c8"
COLORS = {"commit": "#8c564b", "wait": IDLE, "score_old": "#17becf", "forward_backward": "#1f77b4",
          "optimizer": "#9467bd", "other": "#aec7e8", "publish": "#ff7f0e", "busy": "#2ca02c",
          "tool_wait": "#d62728", "idle": IDLE}


class Segment(msgspec.Struct, frozen=True):
    lane: str  # "trainer" or a worker's name
    phase: str  # TRAINER_PHASES or WORKER_PHASES
    start: float  # seconds on the bus clock (Unix)
    end: float
    step: int = 0  # the trainer step (0 for worker segments)


def step_phases(s: StepCommitted) -> dict[str, float]:
    """The step's wall seconds by TRAINER_PHASES (zeros where the log did not record a phase)."""
    t = s.timing
    inner = t.score_old + t.forward_backward + t.optimizer
    return {"commit": t.commit, "wait": t.wait, "score_old": t.score_old, "forward_backward": t.forward_backward,
            "optimizer": t.optimizer, "other": max(0.0, t.compute - inner), "publish": t.publish}


def segments(commits: list[tuple[str, StepCommitted]], stats: list[tuple[str, WorkerStats]]) -> list[Segment]:
    """(entry id, event) pairs of the steps and control streams, as the log holds them -> timeline segments."""
    out = []
    for entry_id, s in commits:
        end = _seconds(entry_id)
        phases = step_phases(s)
        start = end - sum(phases.values())
        for phase in TRAINER_PHASES:
            out.append(Segment("trainer", phase, start, start + phases[phase], s.step))
            start += phases[phase]
    last: dict[str, tuple[float, WorkerStats]] = {}
    for entry_id, w in stats:
        at = _seconds(entry_id)
        if w.worker in last:
            before_at, before = last[w.worker]
            out += _worker_interval(w.worker, before_at, at, before, w)
        last[w.worker] = (at, w)
    return out


def _worker_interval(worker: str, t0: float, t1: float, a: WorkerStats, b: WorkerStats) -> list[Segment]:
    busy = max(0.0, b.busy_s - a.busy_s)
    if b.tool_wait_s or b.idle_s:
        tool, idle = max(0.0, b.tool_wait_s - a.tool_wait_s), max(0.0, b.idle_s - a.idle_s)
    else:  # not recorded: whatever was not decoding counts as idle
        tool, idle = 0.0, max(0.0, (t1 - t0) - busy)
    total = busy + tool + idle
    scale = (t1 - t0) / total if total > 0 else 0.0  # the counters' seconds onto the bus clock's interval
    out, start = [], t0
    for phase, seconds in zip(WORKER_PHASES, (busy, tool, idle)):
        out.append(Segment(worker, phase, start, start + seconds * scale))
        start += seconds * scale
    return out


def _seconds(entry_id: str) -> float:
    return int(entry_id.split("-")[0]) / 1000


def svg(segs: list[Segment], width: int = 1280) -> str:
    """The timeline as one inline <svg class="chart">: a row per lane, time on x."""
    drawn = [s for s in segs if s.end > s.start]
    if not drawn:
        return ""
    lanes = ["trainer", *sorted({s.lane for s in drawn} - {"trainer"})]
    t0, t1 = min(s.start for s in drawn), max(s.end for s in drawn)
    left, row, top = 110, 26, 28
    height = top + row * len(lanes) + 46
    scale = (width - left - 16) / max(t1 - t0, 1e-9)
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>timeline</title>',
             f'<text x="{left}" y="16" class="title">where the wall time went (grey: idle)</text>',
             '<g class="series">']
    for i, lane in enumerate(lanes):
        y = top + i * row
        parts.append(f'<text x="{left - 6}" y="{y + 16}" class="tick" text-anchor="end">{escape(lane)}</text>')
        for s in (s for s in drawn if s.lane == lane):
            x = left + (s.start - t0) * scale
            what = f"step {s.step} {s.phase}" if s.lane == "trainer" else f"{s.lane} {s.phase}"
            parts.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{max((s.end - s.start) * scale, 0.3):.2f}" '
                         f'height="{row - 6}" fill="{COLORS[s.phase]}"><title>{escape(what)}: '
                         f'{s.end - s.start:.3f} s</title></rect>')
    parts.append("</g>")
    axis_y = top + row * len(lanes) + 12
    parts.append(f'<text x="{left}" y="{axis_y}" class="tick">0 s</text>'
                 f'<text x="{width - 16}" y="{axis_y}" class="tick" text-anchor="end">{t1 - t0:.1f} s</text>')
    x = left
    for phase in (*TRAINER_PHASES, "busy", "tool_wait"):
        parts.append(f'<rect x="{x}" y="{axis_y + 12}" width="10" height="10" fill="{COLORS[phase]}"/>'
                     f'<text x="{x + 14}" y="{axis_y + 21}" class="tick">{phase}</text>')
        x += 24 + 7 * len(phase)
    parts.append("</svg>")
    return "".join(parts)


def png(segs: list[Segment], path: Path) -> None:
    """The same timeline as a PNG (matplotlib's object API, no pyplot)."""
    from matplotlib.figure import Figure

    drawn = [s for s in segs if s.end > s.start]
    lanes = ["trainer", *sorted({s.lane for s in drawn} - {"trainer"})]
    t0 = min((s.start for s in drawn), default=0.0)
    fig = Figure(figsize=(14, 1.2 + 0.5 * len(lanes)))
    ax = fig.subplots()
    for i, lane in enumerate(lanes):
        for phase in (*TRAINER_PHASES, *WORKER_PHASES):
            bars = [(s.start - t0, s.end - s.start) for s in drawn if s.lane == lane and s.phase == phase]
            if bars:
                ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=COLORS[phase], label=phase)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set(xlabel="seconds", title="where the wall time went (grey: idle)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), ncol=len(unique), fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
