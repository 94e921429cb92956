"""A dataset env walks its rows in epochs: every row once per epoch, each epoch reshuffled by
(run seed, epoch), the epoch in each prompt's meta, and the same rows at the same draws after a
resume (a new process, and a worker that recovers the draws it made from the bus and the log)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np

from reel.bus.events import Tensor, Trajectory
from reel.bus.streams import Publisher, connect
from reel.consumers.aggregates import RunAggregates
from reel.producers.draws import Draws, recover_draws
from reel.producers.envs import make_env
from reel.runtime.config.sections import EnvSection

ROWS = 5


def _env(tmp_path: Path):
    path = tmp_path / "five.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(ROWS)))
    return make_env(EnvSection(name="dataset", options={"path": str(path)}), 16)


def _walk(env, draws: list[int], seed: int = 7) -> list[tuple[int, int, int]]:
    """(draw, epoch, row) of each draw; the rng is one the dataset must not depend on."""
    prompts = [env.draw(random.Random(1000 + n), n, seed) for n in draws]
    return [(p.meta["draw"], p.meta["epoch"], p.meta["index"]) for p in prompts]


def test_five_rows_drawn_for_three_epochs_show_each_row_once_per_epoch(tmp_path: Path) -> None:
    env = _env(tmp_path)
    walked = _walk(env, list(range(3 * ROWS)))
    assert [epoch for _, epoch, _ in walked] == [0] * ROWS + [1] * ROWS + [2] * ROWS
    orders = [[row for _, epoch, row in walked if epoch == e] for e in range(3)]
    assert all(sorted(order) == list(range(ROWS)) for order in orders)
    assert len({tuple(order) for order in orders}) > 1  # reshuffled per epoch
    assert orders == [env.order(7, e) for e in range(3)]
    # A resumed run (a new process) draws the same rows at the same draws; another seed, other orders.
    assert _walk(_env(tmp_path), list(range(8, 3 * ROWS))) == walked[8:]
    assert [row for *_, row in _walk(env, list(range(3 * ROWS)), seed=8)] != [row for *_, row in walked]
    # Eval and warm-start prompts stay random draws, without an epoch.
    assert "epoch" not in env.sample(random.Random(0)).meta


def test_workers_share_the_draws_and_a_restart_makes_the_missing_ones_first() -> None:
    def take(draws: Draws, n: int) -> list[int]:
        return [draws.next() for _ in range(n)]

    assert take(Draws(0, 1), 4) == [0, 1, 2, 3]
    assert take(Draws(1, 3), 3) == [1, 4, 7]
    # Worker 1 of 2 made 1, 5 and 7 (3 was in flight when it stopped); worker 0's draws are not its own.
    assert take(Draws(1, 2, {1, 5, 7, 0, 2}), 3) == [3, 9, 11]
    assert take(Draws(0, 2, {0, 2, 4}), 2) == [6, 8]


def test_a_restarted_worker_recovers_its_draws_from_the_bus_and_its_dead_letters(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    run = "epochs-recover"

    def trajectory(publisher: Publisher, draw: int) -> Trajectory:
        return publisher.stamp(Trajectory, group_id=f"g{draw}", env="dataset", samples=[], worker=publisher.producer,
                               prompt=Tensor.from_numpy(np.zeros(1, np.int32)), meta={"draw": draw, "epoch": 0})

    async def scenario() -> set[int]:
        client = connect(redis_url)
        try:
            mine, other = Publisher(client, run, "rollout:0", 0), Publisher(client, run, "rollout:1", 0)
            await mine.publish([trajectory(mine, 0), trajectory(mine, 4)])
            await other.publish([trajectory(other, 1)])
            await mine.dead_letter(trajectory(mine, 2), "its reward raised")
            return await recover_draws(client, tmp_path / "no-log-yet", run, "rollout:0", None)
        finally:
            await client.aclose()

    made = asyncio.run(scenario())
    assert made == {0, 2, 4}
    draws = Draws(0, 2, made)
    assert [draws.next() for _ in range(2)] == [6, 8]


def test_top_and_prometheus_see_the_newest_epoch() -> None:
    aggregates = RunAggregates("r")
    assert aggregates.snapshot().dataset_epoch is None
    for epoch in (0, 1, 0):
        aggregates.apply(Trajectory(run="r", producer="rollout:0", seq=epoch, group_id=f"g{epoch}", env="dataset",
                                    prompt=Tensor.from_numpy(np.zeros(1, np.int32)), samples=[], worker="rollout:0",
                                    meta={"epoch": epoch}))
    assert aggregates.snapshot().dataset_epoch == 1
