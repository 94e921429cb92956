"""Supervised warm-start: a policy that sometimes solves the task, so RL has something to improve.

It trains on the env's demonstrations (every model turn of an ideal episode; env turns are
context only). It starts from random weights, or from model.path's checkpoint when
init.warmup_steps > 0 is set for one. Deterministic (seeded data, deterministic algorithms, one
thread) and, for models built from keys, cached by a hash of what determines it (model, init and
env sections, seed, sampling, code), so repeated runs and tests pay once.

`init.warmup_noise` is the label smoothing of the supervised loss: that share of every target's
probability goes uniformly to the whole vocabulary. The policy learns which token is right (its
greedy answer is mostly correct) but samples a wrong one often, so its sampled reward starts low
and RL has a skill to sharpen rather than one to discover from scratch, which takes GRPO far more
samples than supervision. The mean sampled reward of the result (one episode on each of
EVAL_PROMPTS prompts, run by the built-in engine as a rollout worker runs it: rollout temperature,
top_p and max_tokens, the same multi-turn loop) is logged, cached runs included, as the baseline
RL should improve on.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import inspect
import json
import logging
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import SamplingParams
from reel.producers.envs import Env, env_for
from reel.producers.envs.rewards import RewardError
from reel.producers.episode import scored_group
from reel.producers.tool_calls import ToolCalls
from reel.runtime.config.sections import Config
from reel.runtime.config.run import cache_dir, warmup_steps
from reel.runtime.train.initial_policy import code_version
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.determinism import set_determinism
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load, save
from reel.runtime.work_progress import report

log = logging.getLogger("reel.warmstart")
EVAL_PROMPTS = 256
EVAL_FILE = "warmstart.json"  # next to the cached weights: {"reward_mean": ..., "prompts": ...}


def model_config(config: Config, env: Env) -> MoEConfig:
    """The MoE config of the [model] keys (vocab_size 0 = the env tokenizer's)."""
    keys = msgspec.structs.asdict(config.model)
    keys.pop("path")
    keys["vocab_size"] = keys["vocab_size"] or env.tokenizer.vocab_size
    return MoEConfig(**keys)


def warm_start(config: Config) -> tuple[MoEModel, float]:
    """The warm-started policy and its mean sampled reward (cached unless it starts from model.path)."""
    env = env_for(config)
    if config.model.path:
        model = train(config, env, lambda: load(config.model.path))
        return model, _logged_reward(model, env, config, "from " + config.model.path)
    mcfg = model_config(config, env)
    r = config.rollout
    # This file and the env's module decide the result too (demonstrations, prompts).
    recipe = hashlib.sha256(Path(__file__).read_bytes() + Path(inspect.getfile(type(env))).read_bytes()).hexdigest()
    key = hashlib.sha256(msgspec.json.encode([
        mcfg, config.init, config.env, config.run.seed, r.max_tokens, r.temperature, r.top_p, code_version(), recipe,
    ])).hexdigest()[:16]
    cached = cache_dir("warmstart") / key
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Processes that need the same warm-start at once (test workers, a rerun beside a run) wait for
    # the one computing it instead of each paying for it.
    with open(cached.parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cached / "config.json").is_file() and (cached / EVAL_FILE).is_file():
            reward = json.loads((cached / EVAL_FILE).read_text())["reward_mean"]
            log.info("warm-start %s from cache %s: mean sampled reward %.3f", key, cached, reward)
            report("warm-start", 1, 1, f"from the cache {cached} (REEL_CACHE moves the cache)")
            return load(cached), reward
        report("warm-start", 0, warmup_steps(config), f"cached in {cached} for later runs (REEL_CACHE moves the cache)")
        model = train(config, env, lambda: MoEModel(mcfg))
        reward = _logged_reward(model, env, config, key)
        _store(model, reward, cached)
    return model, reward


def _store(model: MoEModel, reward: float, cached: Path) -> None:
    """Written aside and renamed into place, so a reader never sees half a cache entry."""
    staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        save(model, staging)
        (staging / EVAL_FILE).write_text(json.dumps({"reward_mean": reward, "prompts": EVAL_PROMPTS}))
        staging.rename(cached)
    except OSError:
        if not (cached / EVAL_FILE).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _logged_reward(model: MoEModel, env: Env, config: Config, what: str) -> float:
    r = config.rollout
    reward = sampled_reward(model, env, config)
    log.info("warm-start %s: mean sampled reward %.3f over %d prompts (temperature %g, top_p %g)", what, reward,
             EVAL_PROMPTS, r.temperature, r.top_p)
    return reward


def train(config: Config, env: Env, start: Callable[[], MoEModel]) -> MoEModel:
    """The model `start` builds (after seeding: a random init is seeded too), then trained for
    init.warmup_steps supervised steps."""
    threads = torch.get_num_threads()
    set_determinism(config.run.seed, threads=1)
    model = start()
    steps = warmup_steps(config)
    if steps == 0:
        return model
    rng = random.Random(f"warmstart-{config.run.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.init.warmup_lr, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    model.train()
    for step in range(steps):
        input_ids_BT, mask_BT, targets_BT, loss_mask_BT = _batch(env, rng, config.init.warmup_batch)
        logits_BTV = model(input_ids_BT, mask_BT).logits
        loss = F.cross_entropy(logits_BTV[loss_mask_BT], targets_BT[loss_mask_BT],
                               label_smoothing=config.init.warmup_noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            log.info("warm-start step %d/%d loss %.3f", step + 1, steps, loss.item())
        report("warm-start", step + 1, steps)
    torch.set_num_threads(threads)
    return model


def sampled_reward(model: MoEModel, env: Env, config: Config) -> float:
    """Mean reward of one episode on each of EVAL_PROMPTS seeded prompts, sampled by the built-in engine."""
    return asyncio.run(_episodes_reward(model, env, config))


async def _episodes_reward(model: MoEModel, env: Env, config: Config) -> float:
    r = config.rollout
    rng = random.Random(f"warmstart-eval-{config.run.seed}")
    prompts = [env.sample(rng) for _ in range(EVAL_PROMPTS)]
    model.eval()
    finished = 0

    async def episode(engine: BuiltinEngine, i: int, prompt):
        nonlocal finished
        group = await scored_group(engine, env, prompt, SamplingParams(
            n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
            stop_token_ids=env.tokenizer.stop_ids, seed=config.run.seed * 1_000_003 + i), calls, "warm-start reward")
        finished += 1
        report("warm-start evaluation", finished, len(prompts))
        return group

    calls = ToolCalls.from_section(r)
    try:
        async with BuiltinEngine(model, max_batch=config.engine.max_batch,
                                 max_seq_len=config.engine.max_seq_len) as engine:
            groups = await asyncio.gather(*(episode(engine, i, prompt) for i, prompt in enumerate(prompts)))
    finally:
        calls.close()
    episodes = [g[0] for g in groups if g is not None]
    if not episodes:
        raise RewardError(f"the reward failed on every one of the warm-start's {EVAL_PROMPTS} prompts; "
                          "fix the env's reward function")
    turns = [len(e.turn_lengths) for e in episodes]
    log.info("warm-start episodes: %.2f model turns on average, at most %d", sum(turns) / len(turns), max(turns))
    return sum(e.reward for e in episodes) / len(episodes)


def _batch(env: Env, rng: random.Random, size: int):
    """`size` demonstrations: targets on the model's turns only (env turns are context)."""
    rows: list[tuple[list[int], list[int], list[bool]]] = []
    for _ in range(size):
        prompt = env.sample(rng)
        turns = env.demonstration(prompt)
        tokens = [t for turn in turns for t in turn]
        sampled = [i % 2 == 0 for i, turn in enumerate(turns) for _ in turn]  # model turns are the even ones
        rows.append((prompt.ids, tokens, sampled))
    T = max(len(p) + len(c) - 1 for p, c, _ in rows)
    input_ids = torch.zeros(size, T, dtype=torch.long)
    mask = torch.zeros(size, T, dtype=torch.long)
    targets = torch.zeros(size, T, dtype=torch.long)
    loss_mask = torch.zeros(size, T, dtype=torch.bool)
    for b, (p, c, sampled) in enumerate(rows):
        n = len(p) + len(c) - 1
        input_ids[b, :n] = torch.tensor(p + c[:-1])
        mask[b, :n] = 1
        targets[b, len(p) - 1:n] = torch.tensor(c)
        loss_mask[b, len(p) - 1:n] = torch.tensor(sampled)
    return input_ids, mask, targets, loss_mask
