"""Supervised warm-start: a policy that sometimes solves the task, so RL has something to improve.

Deterministic (seeded data, deterministic algorithms, one thread) and cached by a hash of what
determines it (model, init and env sections, seed, code), so repeated runs and tests pay once.
`init.warmup_noise` is the share of examples whose answer is shuffled: the start stays imperfect.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from producers.envs import Env, make_env
from runtime.config import Config
from runtime.initial_policy import code_version
from runtime.model.config import MoEConfig
from runtime.model.determinism import set_determinism
from runtime.model.model import MoEModel
from runtime.model.weights import load, save

log = logging.getLogger("reel.warmstart")


def model_config(config: Config, env: Env) -> MoEConfig:
    """The run's MoE config; vocab_size 0 means the environment tokenizer's vocabulary."""
    keys = msgspec.structs.asdict(config.model)
    keys.pop("path")
    keys["vocab_size"] = keys["vocab_size"] or env.tokenizer.vocab_size
    return MoEConfig(**keys)


def cache_dir() -> Path:
    return Path(os.environ.get("REEL_CACHE", Path.home() / ".cache" / "reel")) / "warmstart"


def warm_start(config: Config) -> MoEModel:
    env = make_env(config.env, config.rollout.max_tokens)
    mcfg = model_config(config, env)
    key = hashlib.sha256(msgspec.json.encode([
        mcfg, config.init, config.env, config.run.seed, config.rollout.max_tokens, code_version(),
    ])).hexdigest()[:16]
    cached = cache_dir() / key
    if (cached / "config.json").is_file():
        log.info("warm-start %s from cache %s", key, cached)
        return load(cached)
    model = train(mcfg, config, env)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cached.parent))
    try:
        save(model, staging)
        staging.rename(cached)
    except OSError:
        if not (cached / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model


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
        input_ids_BT, mask_BT, targets_BT, loss_mask_BT = _batch(env, rng, config.init.warmup_batch,
                                                                config.init.warmup_noise)
        logits_BTV = model(input_ids_BT, mask_BT).logits
        loss = F.cross_entropy(logits_BTV[loss_mask_BT], targets_BT[loss_mask_BT])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            log.info("warm-start step %d/%d loss %.3f", step + 1, steps, loss.item())
    torch.set_num_threads(threads)
    return model


def _batch(env: Env, rng: random.Random, size: int, noise: float):
    rows = []
    for _ in range(size):
        prompt = env.sample(rng)
        answer = list(prompt.answer)
        if rng.random() < noise:
            rng.shuffle(answer)
        completion = env.tokenizer.encode("".join(answer)) + [env.tokenizer.eos_id]
        rows.append((prompt.ids, completion))
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
