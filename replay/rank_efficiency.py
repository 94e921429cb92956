"""Where `reel simulate` gets its trainer rank efficiency, said with the figure.

N ranks are modelled as N x efficiency times one process's throughput. The efficiency is given
(--rank-efficiency), fitted (--rank-efficiency-from) from a `reel bench fsdp` line (the same model
and batches on 1 process and on 2 ranks, efficiency = 1-process s/step / (2 x 2-rank s/step)) or
from two run logs of the same config on 1 rank and on N (efficiency = 1-rank compute seconds per
token / (N x N-rank compute seconds per token), over steps 2..N of each), or assumed (0.9, a guess,
and said to be one).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from reel.bus.errors import ReelError
from reel.bus.events import StepCommitted
from reel.bus.log import LogError
from reel.bus.run_log import RunLog

ASSUMED = 0.9


class RankEfficiency(msgspec.Struct, frozen=True):
    value: float
    source: str  # one phrase: where `value` came from


class RankEfficiencyError(ReelError):
    """A --rank-efficiency-from that is neither a `reel bench fsdp` line nor a 1-rank and an N-rank run."""


class _FsdpBench(msgspec.Struct):
    one_rank_step_s: float
    two_rank_step_s: float


class _RunSpeed(msgspec.Struct, frozen=True):
    path: Path
    ranks: int
    s_per_token: float  # trainer compute seconds per batch token, steps 2..N


def rank_efficiency(given: float | None, sources: list[str] | None) -> RankEfficiency:
    if given is not None:
        return RankEfficiency(given, "given (--rank-efficiency)")
    if not sources:
        return RankEfficiency(ASSUMED, "assumed, not measured (fit it: --rank-efficiency-from a "
                                       "`reel bench fsdp` line, or a 1-rank and an N-rank run)")
    if len(sources) == 1:
        return _from_bench(Path(sources[0]))
    if len(sources) == 2:
        return _from_runs(*sorted((_run_speed(Path(s)) for s in sources), key=lambda r: r.ranks))
    raise RankEfficiencyError(f"--rank-efficiency-from takes one `reel bench fsdp` file or two run directories "
                              f"(1 rank and N), not {len(sources)} paths")


def _from_bench(path: Path) -> RankEfficiency:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        bench = msgspec.json.decode(lines[-1], type=_FsdpBench)
    except (OSError, IndexError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RankEfficiencyError(f"--rank-efficiency-from {path}: not a `reel bench fsdp` JSON line ({exc})") from exc
    value = min(1.0, bench.one_rank_step_s / (2 * bench.two_rank_step_s))
    return RankEfficiency(value, f"fitted from {path}: 1 process {bench.one_rank_step_s:.3f} s/step, "
                                 f"2 ranks {bench.two_rank_step_s:.3f} s/step")


def _from_runs(one: _RunSpeed, many: _RunSpeed) -> RankEfficiency:
    if one.ranks != 1 or many.ranks < 2:
        raise RankEfficiencyError(f"--rank-efficiency-from {one.path} {many.path}: the runs were trained on "
                                  f"{one.ranks} and {many.ranks} ranks; pass a 1-rank run and one on 2 or more")
    value = min(1.0, one.s_per_token / (many.ranks * many.s_per_token))
    return RankEfficiency(value, f"fitted from the run logs {one.path} (1 rank, {1e6 * one.s_per_token:.1f} µs "
                                 f"compute/token) and {many.path} ({many.ranks} ranks, "
                                 f"{1e6 * many.s_per_token:.1f} µs compute/token)")


def _run_speed(path: Path) -> _RunSpeed:
    try:
        with RunLog(path, readonly=True) as log:
            commits = [e for _, e in log.events("steps") if isinstance(e, StepCommitted)] \
                if "steps" in log.names() else []
    except LogError as exc:
        raise RankEfficiencyError(f"--rank-efficiency-from {path}: cannot read its log ({exc})") from exc
    timed = commits[1:]  # step 1 pays one-off warm-ups
    tokens = sum(e.metrics.get("tokens", 0.0) for e in timed)
    if len(timed) < 2 or not tokens:
        raise RankEfficiencyError(f"--rank-efficiency-from {path}: the log needs at least 3 committed steps with "
                                  "token counts to time the trainer")
    ranks = {e.world_size for e in timed}
    if len(ranks) > 1:
        raise RankEfficiencyError(f"--rank-efficiency-from {path}: its steps ran on {sorted(ranks)} ranks; "
                                  "pass runs of one world size each")
    return _RunSpeed(path, ranks.pop(), sum(e.timing.compute for e in timed) / tokens)
