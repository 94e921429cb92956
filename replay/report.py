"""How replay results look: rich tables for the terminal and matplotlib PNGs.

Figures are built with matplotlib's object API (`Figure`, no pyplot): PNGs render through the Agg
canvas and no global backend or window is ever touched. matplotlib is imported only to plot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table

from reel.replay.analysis import RangeRow, StepReport
from reel.replay.batch_analysis import KL, BatchAnalysis


def num(x: float | None, fmt: str = ".3e") -> str:
    return "-" if x is None else format(x, fmt)


def _same(a: float, b: float) -> str:
    return "[green]=[/]" if a == b else f"[red]differs by {a - b:+.3e}[/]"


def step_view(r: StepReport) -> Group:
    verdict = "[green]bitwise[/]" if r.bitwise else f"[red]NOT bitwise[/]: {r.mismatch}"
    check = Table(title=f"replay of step {r.step}: {verdict}", title_justify="left")
    for column in ("", "replayed", "logged", ""):
        check.add_column(column, justify="right")
    check.add_row("loss", f"{r.loss:.9g}", f"{r.logged_loss:.9g}", _same(r.loss, r.logged_loss))
    check.add_row("grad norm", f"{r.grad_norm:.9g}", f"{r.logged_grad_norm:.9g}",
                  _same(r.grad_norm, r.logged_grad_norm))
    check.add_row("weights sha256", "", "", "[green]=[/]" if r.weights_sha256_match else "[red]differs[/]")
    check.add_row("trainer ranks", str(r.ranks), str(r.recorded_ranks), "[green]=[/]" if r.ranks == r.recorded_ranks
                  else f"max |Δweight| {num(r.max_weight_diff)}")
    check.add_row("compute seconds", f"{r.replay_seconds:.3f}", f"{r.original_seconds:.3f}",
                  f"x{r.replay_seconds / r.original_seconds:.2f}" if r.original_seconds > 0 else "")
    restored = "the initial policy" if r.restored_from == 0 else f"the checkpoint of step {r.restored_from}"
    check.add_row("steps re-executed", str(r.reexecuted_steps), "", f"from {restored}, hash-checked")
    where = {"event": "MismatchSplit", "metrics": "in StepCommitted", "": "not logged"}[r.split_logged]
    check.add_row("mismatch split", "recomputed", where, "" if r.split_equal is None
                  else "[green]=[/]" if r.split_equal else "[red]differs[/]")

    kl = Table(title=f"inference vs trainer on step {r.step}'s {r.tokens} tokens (π_old from {restored}; "
                     f"router_replay={str(r.router_replay).lower()}, precision={r.precision})", title_justify="left")
    kl.add_column("KL(μ‖π_old)")
    variants: list[tuple[str, KL | None]] = [
        ("run settings", r.kl), ("without router replay", r.kl_without_router_replay),
        ("without fp8 alignment (bf16)", r.kl_without_fp8_alignment),
        ("numerics: KL(μ‖π_v), v = sampling version", r.kl_numerics),
        ("numerics without router replay", r.kl_numerics_without_router_replay),
        ("numerics without fp8 alignment", r.kl_numerics_without_fp8_alignment), ("drift: KL(π_v‖π_old)", r.kl_drift)]
    for name, _ in variants:
        kl.add_column(name, justify="right")
    for key in ("k1", "k2", "k3"):
        kl.add_row(key, *(num(getattr(v, key)) if v is not None else "-" for _, v in variants))

    ratio = Table(title="importance ratio π_old/μ", title_justify="left")
    for column in ("mean", "min", "max", "outside [0.5, 2]"):
        ratio.add_column(column, justify="right")
    ratio.add_row(f"{r.ratio.mean:.5f}", f"{r.ratio.min:.5f}", f"{r.ratio.max:.5f}", f"{r.ratio.frac_outside:.2%}")

    stale = Table(title="staleness", title_justify="left")
    stale.add_column("versions behind", justify="right")
    stale.add_column("tokens", justify="right")
    for behind, count in sorted(r.staleness.items()):
        stale.add_row(str(behind), str(count))

    routing = Table(title="router agreement (trainer's own top-k set = logged)", title_justify="left")
    routing.add_column("MoE layer", justify="right")
    routing.add_column("agreement", justify="right")
    for layer, share in enumerate(r.router_agreement):
        routing.add_row(str(layer), f"{share:.2%}")
    if not r.router_agreement:
        routing.add_row("-", "no routing logged")
    return Group(check, kl, ratio, stale, routing)


def range_view(rows: list[RangeRow]) -> Table:
    recomputed = any(row.recomputed is not None for row in rows)
    table = Table(title=f"steps {rows[0].step}..{rows[-1].step} (logged{' and recomputed' if recomputed else ''})",
                  title_justify="left")
    columns = ["step", "loss", "reward", "k1", "k2", "k3", "numerics k3", "drift k3", "ratio mean", "ratio min",
               "ratio max", "outside", "staleness"]
    if recomputed:
        columns += ["bitwise", "k3 recomputed", "k3 w/o R3", "k3 w/o fp8", "numerics k3 w/o R3", "router agr."]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        kl, ratio = row.kl, row.ratio
        cells = [str(row.step), f"{row.loss:.4f}", num(row.reward_mean, ".3f"),
                 *(num(getattr(kl, k)) if kl else "-" for k in ("k1", "k2", "k3")),
                 *(num(split.k3) if split else "-" for split in (row.kl_numerics, row.kl_drift)),
                 *(num(getattr(ratio, k), ".4f") if ratio else "-" for k in ("mean", "min", "max")),
                 num(ratio.frac_outside, ".2%") if ratio else "-", f"{row.staleness_mean:.2f}"]
        if recomputed:
            rc = row.recomputed
            assert rc is not None
            fp8 = rc.kl_without_fp8_alignment
            cells += ["[green]yes[/]" if rc.bitwise else "[red]no[/]", num(rc.kl.k3),
                      num(rc.kl_without_router_replay.k3), num(fp8.k3) if fp8 else "-",
                      num(rc.kl_numerics_without_router_replay.k3) if rc.kl_numerics_without_router_replay else "-",
                      num(rc.router_agreement_mean, ".2%")]
        table.add_row(*cells)
    return table


def plot_step(r: StepReport, analysis: BatchAnalysis, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    ax_ratio, ax_stale, ax_route = fig.subplots(1, 3)
    fig.suptitle(f"step {r.step}: {'bitwise' if r.bitwise else 'NOT bitwise'}, KL k3 {r.kl.k3:.2e} "
                 f"(without router replay {r.kl_without_router_replay.k3:.2e})")
    log_ratio = analysis.log_ratio_N
    ax_ratio.hist(log_ratio, bins=min(60, max(10, log_ratio.size // 4)), color="tab:blue")
    ax_ratio.set_yscale("log")
    ax_ratio.axvline(0.0, color="black", linewidth=0.8)
    ax_ratio.set(title=f"log π_old/μ per token ({r.tokens} tokens)", xlabel="log ratio", ylabel="tokens")
    behind = sorted(r.staleness)
    ax_stale.bar([str(b) for b in behind], [r.staleness[b] for b in behind], color="tab:orange")
    ax_stale.set(title="staleness", xlabel="versions behind", ylabel="tokens")
    layers = np.arange(len(r.router_agreement))
    ax_route.bar(layers, r.router_agreement, color="tab:green")
    ax_route.set(title="router agreement (own top-k set = logged)", xlabel="MoE layer", ylabel="share of tokens",
                 ylim=(min([0.9, *r.router_agreement]) - 0.02, 1.005), xticks=layers)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_range(rows: list[RangeRow], path: Path) -> None:
    """KL k2/k3 on a log axis of their own (they span 1e-13..1), the signed k1 on a linear one."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [row.step for row in rows]
    fig = Figure(figsize=(13, 11))
    (ax_kl, ax_k1), (ax_ratio, ax_split), (ax_stale, ax_reward) = fig.subplots(3, 2, sharex=True)
    fig.suptitle(f"steps {steps[0]}..{steps[-1]}: inference μ vs trainer π_old")

    def positive(values: list[float | None]) -> list[float]:  # a log axis has no place for 0
        return [v if v is not None and v > 0 else np.nan for v in values]

    for key, color, marker in (("k2", "tab:orange", "s"), ("k3", "tab:green", "o")):
        ax_kl.plot(steps, positive([getattr(r.kl, key) if r.kl else None for r in rows]), marker=marker,
                   markersize=4, color=color, label=f"{key} logged")
    recomputed = [r for r in rows if r.recomputed is not None]
    if recomputed:
        ax_kl.plot([r.step for r in recomputed], positive([r.recomputed.kl.k3 for r in recomputed]), "x",
                   color="black", label="k3 recomputed")
        ax_kl.plot([r.step for r in recomputed],
                   positive([r.recomputed.kl_without_router_replay.k3 for r in recomputed]), "--",
                   color="tab:red", label="k3 without router replay")
    ax_kl.set_yscale("log")
    ax_kl.set(title="KL(μ‖π_old), k2 and k3", ylabel="nats per token")
    ax_kl.legend(fontsize=8)

    ax_k1.plot(steps, [r.kl.k1 if r.kl else np.nan for r in rows], marker=".", color="tab:blue", label="k1 logged")
    ax_k1.axhline(0.0, color="black", linewidth=0.8)
    ax_k1.set(title="KL(μ‖π_old), k1 (unbiased, signed)", ylabel="nats per token")
    ax_k1.legend(fontsize=8)

    for key, style, marker in (("mean", "-", "o"), ("min", ":", "v"), ("max", "--", "^")):
        ax_ratio.plot(steps, [getattr(r.ratio, key) if r.ratio else np.nan for r in rows], style, marker=marker,
                      markersize=4, color="tab:blue", label=key)
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.set_yscale("log")
    ax_ratio.set(title="importance ratio π_old/μ over the step's tokens", ylabel="ratio (log scale)")
    ax_ratio.legend(fontsize=8)

    split = [(r.step, r.kl_numerics, r.kl_drift) for r in rows if r.kl_numerics is not None]
    if split:
        ax_split.plot([s for s, _, _ in split], positive([n.k3 for _, n, _ in split]), marker="o", markersize=4,
                      color="tab:blue", label="numerics: KL(μ‖π_v), sampling version's weights")
        ax_split.plot([s for s, _, _ in split], positive([d.k3 if d else None for _, _, d in split]), "--",
                      marker="^", markersize=4, color="tab:orange", label="drift: KL(π_v‖π_old), staleness")
        ax_split.set_yscale("log")
        ax_split.legend(fontsize=8)
    else:
        ax_split.text(0.5, 0.5, "no mismatch split logged", ha="center", va="center", transform=ax_split.transAxes)
    ax_split.set(title="mismatch split, k3", ylabel="nats per token")

    ax_stale.plot(steps, [r.staleness_mean for r in rows], marker=".", color="tab:orange")
    ax_stale.set(title="mean staleness", xlabel="step", ylabel="versions behind")
    ax_reward.plot(steps, [r.reward_mean if r.reward_mean is not None else np.nan for r in rows], marker=".",
                   color="tab:green")
    ax_reward.set(title="reward (mean of the step's batch)", xlabel="step", ylabel="reward")
    ax_reward.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by all
    fig.tight_layout()
    fig.savefig(path, dpi=100)
