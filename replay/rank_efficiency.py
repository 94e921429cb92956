"""Where `reel simulate` gets its trainer rank efficiency, said with the figure.

N ranks are modelled as N x efficiency times one process's throughput. The efficiency is given
(--rank-efficiency), fitted from a `reel bench fsdp` line (--rank-efficiency-from: the same model
and batches on 1 process and on 2 ranks, efficiency = 1-process s/step / (2 x 2-rank s/step)), or
assumed (0.9, a guess, and said to be one).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from reel.bus.errors import ReelError

ASSUMED = 0.9


class RankEfficiency(msgspec.Struct, frozen=True):
    value: float
    source: str  # one phrase: where `value` came from


class RankEfficiencyError(ReelError):
    """A --rank-efficiency-from file that is not a `reel bench fsdp` line."""


class _FsdpBench(msgspec.Struct):
    one_rank_step_s: float
    two_rank_step_s: float


def rank_efficiency(given: float | None, bench_file: str | None) -> RankEfficiency:
    if given is not None:
        return RankEfficiency(given, "given (--rank-efficiency)")
    if bench_file is None:
        return RankEfficiency(ASSUMED, "assumed, not measured (fit it: --rank-efficiency-from a "
                                       "`reel bench fsdp` line)")
    path = Path(bench_file)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        bench = msgspec.json.decode(lines[-1], type=_FsdpBench)
    except (OSError, IndexError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RankEfficiencyError(f"--rank-efficiency-from {path}: not a `reel bench fsdp` JSON line ({exc})") from exc
    value = min(1.0, bench.one_rank_step_s / (2 * bench.two_rank_step_s))
    return RankEfficiency(value, f"fitted from {path}: 1 process {bench.one_rank_step_s:.3f} s/step, "
                                 f"2 ranks {bench.two_rank_step_s:.3f} s/step")
