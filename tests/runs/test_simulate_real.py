"""`reel simulate` against reality: short real runs, predicted out of sample.

The first pair is the `reel bench async` shape made small: a long-tail completion-length
distribution, one worker, every role a real process, run synchronously (A) and at async_level 1
(B). B is predicted from A's log alone: A never overlaps rollout and trainer, so what sharing the
cores costs B comes from A's CPU times (replay/simulate_cores.py). The staleness histogram and the
trainer's idle share must land within the issue's targets. Wall time is held to a factor of two
out of sample (the machine's other tenants change how many cores the run gets between A and B,
which a log of A cannot show; docs/simulator.md has the measured pairs) and to 30% in sample.
The mismatch role runs beside both (its own process since issue 43): A's log has its splits,
and the simulation prices B's, one scoring pass more per older version, from them.
The second pair is examples/slow_calc.toml made small: multi-turn episodes whose tool calls wait a
heavy-tailed wall time, run synchronously and at async_level 2; the simulator replays each logged
call's wait (Sample.env_s) for its episode alone while the engine goes on.
The third is examples/calc_tool.toml made small: multi-turn episodes, whose turn structure the
calibration must read as the log records it, and whose own wall time it must predict as closely.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reel.bus.events import Trajectory
from reel.bus.run_log import RunLog

from reel.replay.simulate import Scenario, simulate
from reel.replay.simulate_report import caveats, compare
from reel.replay.workload import extract
from runbuilder import TINY_MODEL_TOML
from reel.runtime.launch.cli import main

pytestmark = pytest.mark.slow

CONFIG = """
[run]
name = "simulate_real"
steps = 80  # ~10 s per run on an idle machine (2026-12-03); 40 left 2-3 WorkerStats intervals to fit on
{model}[init]
warmup_steps = 30
[env]
min_len = 3
max_len = 6
long_tail = 0.2
[rollout]
concurrency = 12
group_size = 6
async_level = {async_level}
max_tokens = 24
stats_every_s = 0.6  # above the archiver's 0.5 s block: it stops once a read finds nothing new
[trainer]
batch_groups = 6
max_off_policy_steps = 2
checkpoint_every = 1000
"""

# Wall time out of sample: a model that misses by a factor fails. What no synchronous log shows moves the
# error far more than the 15% target on this shared machine: the other tenants' load changing between the
# two runs (the suite's other xdist worker among them). Measured pairs (docs/simulator.md): -65% to +32%
# on 2026-12-03/05 at load 1.5 to 15; +54.4% on CI (2026-12-05, long-tail, the other worker's tests beside
# it). So out of sample the prediction is held to a factor of two either way, and the model itself to
# its own run's log (in sample: no load moved between measuring and predicting, only within the run) within
# IN_SAMPLE_WALL: slow-tool +16.2% on a suite run at load 4-7 (2026-12-05 07:45). The 15% target is checked by
# `reel bench async` (its simulated figure), on a quiet machine.
WALL_FACTOR = 2.0
IN_SAMPLE_WALL = 0.3
# Staleness histograms, total variation: long-tail 0.004; slow-tool 0.235 with the mismatch split in
# the trainer's step (a slower async trainer lets rounds age: more tokens two versions behind), 0.103
# with it in its own role.
STALENESS_BOUND = {"long-tail": 0.1, "slow-tool": 0.25}
# The trainer's idle share, predicted against measured: slow-tool measured 0.15 and 0.25 (2026-12-05, load
# ~1.5; its wall within 4%): the simulator's tool-wait model gets the wall right and the trainer's idle share coarse.
TRAINER_IDLE_BOUND = {"long-tail": 0.15, "slow-tool": 0.3}


SLOW_TOOL = """
[run]
name = "simulate_slow_tool"
steps = 24
[model]
hidden_size = 64
moe_intermediate_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
num_experts = 8
num_experts_per_tok = 2
[init]
warmup_steps = 150  # enough for the tool-call protocol: most episodes call the calculator
warmup_noise = 0.05
[env]
name = "slow_calc"
[env.options]
max_value = 99
[rollout]
concurrency = 24
group_size = 8
async_level = {async_level}
max_tokens = 20
stats_every_s = 0.6
tool_concurrency = 256
[trainer]
objective = "tis"
lr = 5e-4
batch_groups = 8
max_off_policy_steps = 2
router_replay = true
precision = "fp32"
checkpoint_every = 1000
"""
WORKLOADS = {"long-tail": (CONFIG.replace("{model}", TINY_MODEL_TOML), 1), "slow-tool": (SLOW_TOOL, 2)}


def _run(tmp_path: Path, workload: str, async_level: int) -> Path:
    config = tmp_path / f"async{async_level}.toml"
    config.write_text(WORKLOADS[workload][0].format(async_level=async_level))
    run_dir = tmp_path / f"async{async_level}"
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 0
    return run_dir


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_a_synchronous_run_predicts_the_asynchronous_one(tmp_path: Path, workload: str) -> None:
    level = WORKLOADS[workload][1]
    sync, async_ = extract(_run(tmp_path, workload, 0)), extract(_run(tmp_path, workload, level))
    assert max(async_.measured.staleness) >= 1 and max(sync.measured.staleness) == 0
    # The synchronous log has CPU times: sharing the cores is modelled from them, not assumed free.
    assert sync.cores is not None and sync.cores.cores >= 1
    scenario = Scenario(pipeline=async_.pipeline)
    # The mismatch role runs beside the trainer, its splits in the log: priced from them, nothing left unsaid.
    assert sync.split is not None and sync.split.splits >= 3 and caveats(sync, scenario) == []
    assert sync.decode.shared_slowdown > 0 or sync.cores.share(1, 1) == 1.0  # free only with cores to spare
    result = simulate(sync, scenario)
    c = compare(result, async_.measured)
    assert c.staleness_tv <= STALENESS_BOUND[workload], (c, result.staleness, async_.measured.staleness)
    assert abs(c.trainer_idle_error) <= TRAINER_IDLE_BOUND[workload], c
    assert 1 / WALL_FACTOR <= 1 + c.wall_error <= WALL_FACTOR, (c, result, async_.measured, sync.cores)
    own = compare(simulate(async_, Scenario(pipeline=async_.pipeline)), async_.measured)
    assert abs(own.wall_error) <= IN_SAMPLE_WALL, own


CALC_TOOL = """
[run]
name = "simulate_calc_tool"
steps = 12
[model]
hidden_size = 64
moe_intermediate_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
num_experts = 8
num_experts_per_tok = 2
[init]
warmup_steps = 150  # enough for the tool-call protocol: most episodes call the calculator
warmup_noise = 0.05
[env]
name = "calc_tool"
[env.options]
max_value = 99
[rollout]
concurrency = 8
group_size = 8
async_level = 1
max_tokens = 20
stats_every_s = 0.6
[trainer]
objective = "tis"
lr = 5e-4
batch_groups = 8
max_off_policy_steps = 1
router_replay = true
precision = "fp32"
checkpoint_every = 1000
"""


def test_calibration_reads_the_turns_of_a_real_multi_turn_run(tmp_path: Path) -> None:
    config = tmp_path / "calc_tool.toml"
    config.write_text(CALC_TOOL)
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 0
    workload = extract(run_dir)
    with RunLog(run_dir, readonly=True) as log:
        logged = [e for _, e in log.events("trajectories") if isinstance(e, Trajectory)]
    assert len(workload.groups) == len(logged)
    turns = []
    for shape, traj in zip(workload.groups, logged):
        assert shape.prompt == traj.prompt.shape[0]
        for got, sample in zip(shape.samples, traj.samples, strict=True):
            assert got[::2] == (sample.turn_lengths or [sample.tokens.shape[0]])  # model turns
            assert got[1::2] == [end - first for first, end in sample.env_spans]  # tool results between them
            assert (len(got) + 1) // 2 == sample.turns and sum(got) == sample.tokens.shape[0]
            turns.append(sample.turns)
    assert max(turns) >= 3 and sum(t > 1 for t in turns) >= 0.2 * len(turns)  # it calls the tool, some twice
    # Wall time and idle share only: over a dozen steps the staleness histogram is mostly how many
    # tokens step 1 (all on-policy) drew, and the policy's lengths still drift from step to step.
    c = compare(simulate(workload, Scenario(pipeline=workload.pipeline)), workload.measured)
    assert abs(c.wall_error) <= 0.15 and abs(c.trainer_idle_error) <= 0.15, c
