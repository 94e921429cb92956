"""Metrics: rolling aggregates from hand-built events, watchers on a real Redis, exporters."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import socket
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from reel.bus.events import (
    STREAM_OF, STREAMS, BlobRef, DroppedGroup, MismatchSplit, RunFinished, Sample, StepCommitted, StepTiming,
    Tensor, Trajectory, WeightsPublished, WorkerStats, decode, encode, stream_key,
)
from reel.bus.run_log import RunLog
from reel.bus.streams import DEAD, GroupConsumer, Publisher, connect
from reel.consumers.aggregates import RunAggregates
from reel.consumers.metric_views import SnapshotCollector
from reel.consumers.metrics import MetricsError, RunSource, Watcher, locate, read_log, serve
from reel.runtime.launch import cli, cli_commands
from reel.runtime.launch.run_dir import announce_finished
from paths import REPO

_seq = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traj(run: str, group_id: str, rewards: list[float], seq: int | None = None) -> Trajectory:
    sample = lambda r: Sample(  # noqa: E731
        tokens=Tensor.from_numpy(np.array([1, 2], np.int32)),
        logprobs=Tensor.from_numpy(np.array([-0.1, -0.2], np.float32)),
        reward=r, finish_reason="stop", seed=0, spans=[(0, 0)],
    )
    return Trajectory(run=run, producer="rollout:0", seq=next(_seq) if seq is None else seq, group_id=group_id,
                      env="reverse_text", prompt=Tensor.from_numpy(np.array([3], np.int32)),
                      samples=[sample(r) for r in rewards], worker="rollout:0")


def _step(run: str, step: int, groups: list[str], *, dropped=(), metrics=None, staleness=None,
          timing=(0.0, 1.0, 0.0)) -> StepCommitted:
    return StepCommitted(run=run, producer="trainer:0", seq=next(_seq), step=step, version=step, groups=groups,
                         dropped=[DroppedGroup(g, r) for g, r in dropped], loss=0.5 / step, grad_norm=float(step),
                         weights_sha256="ab" * 32, timing=StepTiming(*timing), metrics=metrics or {},
                         staleness=staleness or {})


def _weights(run: str, version: int) -> WeightsPublished:
    return WeightsPublished(run=run, producer="trainer:0", seq=next(_seq), version=version, step=version,
                            weights=BlobRef(uri="file:///w", sha256="cd" * 32, nbytes=1))


def _stats(run: str, worker: str, tokens_per_s: float, version: int) -> WorkerStats:
    return WorkerStats(run=run, producer=worker, seq=next(_seq), worker=worker, tokens_per_s=tokens_per_s,
                       running=3, waiting=1, policy_version=version, groups_published=7)


STALE = "stale: 3 versions behind > max_off_policy_steps = 1"  # the trainer's "CODE: details" reason text


def _synthetic_run(run: str) -> list:
    """Four groups (mean rewards 0.5, 1, 0, 0.5), two steps, two workers, then RunFinished."""
    t1 = _traj(run, "g1", [1.0, 0.0])
    return [
        _weights(run, 0), t1, t1,  # the duplicate delivery must not count
        _traj(run, "g2", [1.0, 1.0]), _traj(run, "g3", [0.0, 0.0]), _traj(run, "g4", [0.5, 0.5]),
        _stats(run, "rollout:0", 10.0, 0),
        _step(run, 1, ["g1", "g2"], dropped=[("g3", STALE), ("g4", STALE)], staleness={0: 10, 1: 30},
              timing=(1.0, 3.0, 0.0)),
        _weights(run, 1), _weights(run, 2),
        _stats(run, "rollout:0", 100.0, 1), _stats(run, "rollout:1", 50.0, 2),
        _step(run, 2, ["g4"], dropped=[("g9", "off_policy: a reason without a code")], staleness={1: 20, 2: 20}, timing=(0.0, 1.0, 1.0),
              metrics={"reward_mean": 0.6, "kl_k1": 0.01, "kl_k3": 0.002, "ratio_mean": 1.01, "other": 5.0,
                       "bus_lost_events": 7.0}),
        RunFinished(run=run, producer="launcher:0", seq=next(_seq), reason="done", dead_letters=3),
    ]


def test_aggregates_hand_checked():
    agg = RunAggregates(window_groups=3, window_steps=20)
    for event in _synthetic_run("r"):
        agg.apply(event)
    agg.set_dead_letters(2)  # a stale count below RunFinished's 3: the counter does not go down
    s = agg.snapshot()
    assert s.run == "r" and s.finished == "done"
    assert s.groups_seen == 4 and s.groups_published == {"rollout:0": 4} and s.groups_trained == 3
    # window = last 3 groups: 1, 0, 0.5 -> mean 0.5, p50 0.5, p90 = 0.5 + 0.8 * 0.5 (linear)
    assert s.window_groups == 3
    assert s.reward_mean == pytest.approx(0.5)
    assert s.reward_p50 == pytest.approx(0.5)
    assert s.reward_p90 == pytest.approx(0.9)
    assert s.step == 2 and s.policy_version == 2
    assert s.step_reward == pytest.approx(0.6)  # the trainer's reward_mean wins
    assert s.loss == pytest.approx(0.25) and s.grad_norm == 2.0
    assert s.mismatch == {"kl_k1": 0.01, "kl_k3": 0.002, "ratio_mean": 1.01}  # missing keys stay missing
    assert s.idle_ratio == pytest.approx(1.0 / 6.0)  # waits 1 + 0 over totals 4 + 2
    assert s.staleness == {0: 10, 1: 50, 2: 20}
    assert s.dropped == {"stale": 2, "bad_routing": 0, "other": 1}  # reason codes; the text stays in the log
    assert s.dead_letters == 3
    assert [(w.worker, w.tokens_per_s, w.version_lag) for w in s.workers] == [("rollout:0", 100.0, 1),
                                                                               ("rollout:1", 50.0, 0)]
    assert s.tokens_per_s == 150.0
    first, second = s.recent_steps
    assert first.reward == pytest.approx(0.75)  # no reward_mean: mean of g1 (0.5) and g2 (1.0)
    assert first.staleness_mean == pytest.approx(0.75)  # (0*10 + 1*30) / 40
    assert first.idle_share == pytest.approx(0.25) and second.idle_share == 0.0
    assert first.dropped == 2 and first.dropped_by_reason == {"stale": 2}
    assert second.staleness_mean == pytest.approx(1.5)


def test_aggregates_empty_and_idle_window():
    s = RunAggregates().snapshot()
    assert s.step is None and s.reward_mean is None and s.reward_p90 is None and s.idle_ratio is None
    assert s.mismatch == {} and s.workers == [] and s.dead_letters is None
    assert s.dropped == {"stale": 0, "bad_routing": 0, "other": 0} and s.groups_published == {}  # counters start at 0
    agg = RunAggregates(window_steps=1)
    agg.apply(_step("r", 1, [], timing=(1.0, 1.0, 0.0)))
    agg.apply(_step("r", 2, [], timing=(0.0, 0.0, 0.0)))  # a zero-length step has no idle share
    s = agg.snapshot()
    assert s.idle_ratio is None and s.recent_steps[0].idle_share == 0.5 and s.step_reward is None


def test_the_split_comes_from_the_mismatch_roles_event_which_lags_the_steps():
    agg = RunAggregates()
    for step in (1, 2, 3):
        agg.apply(_step("r", step, [], metrics={"kl_k3": 0.1 * step}))
    assert "numerics_k3" not in agg.snapshot().mismatch and agg.snapshot().split_step is None
    agg.apply(MismatchSplit(run="r", producer="mismatch:0", seq=next(_seq), step=2, versions=[0], lag_steps=1,
                            figures={"numerics_k3": 0.02, "drift_k3": 0.18, "split_tokens": 10.0}))
    s = agg.snapshot()
    assert s.mismatch["kl_k3"] == pytest.approx(0.3)  # the latest step's own figure
    assert (s.mismatch["numerics_k3"], s.mismatch["drift_k3"]) == (0.02, 0.18)  # the latest split, of step 2
    assert s.split_step == 2 and s.split_lag_steps == 1
    assert [r.metrics.get("drift_k3") for r in s.recent_steps] == [None, 0.18, None]
    metrics = {m.name: m for m in SnapshotCollector(lambda: s).collect()}
    assert metrics["reel_mismatch_drift_kl_k3"].samples[0].value == 0.18
    assert metrics["reel_mismatch_split_lag_steps"].samples[0].value == 1


# ---------------------------------------------------------------- log: export, final state, CLI


def _write_run_dir(run_dir: Path, run: str, events: list, *, bus_url: str | None = None) -> None:
    """A run directory as the launcher and archiver leave it: config.toml, log/, maybe bus_url."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(f'[run]\nname = "{run}"\n')
    if bus_url is not None:
        (run_dir / "bus_url").write_text(bus_url + "\n")
    with RunLog(run_dir) as log:
        for i, event in enumerate(events):
            log.stream(STREAM_OF[type(event)]).append_batch([(f"{1000 + i}-0", encode(event))])


def test_export_jsonl_from_log(tmp_path: Path):
    _write_run_dir(tmp_path / "run", "r", _synthetic_run("r"))
    out = tmp_path / "steps.jsonl"
    assert cli.main(["metrics", "export", "--run", str(tmp_path / "run"), "--jsonl", str(out)]) == 0
    first, second = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert first["step"] == 1 and first["version"] == 1 and first["loss"] == 0.5 and first["grad_norm"] == 1.0
    assert first["reward"] == pytest.approx(0.75)  # from the logged trajectories of g1, g2
    assert first["kl_k1"] is None and first["ratio_max"] is None
    assert first["staleness"] == {"0": 10, "1": 30} and first["staleness_mean"] == pytest.approx(0.75)
    assert first["idle_share"] == pytest.approx(0.25)
    assert first["dropped"] == 2 and first["dropped_by_reason"] == {"stale": 2}
    assert first["timing"] == {"wait": 1.0, "compute": 3.0, "publish": 0.0, "score_old": 0.0,
                               "forward_backward": 0.0, "optimizer": 0.0, "commit": 0.0}  # not in this log: 0
    assert second["reward"] == 0.6 and second["kl_k1"] == 0.01 and second["kl_k3"] == 0.002
    assert second["metrics"]["other"] == 5.0 and second["idle_share"] == 0.0


def test_finished_run_reads_the_log(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COLUMNS", "160")
    run_dir = tmp_path / "run"
    # bus_url names a live Redis, but the log holds RunFinished: the log is the whole story.
    _write_run_dir(run_dir, "r", _synthetic_run("r"), bus_url=redis_url)
    source = asyncio.run(locate(str(run_dir), None, None))
    assert source.bus_url is None and source.run == "r"
    s = read_log(source)
    assert s.finished == "done" and s.step == 2 and s.groups_seen == 4 and s.staleness == {0: 10, 1: 50, 2: 20}
    assert cli.main(["top", "--run", str(run_dir), "--once"]) == 0
    shown = capsys.readouterr().out
    assert s.dead_letters == 3  # from RunFinished: the log alone knows them
    assert "finished: done" in shown and "rollout:1" in shown and "other" in shown


def test_locate_without_a_live_bus(tmp_path: Path, capsys: pytest.CaptureFixture):
    events = [e for e in _synthetic_run("r") if not isinstance(e, RunFinished)]
    _write_run_dir(tmp_path / "a", "r", events)  # no bus_url: the log
    assert asyncio.run(locate(str(tmp_path / "a"), None, None)).bus_url is None
    _write_run_dir(tmp_path / "b", "r", events, bus_url=f"redis://127.0.0.1:{_free_port()}/0")  # nobody there
    assert asyncio.run(locate(str(tmp_path / "b"), None, None)).bus_url is None
    assert cli.main(["top", "--run", str(tmp_path / "missing")]) == 1
    assert "config.toml does not exist" in capsys.readouterr().err
    with pytest.raises(MetricsError, match="--bus URL and --name NAME"):
        asyncio.run(locate(None, "redis://x", None))


# ---------------------------------------------------------------- live bus


async def _publish(redis_url: str, events: list) -> None:
    client = connect(redis_url)
    try:
        await Publisher(client, events[0].run, "test:0").publish(events)
    finally:
        await client.aclose()


async def test_watchers_see_every_step_and_create_no_group(redis_url: str, run_name: str):
    events = _synthetic_run(run_name)
    await _publish(redis_url, events[:-1])  # all but RunFinished
    trainer = GroupConsumer(redis_url, run_name, "trainer", "trainer-0", ["trajectories", "routing"], block_ms=0)
    archiver = GroupConsumer(redis_url, run_name, "archiver", "archiver-0", list(STREAMS), block_ms=0)
    first, second = Watcher(redis_url, run_name), Watcher(redis_url, run_name)
    late = Watcher(redis_url, run_name, start="$")
    try:
        async with trainer, archiver:
            await late.poll(block_ms=0)  # pins "$" before the rest arrives
            got = await archiver.read(count=100)
            assert sum(d.stream == "steps" for d in got) == 2
            await archiver.ack(got)
            dead = (await trainer.read(count=100))[0]
            await trainer.dead_letter(dead, "test: poison")
            for watcher in (first, second):
                await watcher.catch_up()
            await _publish(redis_url, [_step(run_name, 3, [], staleness={3: 4})])
            for watcher in (first, second, late):
                await watcher.catch_up()
                assert [r.step for r in watcher.snapshot.recent_steps] == ([3] if watcher is late else [1, 2, 3])
                assert watcher.snapshot.dead_letters == 1
            s = first.snapshot
            assert s.groups_seen == 4 and s.dropped == {"stale": 2, "bad_routing": 0, "other": 1}
            assert s.staleness == {0: 10, 1: 50, 2: 20, 3: 4} and s.finished is None
            client = connect(redis_url)
            try:
                await client.xtrim(stream_key(run_name, DEAD), maxlen=0)  # the counter must not go down
                await first.poll(block_ms=0)
                assert first.snapshot.dead_letters == 1
                # watchers read with plain XREAD: the only groups are the two consumers'
                for stream in STREAMS:
                    groups = {g["name"].decode() for g in await client.xinfo_groups(stream_key(run_name, stream))}
                    assert groups == ({"trainer", "archiver"} if stream in ("trajectories", "routing")
                                      else {"archiver"})
            finally:
                await client.aclose()
    finally:
        for watcher in (first, second, late):
            await watcher.close()


async def test_locate_live_run(tmp_path: Path, redis_url: str, run_name: str):
    _write_run_dir(tmp_path / "run", run_name, [_weights(run_name, 0)], bus_url=redis_url)
    assert await locate(str(tmp_path / "run"), None, None) == RunSource(run_name, redis_url, tmp_path / "run")
    assert (await locate(None, redis_url, run_name)).bus_url == redis_url
    assert RunSource("r", "redis://reel:secret@host:6379/0", None).describe() == "live redis://host:6379/0"


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_prometheus_endpoint(redis_url: str, run_name: str):
    await _publish(redis_url, _synthetic_run(run_name))
    port, stop = _free_port(), asyncio.Event()
    server = asyncio.create_task(serve(RunSource(run_name, redis_url, None), port, stop, addr="127.0.0.1"))
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            try:
                families = await asyncio.to_thread(_scrape, port)
            except OSError:
                continue
            if families["reel_trainer_step"].samples:
                break
        value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
        run = ("run", run_name)
        assert value[("reel_trainer_step", (run,))] == 2
        assert value[("reel_policy_version", (run,))] == 2
        assert value[("reel_run_finished", (run,))] == 1
        assert value[("reel_reward_mean", (run,))] == pytest.approx(0.5)  # groups 0.5, 1, 0, 0.5
        assert value[("reel_mismatch_kl_k3", (run,))] == 0.002
        assert value[("reel_mismatch_kl_k1", (run,))] == 0.01
        assert value[("reel_importance_ratio_mean", (run,))] == 1.01
        assert value[("reel_trainer_idle_ratio", (run,))] == pytest.approx(1 / 6)
        assert value[("reel_worker_tokens_per_second", (run, ("worker", "rollout:1")))] == 50.0
        assert value[("reel_worker_version_lag", (run, ("worker", "rollout:0")))] == 1
        assert value[("reel_groups_dropped_total", (("reason", "stale"), run))] == 2
        assert value[("reel_groups_dropped_total", (("reason", "other"), run))] == 1
        assert value[("reel_groups_published_total", (run, ("worker", "rollout:0")))] == 4
        assert value[("reel_groups_trained_total", (run,))] == 3
        assert value[("reel_staleness_tokens_total", (run, ("versions_behind", "1")))] == 50
        assert value[("reel_dead_letters_total", (run,))] == 3
        assert value[("reel_bus_lost_events_total", (run,))] == 7  # step 2 was committed after a resume
        expected = {"reel_reward_mean", "reel_reward_p50", "reel_reward_p90", "reel_mismatch_kl_k1",
                    "reel_mismatch_kl_k2", "reel_mismatch_kl_k3", "reel_importance_ratio_mean",
                    "reel_importance_ratio_min", "reel_importance_ratio_max", "reel_trainer_idle_ratio",
                    "reel_trainer_step", "reel_policy_version", "reel_worker_tokens_per_second",
                    "reel_worker_version_lag", "reel_groups_dropped", "reel_dead_letters", "reel_staleness_tokens",
                    "reel_groups_published", "reel_groups_trained"}
        assert expected <= set(families)
        assert not families["reel_mismatch_kl_k2"].samples  # the trainer did not write it: no sample
    finally:
        stop.set()
        await asyncio.wait_for(server, 5)
    with pytest.raises(OSError):
        await asyncio.to_thread(_scrape, port)  # the server is gone


def test_top_once_on_a_live_bus(redis_url: str, run_name: str, capsys: pytest.CaptureFixture,
                                monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COLUMNS", "160")
    asyncio.run(_publish(redis_url, _synthetic_run(run_name)[:-1]))
    assert cli.main(["top", "--bus", redis_url, "--name", run_name, "--once"]) == 0
    shown = capsys.readouterr().out
    assert "running" in shown and f"live {redis_url}" in shown and "rollout:1" in shown


def test_dashboard_queries_only_exported_metrics():
    """Every series the Grafana dashboard queries is one the exporter serves (a rename breaks this)."""
    agg = RunAggregates()
    for event in _synthetic_run("r"):
        agg.apply(event)
    agg.set_dead_letters(0)
    snapshot = agg.snapshot()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    served = {f.name for f in registry.collect()} | {s.name for f in registry.collect() for s in f.samples}
    dashboard = orjson.loads((REPO / "ops" / "grafana" / "reel.json").read_bytes())
    queried = {name for p in dashboard["panels"] for t in p.get("targets", [])
               for name in re.findall(r"\breel_[a-z0-9_]+", t["expr"])}
    assert len(queried) >= 20 and queried <= served, queried - served


def _outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_prometheus_endpoint_binds_loopback_by_default(tmp_path: Path):
    """`reel metrics serve` exposes nothing beyond this machine unless --addr says so."""
    args = cli_commands.build_parser().parse_args(["metrics", "serve", "--run", str(tmp_path)])
    assert args.addr == "127.0.0.1"
    _write_run_dir(tmp_path / "run", "r", _synthetic_run("r"))
    port, stop = _free_port(), asyncio.Event()
    server = asyncio.create_task(serve(RunSource("r", None, tmp_path / "run"), port, stop))
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            with contextlib.suppress(OSError):
                assert (await asyncio.to_thread(_scrape, port))["reel_trainer_step"].samples
                break
        listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        bound = {local for _, local, _, state, *_ in listening if state == "0A" and local.endswith(f":{port:04X}")}
        assert bound == {f"0100007F:{port:04X}"}, bound  # 127.0.0.1 only, not 0.0.0.0
        outside = _outside_address()
        if outside is not None:
            with pytest.raises(OSError):
                socket.create_connection((outside, port), timeout=2).close()
    finally:
        stop.set()
        await asyncio.wait_for(server, 5)


def test_run_finished_carries_the_dead_letters(redis_url: str, run_name: str, tmp_path: Path):
    """The launcher counts the dead letters into RunFinished, so a finished run's log knows them."""
    async def dead_letter_twice() -> None:
        client = connect(redis_url)
        try:
            for i in range(2):
                await client.xadd(stream_key(run_name, DEAD), {"stream": "trajectories", "reason": f"test {i}"})
        finally:
            await client.aclose()

    asyncio.run(dead_letter_twice())
    announce_finished(redis_url, run_name, "done")

    async def read_control() -> list:
        client = connect(redis_url)
        try:
            return [decode(fields[b"e"]) for _, fields in await client.xrange(stream_key(run_name, "control"))]
        finally:
            await client.aclose()

    finished = [e for e in asyncio.run(read_control()) if isinstance(e, RunFinished)]
    assert [(e.reason, e.dead_letters) for e in finished] == [("done", 2)]
    _write_run_dir(tmp_path / "run", run_name, finished)
    assert read_log(asyncio.run(locate(str(tmp_path / "run"), None, None))).dead_letters == 2
