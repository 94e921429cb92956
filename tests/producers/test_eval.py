"""The eval role and `reel eval`: pass@k against its published formula, EvalResult in `reel top`,
Prometheus and `reel compare`, and end-to-end runs with task adapters (reasoning-gym with the eval
role; a dataset whose reward function raises on some rows, which are dead-lettered while the run goes on)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import EvalResult, RunFinished, Sample, StepCommitted, Tensor, Trajectory, WeightsPublished
from reel.bus.run_log import RunLog
from reel.consumers.aggregates import RunAggregates
from reel.bus.streams import connect
from reel.consumers.metric_views import SnapshotCollector, render
from reel.producers.draws import recover_draws
from reel.producers.envs import make_env
from reel.producers.evaluator import due, pass_at_k
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import loads
from reel.runtime.launch.cli import main
from reel.runtime.tokenizer import CharTokenizer
from reel.runtime.weights.load import version_bytes
from runbuilder import TINY_MODEL_TOML
from paths import SUPPORT
from user_config import load_as_reel_run

pytest.importorskip("reasoning_gym", reason="the `tasks` extra (pip install '.[tasks]')")


def reference_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021, the numerically stable form: 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@pytest.mark.parametrize("n, c, k", [(4, 0, 4), (4, 1, 1), (4, 2, 1), (10, 3, 5), (10, 0, 1), (10, 10, 3), (16, 1, 8)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(reference_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_due_versions_are_every_nth_and_the_last():
    assert [v for v in range(12) if due(v, 5, 11)] == [0, 5, 10, 11]


def test_eval_role_takes_the_newest_due_version_and_lists_the_ones_it_skipped():
    from reel.bus.events import BlobRef
    from reel.producers.evaluator import EvalRole

    role = object.__new__(EvalRole)  # only the version choice: no engine, env or bus
    role.config, role.evaluated, role.skipped = loads("[run]\nsteps = 12\n[eval]\nevery = 5\n"), -1, []

    def published(*versions: int) -> dict[int, WeightsPublished]:
        return {v: WeightsPublished(run="r", producer="trainer:0", seq=v, version=v, step=v,
                                    weights=BlobRef(uri="", sha256="0" * 64, nbytes=0)) for v in versions}

    assert role._next(published(0)).version == 0
    role.evaluated = 0
    assert role._next(published(0, 1, 2, 3, 4)) is None  # none due
    assert role._next(published(*range(12))).version == 10 and role.skipped == [5]  # behind: 5 passed over
    role.evaluated, role.skipped = 10, []
    assert role._next(published(*range(13))).version == 12 and role.skipped == []  # the last is always due


@pytest.mark.parametrize("section, message", [
    ("every = -1", r"eval.every = -1 must be >= 0"),
    ("every = 2\nsamples_per_prompt = 0", r"eval.samples_per_prompt = 0 must be at least 1"),
    ("every = 2\n[eval.env]\nname = \"reasoning_gym\"\n[eval.env.options]\ntasks = {gcdd = 1}",
     r"eval.env.options.tasks.gcdd is not a reasoning-gym task"),
])
def test_bad_eval_config_fails_at_load(section, message):
    with pytest.raises(ConfigError, match=message):
        load_as_reel_run(f"[eval]\n{section}\n")


def _eval_result(version: int, mean: float, skipped: list[int], per_task: dict[str, float] | None = None) -> EvalResult:
    return EvalResult(run="r", producer="eval:0", seq=version, version=version, step=version, env="reasoning_gym",
                      prompts=8, samples_per_prompt=4, mean_reward=mean, pass_at_1=mean / 2, pass_at_k=mean,
                      per_task=per_task or {}, skipped_versions=skipped, wall_s=0.1)


def _trajectory(i: int, task: str, rewards: list[float], scores: list[dict[str, float]]) -> Trajectory:
    tokens = Tensor.from_numpy(np.zeros(2, np.int32))
    samples = [Sample(tokens=tokens, logprobs=Tensor.from_numpy(np.zeros(2, np.float32)), reward=r, finish_reason="stop",
                      seed=0, spans=[(0, 0)], scores=part) for r, part in zip(rewards, scores)]
    return Trajectory(run="r", producer="rollout:0", seq=100 + i, group_id=f"g{i}", env="reasoning_gym", prompt=tokens,
                      samples=samples, worker="rollout:0", meta={"task": task})


def test_eval_results_in_top_and_prometheus():
    from rich.console import Console

    agg = RunAggregates("r")
    agg.apply(_eval_result(0, 0.2, []))
    agg.apply(_eval_result(10, 0.5, [5], {"gcd": 0.25, "spell_backward": 0.75}))
    agg.apply(_eval_result(5, 0.9, []))  # late and older: counted as read, not shown as latest
    for i, (task, rewards, scores) in enumerate([("gcd", [1.0, 0.0], [{"exact": 1.0}, {"exact": 0.0}]),
                                                 ("gcd", [1.0, 1.0], [{"exact": 1.0}, {"exact": 1.0}]),
                                                 ("spell_backward", [0.5, 0.5], [{}, {}])]):
        agg.apply(_trajectory(i, task, rewards, scores))
    snap = agg.snapshot()
    assert snap.latest_eval.version == 10 and snap.eval_skipped == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in SnapshotCollector(lambda: snap).collect() for s in m.samples}
    assert samples[("reel_eval_reward_mean", (("run", "r"),))] == 0.5
    assert samples[("reel_eval_pass_at_1", (("run", "r"),))] == 0.25
    assert samples[("reel_eval_policy_version", (("run", "r"),))] == 10
    assert samples[("reel_eval_task_reward_mean", (("run", "r"), ("task", "gcd")))] == 0.25
    assert samples[("reel_eval_skipped_versions_total", (("run", "r"),))] == 1
    assert samples[("reel_reward_task_mean", (("run", "r"), ("task", "gcd")))] == 0.75
    assert samples[("reel_reward_task_mean", (("run", "r"), ("task", "spell_backward")))] == 0.5
    assert samples[("reel_reward_part_mean", (("part", "exact"), ("run", "r")))] == 0.75
    console = Console(width=250, record=True)
    console.print(render(snap, "log"))
    text = console.export_text()
    assert "held-out eval" in text and "pass@4" in text and "task spell_backward" in text and "part exact" in text


def _write(path: Path, body: str) -> Path:
    path.write_text(TINY_MODEL_TOML + body)
    return path


RG_RUN = """
[run]
name = "rg"
steps = 4
[init]
warmup_steps = 30
[env]
name = "reasoning_gym"
[env.options]
tasks = {spell_backward = {weight = 1.0, min_word_len = 3, max_word_len = 5}, gcd = {weight = 1.0, max_value = 20}}
size = 200
template = "{question}"
[rollout]
concurrency = 4
group_size = 4
max_tokens = 8
[trainer]
batch_groups = 4
checkpoint_every = 2
max_off_policy_steps = 2
[eval]
every = 2
prompts = 8
samples_per_prompt = 4
"""


@pytest.mark.slow
def test_reasoning_gym_run_with_the_eval_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["run", str(_write(tmp_path / "rg.toml", RG_RUN)), "--out", str(run_dir), "--no-live"]) == 0
    with RunLog(run_dir, readonly=True) as log:
        results = [e for _, e in log.events("control") if isinstance(e, EvalResult)]
        tasks = {e.meta["task"] for _, e in log.events("trajectories") if isinstance(e, Trajectory)}
        entries = [e.meta["entry"] for _, e in log.events("trajectories") if isinstance(e, Trajectory)]
    # Versions 0, 2 and 4 are due; one scored later may list an earlier one as skipped.
    assert results and results[-1].version == 4
    assert sorted({r.version for r in results} | {v for r in results for v in r.skipped_versions}) == [0, 2, 4]
    assert all(r.prompts == 8 and r.samples_per_prompt == 4 and 0 <= r.pass_at_1 <= r.pass_at_k <= 1 for r in results)
    assert all(set(r.per_task) <= {"gcd", "spell_backward"} for r in results)
    assert tasks == {"gcd", "spell_backward"} and all({"question", "answer", "metadata"} <= set(e) for e in entries)
    capsys.readouterr()
    assert main(["eval", "--run", str(run_dir), "--version", "4"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline["version"] == 4 and offline["prompts"] == 8 and 0.0 <= offline["mean_reward"] <= 1.0
    with RunLog(run_dir, readonly=True) as log:
        v4 = next(e for _, e in log.events("weights") if isinstance(e, WeightsPublished) and e.version == 4)
    weights_file = tmp_path / "v4.safetensors"  # the version as one safetensors file
    weights_file.write_bytes(version_bytes(BlobStore(run_dir / "blobs"), v4.weights, v4.format))
    assert main(["eval", "--run", str(run_dir), "--weights", str(weights_file)]) == 0
    assert {k: v for k, v in json.loads(capsys.readouterr().out).items() if k not in ("version", "step", "wall_s")} == \
        {k: v for k, v in offline.items() if k not in ("version", "step", "wall_s")}
    assert main(["compare", str(run_dir), str(run_dir)]) == 0
    assert "held-out A" in capsys.readouterr().out
    assert main(["replay", "step", "4", "--run", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bitwise"] is True
    assert main(["eval", "--run", str(run_dir), "--version", "7"]) == 1
    assert "--version 7: " in capsys.readouterr().err


@pytest.mark.slow
def test_a_reward_function_that_raises_dead_letters_its_group_and_the_run_goes_on_and_rescoring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the roles import task_fixtures
    words = ["abc", "dog", "sun", "cat", "pen", "map", "owl", "fig"]
    rows = [{"prompt": f"reverse:{w}=", "answer": w[::-1], "extra_info": {"explode": i % 4 == 0}}
            for i, w in enumerate(words)]
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _write(tmp_path / "ds.toml", f"""
[run]
name = "ds"
steps = 3
[init]
warmup_steps = 20
[env]
name = "dataset"
[env.options]
path = "{data}"
reward = "task_fixtures:flaky_score"
[rollout]
concurrency = 4
group_size = 4
max_tokens = 6
[trainer]
batch_groups = 4
max_off_policy_steps = 2
""")
    run_dir = tmp_path / "run"
    monkeypatch.setenv("REEL_CRASH_AT", "2:committed")  # stopped mid-run and resumed: the draws go on
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 1
    monkeypatch.delenv("REEL_CRASH_AT")
    assert main(["run", str(config), "--out", str(run_dir), "--no-live", "--resume"]) == 0
    with RunLog(run_dir, readonly=True) as log:
        commits = [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]
        finished = [e for _, e in log.events("control") if isinstance(e, RunFinished)]
        started = [e for _, e in log.events("control") if type(e).__name__ == "RunStarted"]
        logged = [e for _, e in log.events("trajectories") if isinstance(e, Trajectory)]
    assert [c.step for c in commits] == [1, 2, 3]
    assert finished[-1].dead_letters >= 1
    assert all(not rows[t.meta["index"]]["extra_info"]["explode"] for t in logged)  # none of them was trained on
    rollout_log = (run_dir / "roles" / "rollout-0.log").read_text()
    assert "reward function 'task_fixtures:flaky_score' raised KeyError" in rollout_log
    assert math.isfinite(commits[-1].loss)
    assert started[0].dataset_sha256 == hashlib.sha256(b"words.jsonl\0" + data.read_bytes()).hexdigest()

    # Training draws walk the 8 rows in epochs: draw n is row order(run.seed, n // 8)[n % 8], once each
    # across the resume (the restarted worker found its draws and went on), and the log has them.
    env, seed = make_env(loads(config.read_text()).env, 16), loads(config.read_text()).run.seed
    draws = [t.meta["draw"] for t in logged]
    assert len(set(draws)) == len(draws) and max(t.meta["epoch"] for t in logged) >= 1
    assert all(t.meta["epoch"] == t.meta["draw"] // len(words)
               and t.meta["index"] == env.order(seed, t.meta["epoch"])[t.meta["draw"] % len(words)] for t in logged)

    async def recovered() -> set[int]:
        client = connect(redis_url)  # not the run's bus (gone): only the log has its draws
        try:
            return await recover_draws(client, run_dir, "ds", "rollout:0", None)
        finally:
            await client.aclose()

    assert asyncio.run(recovered()) == set(draws)

    # The log keeps what the reward needs: the run re-scored offline with another reward function.
    override = tmp_path / "rescore.toml"
    override.write_text(f'[env]\noptions = {{path = "{data}", reward = "task_fixtures:length_score"}}\n')
    retrained = tmp_path / "retrained"
    assert main(["retrain", "--from", str(run_dir), "--out", str(retrained), "--config", str(override), "--rescore"]) == 0
    tok = CharTokenizer()
    with RunLog(retrained, readonly=True) as log:
        rescored = [e for _, e in log.events("trajectories") if isinstance(e, Trajectory)]
    assert {t.group_id for t in rescored} == {g for c in commits for g in c.groups}  # B logs the groups it trained on
    original = {t.group_id: [x.reward for x in t.samples] for t in logged}
    assert any([x.reward for x in t.samples] != original[t.group_id] for t in rescored)
    for trajectory in rescored:
        for sample in trajectory.samples:
            ids = sample.tokens.numpy().tolist()
            text = tok.decode(ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids, skip_special=True)
            assert sample.reward == min(len(text.strip()), 6) / 6
