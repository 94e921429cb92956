"""How `reel replay bisect` and `reel compare` look: rich tables and matplotlib PNGs.

Like report.py: matplotlib's object API (`Figure`, no pyplot), imported only to plot. KL figures
span 1e-13..1 and go on log axes of their own; signed or share figures get linear ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table

from reel.replay.bisect import BisectReport
from reel.replay.compare import Comparison
from reel.replay.report import num

CAUSE_COLORS = {"staleness": "tab:orange", "routing": "tab:purple", "numerics": "tab:blue", "tail": "tab:red"}
CAUSE_MEANING = {
    "staleness": "policy drift KL(π_v‖π_old), nats",
    "routing": "|KL without - with router replay|, nats",
    "numerics": "KL(μ‖π_v) at the sampling version's weights, nats",
    "tail": "share of tokens with π_old/μ outside [0.5, 2]",
}


def bisect_view(r: BisectReport) -> Group | str:
    if r.first_crossing is None:
        values = [(s, v) for s, v in r.logged if v is not None]
        s, v = (max if r.direction == "above" else min)(values, key=lambda sv: sv[1])
        extreme = "highest" if r.direction == "above" else "lowest"
        return (f"{r.metric} never goes {r.direction} {r.threshold:g} in steps {r.logged[0][0]}..{r.logged[-1][0]} "
                f"({extreme}: {v:.4g} at step {s})")
    head = (f"{r.metric} first {r.direction} {r.threshold:g} at step {r.first_crossing} (logged {r.value:.4g}); "
            f"re-executed steps {r.window[0].step}..{r.window[-1].step}")
    window = Table(title=head, title_justify="left")
    for column in ("step", r.metric, "bitwise", "KL k3", "staleness", "routing", "numerics", "tail", "ratio max",
                   "update KL", "mean versions behind"):
        window.add_column(column, justify="right")
    for w in r.window:
        mark = "[bold]" if w.step == r.first_crossing else ""
        window.add_row(f"{mark}{w.step}", num(w.logged, ".4g"), "[green]yes[/]" if w.bitwise else "[red]no[/]",
                       num(w.kl_k3), num(w.staleness), num(w.routing), num(w.numerics), num(w.tail, ".2%"),
                       num(w.ratio_max, ".3g"), num(w.update_k3), f"{w.staleness_mean:.2f}")
    causes = Table(title="causes at the crossing, most likely first (growth against the steps before it)",
                   title_justify="left")
    for column in ("rank", "cause", "at crossing", "before", "growth", "measured as"):
        causes.add_column(column, justify="left" if column in ("cause", "measured as") else "right")
    for rank, c in enumerate(r.causes, 1):
        fmt = ".2%" if c.name == "tail" else ".3e"
        causes.add_row(str(rank), c.name, num(c.at_crossing, fmt), num(c.baseline, fmt),
                       "-" if c.growth is None else f"x{c.growth:.3g}", CAUSE_MEANING[c.name])
    verdict = f"most likely cause: {r.causes[0].name}"
    if r.causes[0].name == "staleness" and r.culprit_update is not None:
        verdict += f", from the update of step {r.culprit_update} (the largest policy change before the crossing)"
    return Group(window, causes, verdict)


def plot_bisect(r: BisectReport, path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 8))
    ax_metric, ax_kl = fig.subplots(2, 1)
    steps = [s for s, _ in r.logged]
    values = np.array([np.nan if v is None else v for _, v in r.logged])
    ax_metric.plot(steps, values, marker=".", color="black", label=f"{r.metric} (logged)")
    ax_metric.axhline(r.threshold, color="tab:red", linestyle="--", label=f"threshold {r.threshold:g}")
    if np.nanmin(values) > 0 and np.nanmax(values) / np.nanmin(values) > 100:
        ax_metric.set_yscale("log")
    if r.first_crossing is not None:
        ax_metric.axvline(r.first_crossing, color="tab:red", linewidth=0.8)
        ax_metric.plot([r.first_crossing], [r.value], "o", color="tab:red", markersize=9, fillstyle="none",
                       label=f"first crossing: step {r.first_crossing}")
        ax_metric.axvspan(r.window[0].step - 0.5, r.window[-1].step + 0.5, color="0.9", label="re-executed")
    ax_metric.set(title=f"{r.metric}: first {r.direction} {r.threshold:g}", xlabel="step", ylabel=r.metric)
    ax_metric.legend(fontsize=8)
    ax_metric.xaxis.set_major_locator(MaxNLocator(integer=True))
    if r.window:
        _plot_causes(ax_kl, r)
    else:
        ax_kl.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_causes(ax, r: BisectReport) -> None:
    """KL causes stacked per step (nats), the ratio tail as a line on its own axis (share of tokens)."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    steps = np.array([w.step for w in r.window])
    bottom = np.zeros(len(steps))
    for name in ("staleness", "routing", "numerics"):
        height = np.array([getattr(w, name) or 0.0 for w in r.window])
        ax.bar(steps, height, bottom=bottom, color=CAUSE_COLORS[name], label=f"{name}: {CAUSE_MEANING[name]}")
        bottom += height
    ax.plot(steps, [w.kl_k3 for w in r.window], "k_", markersize=30, mew=2, label="KL(μ‖π_old) k3, run settings")
    ax.set(title="causes per re-executed step", xlabel="step", ylabel="KL k3 (nats per token)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    tail = ax.twinx()
    tail.plot(steps, [w.tail for w in r.window], "o--", color=CAUSE_COLORS["tail"],
              label=f"tail: {CAUSE_MEANING['tail']}")
    tail.set_ylabel("tokens outside [0.5, 2]")
    tail.yaxis.set_major_formatter(PercentFormatter(1.0))
    tail.set_ylim(bottom=0)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = tail.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")


def compare_view(c: Comparison) -> Table:
    first = "none: every common step has the same weights" if c.first_differing_step is None \
        else f"step {c.first_differing_step}"
    table = Table(title=f"{c.run_a} (A) vs {c.run_b} (B): first step with different weights: {first}",
                  title_justify="left")
    evaluated = any(row.a.eval_reward is not None or row.b.eval_reward is not None for row in c.steps)
    for column in ("step", "reward A", "reward B", *(("held-out A", "held-out B") if evaluated else ()),
                   "KL k3 A", "KL k3 B", "grad norm A", "grad norm B", "staleness A", "staleness B", "weights"):
        table.add_column(column, justify="right")
    for row in c.steps:
        a, b = row.a, row.b
        held_out = (num(a.eval_reward, ".3f"), num(b.eval_reward, ".3f")) if evaluated else ()
        table.add_row(str(row.step), num(a.reward, ".3f"), num(b.reward, ".3f"), *held_out, num(a.kl_k3), num(b.kl_k3),
                      num(a.grad_norm, ".4g"), num(b.grad_norm, ".4g"), num(a.staleness_mean, ".2f"),
                      num(b.staleness_mean, ".2f"), "[green]same[/]" if row.same_weights else "[red]differ[/]")
    return table


def plot_compare(c: Comparison, path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2, sharex=True)
    fig.suptitle(f"A = {c.run_a}   vs   B = {c.run_b}")
    steps = [row.step for row in c.steps]
    panels = [("reward", "reward (mean of the step's batch)", "linear"),
              ("kl_k3", "KL(μ‖π_old) k3, nats per token", "log"),
              ("grad_norm", "gradient norm (before clipping)", "linear"),
              ("staleness_mean", "staleness, mean versions behind", "linear")]
    for ax, (key, title, scale) in zip(axes.flat, panels):
        for side, style, color in (("a", "-", "tab:blue"), ("b", "--", "tab:orange")):
            values = [getattr(getattr(row, side), key) for row in c.steps]
            values = [np.nan if v is None or (scale == "log" and v <= 0) else v for v in values]
            ax.plot(steps, values, style, marker="o" if side == "a" else "x", color=color,
                    label=f"{side.upper()}: {c.run_a if side == 'a' else c.run_b}")
            held_out = [(row.step, getattr(row, side).eval_reward) for row in c.steps
                        if key == "reward" and getattr(row, side).eval_reward is not None]
            if held_out:
                ax.plot(*zip(*held_out), ":", marker="s", color=color, label=f"{side.upper()}: held-out (eval role)")
        if scale == "log":
            ax.set_yscale("log")
        if c.first_differing_step is not None:
            ax.axvline(c.first_differing_step, color="tab:red", linewidth=0.8, linestyle=":",
                       label=f"weights first differ: step {c.first_differing_step}")
        ax.set(title=title, ylabel=title.split(",")[0] if "," in title else key)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
