"""Supervised warm-start: a policy that sometimes solves the task, so RL has something to improve.

Deterministic (seeded data, deterministic algorithms, one thread) and cached by a hash of what
determines it (model, init and env sections, seed, sampling, code), so repeated runs and tests pay once.

`init.warmup_noise` is the label smoothing of the supervised loss: that share of every target's
probability goes uniformly to the whole vocabulary. The policy learns which token is right (its
greedy answer is mostly correct) but samples a wrong one often, so its sampled reward starts low
and RL has a skill to sharpen rather than one to discover from scratch, which takes GRPO far more
samples than supervision. The mean sampled reward of the result (rollout temperature and top_p,
EVAL_PROMPTS prompts) is logged, cached runs included, as the baseline RL should improve on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import tempfile
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from producers.envs import Env, make_env
from producers.sampling import sample_tokens
from runtime.config import Config, cache_dir
from runtime.initial_policy import code_version
from runtime.model.config import MoEConfig
from runtime.model.determinism import set_determinism
from runtime.model.model import MoEModel
from runtime.model.weights import load, save

log = logging.getLogger("reel.warmstart")
EVAL_PROMPTS = 256
EVAL_FILE = "warmstart.json"  # next to the cached weights: {"reward_mean": ..., "prompts": ...}


def model_config(config: Config, env: Env) -> MoEConfig:
    """The run's MoE config; vocab_size 0 means the environment tokenizer's vocabulary."""
    keys = msgspec.structs.asdict(config.model)
    keys.pop("path")
    keys["vocab_size"] = keys["vocab_size"] or env.tokenizer.vocab_size
    return MoEConfig(**keys)


def warm_start(config: Config) -> tuple[MoEModel, float]:
    """The warm-started policy and its mean sampled reward (cached)."""
    env = make_env(config.env, config.rollout.max_tokens)
    mcfg = model_config(config, env)
    r = config.rollout
    recipe = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # this file decides the result too
    key = hashlib.sha256(msgspec.json.encode([
        mcfg, config.init, config.env, config.run.seed, r.max_tokens, r.temperature, r.top_p, code_version(), recipe,
    ])).hexdigest()[:16]
    cached = cache_dir("warmstart") / key
    if (cached / "config.json").is_file() and (cached / EVAL_FILE).is_file():
        reward = json.loads((cached / EVAL_FILE).read_text())["reward_mean"]
        log.info("warm-start %s from cache %s: mean sampled reward %.3f", key, cached, reward)
        return load(cached), reward
    model = train(mcfg, config, env)
    reward = sampled_reward(model, env, config)
    log.info("warm-start %s: mean sampled reward %.3f over %d prompts (temperature %g, top_p %g)", key, reward,
             EVAL_PROMPTS, r.temperature, r.top_p)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cached.parent))
    try:
        save(model, staging)
        (staging / EVAL_FILE).write_text(json.dumps({"reward_mean": reward, "prompts": EVAL_PROMPTS}))
        staging.rename(cached)
    except OSError:
        if not (cached / EVAL_FILE).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model, reward


def train(mcfg: MoEConfig, config: Config, env: Env) -> MoEModel:
    threads = torch.get_num_threads()
    set_determinism(config.run.seed, threads=1)
    model = MoEModel(mcfg)
    steps = config.init.warmup_steps
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
    torch.set_num_threads(threads)
    return model


def sampled_reward(model: MoEModel, env: Env, config: Config) -> float:
    """Mean reward of one sample on each of EVAL_PROMPTS seeded prompts, drawn as the engine draws them."""
    r = config.rollout
    rng = random.Random(f"warmstart-eval-{config.run.seed}")
    prompts = [env.sample(rng) for _ in range(EVAL_PROMPTS)]
    generators = [torch.Generator().manual_seed(config.run.seed * 1_000_003 + i) for i in range(len(prompts))]
    rows = [list(p.ids) for p in prompts]  # every row grows by one token per step; finished rows by padding
    completions: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    sampling = r.temperature > 0
    temperature_B = torch.full((len(rows),), r.temperature)
    top_p_B = torch.full((len(rows),), r.top_p if sampling else 1.0)
    model.eval()
    for _ in range(r.max_tokens):
        T = max(len(row) for row in rows)
        input_ids_BT = torch.zeros(len(rows), T, dtype=torch.long)
        mask_BT = torch.zeros(len(rows), T, dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids_BT[b, :len(row)] = torch.tensor(row)
            mask_BT[b, :len(row)] = 1
        with torch.no_grad():
            logits_BTV = model(input_ids_BT, mask_BT).logits
        last_BV = logits_BTV[torch.arange(len(rows)), mask_BT.sum(1) - 1].float()
        u_B = torch.stack([torch.rand((), generator=g) for g in generators]) if sampling else torch.zeros(len(rows))
        tokens_B, _ = sample_tokens(last_BV, temperature_B, top_p_B, u_B, nucleus=sampling and r.top_p < 1)
        for b, token in enumerate(tokens_B.tolist()):
            rows[b].append(env.tokenizer.pad_id if done[b] else token)
            if not done[b]:
                completions[b].append(token)
                done[b] = token == env.tokenizer.eos_id
        if all(done):
            break
    return sum(env.reward(p, c) for p, c in zip(prompts, completions)) / len(prompts)


def _batch(env: Env, rng: random.Random, size: int):
    rows = []
    for _ in range(size):
        prompt = env.sample(rng)
        rows.append((prompt.ids, env.reference(prompt)))
    T = max(len(p) + len(c) - 1 for p, c in rows)
    input_ids = torch.zeros(size, T, dtype=torch.long)
    mask = torch.zeros(size, T, dtype=torch.long)
    targets = torch.zeros(size, T, dtype=torch.long)
    loss_mask = torch.zeros(size, T, dtype=torch.bool)
    for b, (p, c) in enumerate(rows):
        n = len(p) + len(c) - 1
        input_ids[b, :n] = torch.tensor(p + c[:-1])
        mask[b, :n] = 1
        targets[b, len(p) - 1:n] = torch.tensor(c)
        loss_mask[b, len(p) - 1:n] = True
    return input_ids, mask, targets, loss_mask
