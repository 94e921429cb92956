"""The eval role: held-out scores of policy versions, published as EvalResult events (control stream).

    follow the `weights` stream -> the newest version due ([eval] every = N: 0, N, 2N, ... and the
    last, run.steps) -> load it into this role's own engine, the way a rollout worker does
    (make_engine + engine.update_weights) -> `prompts` held-out prompts x
    `samples_per_prompt` samples -> EvalResult(mean reward, pass@1, pass@k, per task)
    exit once the last version is scored

It never slows the trainer: nothing waits for it. When versions arrive faster than it scores them
it takes the newest due one and lists the due versions it passed over in `skipped_versions`.
Here in producers/ because it runs an engine and an env like a rollout worker; it reads the bus like
a consumer. `reel eval --run DIR --version V | --weights FILE` scores one version offline and prints
the same figures as one JSON line.

pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) per prompt with n
samples of which c pass (reward >= eval.pass_threshold), averaged over prompts; k = n here, and
pass@1 = mean c / n. The held-out prompts are the same at every version: drawn from Env.held_out()
with eval.seed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import msgspec

from reel.bus.errors import ReelError
from reel.bus.events import EvalResult, WeightsPublished
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.seqs import recover_seq
from reel.bus.streams import Publisher, connect
from reel.bus.tail import Tail
from reel.producers.engine import Engine, SamplingParams
from reel.producers.envs import Env, Prompt, make_env
from reel.producers.episode import scored_group
from reel.producers.tool_calls import ToolCalls
from reel.producers.make_engine import make_engine
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load
from reel.runtime.train.initial_policy import init_dir
from reel.runtime.tokenizer import load_tokenizer
from reel.runtime.weights.load import engine_weights
from reel.runtime.role_loop import serve

log = logging.getLogger("reel.eval")
PRODUCER = "eval:0"


class EvalError(ReelError):
    """A version that cannot be evaluated as asked (not published, weights gone)."""


class Scores(msgspec.Struct):
    """One version's held-out figures (EvalResult without the event stamp)."""

    env: str
    prompts: int  # prompts scored (a prompt whose reward function failed is left out and counted)
    samples_per_prompt: int
    mean_reward: float
    pass_at_1: float
    pass_at_k: float
    per_task: dict[str, float]
    failed_prompts: int = 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn from n (c of them passing) passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_env(config: Config) -> Env:
    """[eval.env] if given, else the run's env's held-out split, on the run's tokenizer."""
    tokenizer = load_tokenizer(config.model.path)
    max_tokens = config.eval.max_tokens or config.rollout.max_tokens
    if config.eval.env is not None:
        return make_env(config.eval.env, max_tokens, tokenizer)
    return make_env(config.env, max_tokens, tokenizer).held_out()


def held_out_prompts(env: Env, config: Config) -> list[Prompt]:
    rng = random.Random(config.eval.seed)
    return [env.sample(rng) for _ in range(config.eval.prompts)]


async def score(engine: Engine, env: Env, prompts: list[Prompt], config: Config) -> Scores:
    """Sample and score every prompt on the engine's current weights."""
    e = config.eval
    seeds = [_seed(e.seed, i) for i in range(len(prompts))]
    calls = ToolCalls.from_section(config.rollout)
    try:
        groups = await asyncio.gather(*(_group(engine, env, p, config, seed, calls) for p, seed in zip(prompts, seeds)))
    finally:
        calls.close()
    scored = [(p, rewards) for p, rewards in zip(prompts, groups) if rewards is not None]
    k = e.samples_per_prompt
    flat = [r for _, rewards in scored for r in rewards]
    passing = [sum(r >= e.pass_threshold for r in rewards) for _, rewards in scored]
    by_task: dict[str, list[float]] = defaultdict(list)
    for prompt, rewards in scored:
        by_task[_task_of(prompt)] += rewards
    return Scores(env=env.name, prompts=len(scored), samples_per_prompt=k,
                  mean_reward=_mean(flat), pass_at_1=_mean([c / k for c in passing]),
                  pass_at_k=_mean([pass_at_k(k, c, k) for c in passing]),
                  per_task={t: _mean(v) for t, v in sorted(by_task.items())} if len(by_task) > 1 else {},
                  failed_prompts=len(prompts) - len(scored))


async def _group(engine: Engine, env: Env, prompt: Prompt, config: Config, seed: int,
                 calls: ToolCalls) -> list[float] | None:
    e = config.eval
    params = SamplingParams(n=e.samples_per_prompt, temperature=e.temperature, top_p=1.0,
                            max_tokens=e.max_tokens or config.rollout.max_tokens,
                            stop_token_ids=env.tokenizer.stop_ids, seed=seed)
    episodes = await scored_group(engine, env, prompt, params, calls, "eval")
    return None if episodes is None else [episode.reward for episode in episodes]


def _task_of(prompt: Prompt) -> str:
    return str(prompt.meta.get("task") or prompt.meta.get("data_source") or prompt.meta.get("env", ""))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _seed(eval_seed: int, index: int) -> int:
    digest = hashlib.sha256(f"reel-eval:{eval_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def due(version: int, every: int, last: int) -> bool:
    return version % every == 0 or version == last


class EvalRole:
    """Follows WeightsPublished; scores the newest due version; publishes EvalResult."""

    # Fixed at construction.
    run_dir: Path
    url: str
    config: Config
    env: Env
    prompts: list[Prompt]
    # Progress.
    engine: Engine | None
    evaluated: int  # newest version scored (-1 = none)
    skipped: list[int]  # due versions passed over since the last result

    def __init__(self, run_dir: Path, url: str, config: Config) -> None:
        self.run_dir, self.url, self.config = Path(run_dir), url, config
        self.env = eval_env(config)
        self.prompts = held_out_prompts(self.env, config)
        self.engine = None
        self.evaluated = -1
        self.skipped = []

    async def run(self, stop: asyncio.Event) -> None:
        c = self.config
        redis = connect(self.url)
        try:
            seq = await recover_seq(redis, self.run_dir, c.run.name, PRODUCER, ["control"], c.bus.partitions)
            publisher = Publisher(redis, c.run.name, PRODUCER, seq)
            published: dict[int, WeightsPublished] = {}
            async with Tail(self.url, c.run.name, ["weights"], start="0") as tail:
                while not stop.is_set() and self.evaluated < c.run.steps:
                    for _, _, event in await tail.read(count=100, block_ms=1000):
                        if isinstance(event, WeightsPublished):
                            published[event.version] = event
                    target = self._next(published)
                    if target is not None:
                        await publisher.publish([publisher.stamp(EvalResult, **await self._evaluate(target))])
        finally:
            if self.engine is not None:
                await self.engine.close()
            await asyncio.shield(redis.aclose())

    def _next(self, published: dict[int, WeightsPublished]) -> WeightsPublished | None:
        """The newest due version not yet scored; the due ones older than it are skipped (and said so)."""
        c = self.config
        waiting = sorted(v for v in published if v > self.evaluated and due(v, c.eval.every, c.run.steps))
        if not waiting:
            return None
        self.skipped += waiting[:-1]
        if waiting[:-1]:
            log.info("eval: behind the trainer, skipping versions %s", waiting[:-1])
        return published[waiting[-1]]

    async def _evaluate(self, weights: WeightsPublished) -> dict:
        started = time.monotonic()
        blobs = run_blobs(self.run_dir, self.config)
        if self.engine is None:
            self.engine = await asyncio.to_thread(make_engine, self.config, init_dir(self.run_dir), blobs)
            await self.engine.start()
        loaded = await asyncio.to_thread(engine_weights, blobs, weights.weights, weights.format)
        await self.engine.update_weights(loaded, weights.version, ref=weights.weights)
        scores = await score(self.engine, self.env, self.prompts, self.config)
        skipped, self.skipped, self.evaluated = self.skipped, [], weights.version
        log.info("eval: version %d mean reward %.3f pass@1 %.3f", weights.version, scores.mean_reward, scores.pass_at_1)
        fields = msgspec.structs.asdict(scores)
        fields.pop("failed_prompts")
        return {**fields, "version": weights.version, "step": weights.step, "skipped_versions": skipped,
                "wall_s": time.monotonic() - started}


def main(run_dir: Path, bus_url: str) -> int:
    """`reel role eval`: run until the last version is scored, or SIGTERM/SIGINT."""
    config = load(Path(run_dir) / "config.toml")
    logging.basicConfig(level=config.log.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    role = EvalRole(Path(run_dir), bus_url, config)

    serve(role.run)
    return 0


def main_cli(args: argparse.Namespace) -> int:
    """`reel eval --run DIR --version V | --weights FILE`: one version's held-out scores as one JSON line."""
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise EvalError(f"{run_dir} is not a Reel run directory (no config.toml); pass the run's directory")
    config = load(run_dir / "config.toml")
    if args.prompts is not None:
        config = msgspec.structs.replace(config, eval=msgspec.structs.replace(config.eval, prompts=args.prompts))
    if not (init_dir(run_dir) / "config.json").is_file():
        raise EvalError(f"{run_dir} has no initial policy ({init_dir(run_dir)}); the run never started its trainer")
    weights, version, step, fmt = _weights_to_load(run_dir, args)
    env = eval_env(config)
    prompts = held_out_prompts(env, config)

    async def evaluate() -> Scores:
        blobs = run_blobs(run_dir, config)
        engine = make_engine(config, init_dir(run_dir), blobs)
        await engine.start()
        try:
            loaded = weights if fmt == "file" else await asyncio.to_thread(engine_weights, blobs, weights, fmt)
            await engine.update_weights(loaded, max(version, 0), ref=None if fmt == "file" else weights)
            return await score(engine, env, prompts, config)
        finally:
            await engine.close()

    started = time.monotonic()
    scores = asyncio.run(evaluate())
    print(json.dumps({"version": version, "step": step, **msgspec.structs.asdict(scores),
                      "wall_s": round(time.monotonic() - started, 3)}))
    return 0


def _weights_to_load(run_dir: Path, args: argparse.Namespace):
    """(weights, version, step, format): a file's tensors ("file"), or a logged version's BlobRef and format."""
    if args.weights is not None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(args.weights), -1, -1, "file"
        except (OSError, SafetensorError) as exc:
            raise EvalError(f"--weights {args.weights}: not a readable safetensors file ({exc})") from exc
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            found = [e for _, e in run_log.events("weights") if isinstance(e, WeightsPublished)
                     and e.version == args.version] if "weights" in run_log.names() else []
    except LogError as exc:
        raise EvalError(f"cannot read the log of {run_dir}: {exc}") from exc
    if not found:
        raise EvalError(f"--version {args.version}: {run_dir}'s log has no WeightsPublished for that version")
    return found[-1].weights, args.version, found[-1].step, found[-1].format  # a deleted version: BlobError
