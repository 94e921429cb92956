"""Build a short finished run without Redis, deterministically, for replay and retrain tests.

The run directory looks like one `reel run` leaves behind: config.toml, init/ (the warm-started
version-0 policy), blobs/ (weights after every step, checkpoints every `checkpoint_every`) and a
log written through reel.bus.run_log.RunLog with the events the roles would have published: RunStarted,
WeightsPublished, Trajectory + RoutingTrace per group, StepCommitted per step and, as the mismatch role
(consumers/mismatch.py) would, a MismatchSplit per step (`split`; "metrics" writes a log of before that
role, the split inside StepCommitted.metrics; "none" one without any split).

Rollouts come from a small sampling loop over `MoEModel.forward` (the full sequence each token, so
no KV cache), on its own copy of the weights at `engine_precision`: an engine in bf16 records
routing and logprobs that differ from the fp32 trainer, as a real one does. Groups of step s are
sampled under policy version s-1 or, every other group, s-2 switching to s-1 halfway through its
completions (staleness 0 and 1, two-span samples). Steps are `train_step` exactly as the trainer
calls it.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import (
    AnyEvent, MismatchSplit, RoutingTrace, RunStarted, Sample, StepCommitted, StepTiming, Tensor, Trajectory,
    WeightsPublished, encode,
)
from reel.bus.run_log import RunLog
from reel.producers.envs import Env, make_env
from reel.runtime.checkpoint import single as checkpoint
from reel.runtime.config import run as config_mod
from reel.runtime.train.batch import Group, build_batch
from reel.runtime.config.sections import Config
from reel.runtime.train.initial_policy import code_version, ensure_initial_policy, load_initial_model
from reel.runtime.train.mismatch_split import WeightHistory, step_split
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import state_dict_bytes
from reel.runtime.train.step import TrainState, make_optimizer, train_step
from reel.producers.warmstart import warm_start

# The tiny MoE of the tests that start real `reel` processes (a TOML section for their configs).
TINY_MODEL_TOML = """[model]
hidden_size = 32
moe_intermediate_size = 32
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
num_experts = 4
num_experts_per_tok = 2
"""

# The run of the tests that start real `reel run` processes (with TINY_MODEL_TOML); see e2e_config.
E2E: dict[str, dict[str, Any]] = {
    "init": {"warmup_steps": 30},
    "env": {"min_len": 2, "max_len": 4},
    "rollout": {"concurrency": 4, "group_size": 4, "async_level": 1, "max_tokens": 6},
    "trainer": {"batch_groups": 4, "checkpoint_every": 2, "max_off_policy_steps": 2},
    # The mismatch role (on by default: every = 1) costs each run ~6 CPU seconds, half of them torch's
    # import: off here, on (MISMATCH_ROLE) in the whole-run tests that look at it or at every process.
    "mismatch": {"every": 0},
}
MISMATCH_ROLE = {"mismatch": {"every": 1}}


def e2e_config(path: Path, name: str, steps: int, overrides: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write the E2E run config (any key overridden per test) as TOML to `path`; returns it."""
    sections = {"run": {"name": name, "steps": steps}, **{s: dict(keys) for s, keys in E2E.items()}}
    for section, keys in (overrides or {}).items():
        sections.setdefault(section, {}).update(keys)
    text = TINY_MODEL_TOML + "".join(f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                                     for section, keys in sections.items())
    path.write_text(text)
    return path


# A tiny MoE and a short run; any key can be overridden per test.
BASE: dict[str, dict[str, Any]] = {
    "run": {"name": "replaytest", "seed": 7, "steps": 4},
    "model": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
              "num_experts_per_tok": 2, "max_position_embeddings": 64},
    "init": {"warmup_steps": 40, "warmup_batch": 16},
    "env": {"name": "reverse_text", "min_len": 3, "max_len": 5},
    "rollout": {"group_size": 4, "concurrency": 4, "max_tokens": 8, "async_level": 1},
    "trainer": {"batch_groups": 2, "checkpoint_every": 2, "router_replay": True, "precision": "fp32"},
}


def make_config(overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    raw = {section: dict(keys) for section, keys in BASE.items()}
    for section, keys in (overrides or {}).items():
        raw.setdefault(section, {}).update(keys)
    return config_mod.from_dict(raw, source="runbuilder")


def build_run(run_dir: Path, overrides: dict[str, dict[str, Any]] | None = None, *,
              engine_precision: str = "bf16", stale: bool = True, split: str = "event") -> Path:
    """Write a finished run of config.run.steps steps into `run_dir` (created) and return it.

    `stale`: every other group of a step after the first starts one version behind (else none).
    `split`: where the mismatch split goes: "event" (MismatchSplit), "metrics" (older logs), "none"."""
    config = make_config(overrides)
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config_mod.to_toml(config))
    ensure_initial_policy(run_dir, config, warm_start)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.trainer.threads or 1)  # the trainer role's thread count
    try:
        with _Writer(run_dir, config) as writer:
            writer.run(engine_precision, stale, split)
    finally:
        torch.set_num_threads(threads)
    return run_dir


class _Writer:
    """Plays rollout worker, trainer and archiver in one process, in the order they would act."""

    def __init__(self, run_dir: Path, config: Config):
        self.config = config
        self.blobs = BlobStore(run_dir / "blobs")
        self.log = RunLog(run_dir)
        self.env: Env = make_env(config.env, config.rollout.max_tokens)
        self.model = load_initial_model(run_dir)
        self.engine = load_initial_model(run_dir)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # policy version -> weights
        self.history = WeightHistory(self.blobs)  # the trainer's view of them: the mismatch split
        self.seq = 0
        self.entry = 0

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.close()

    def run(self, engine_precision: str, stale: bool, split: str) -> None:
        config = self.config
        self.engine.precision = engine_precision
        state = TrainState(self.model, make_optimizer(self.model, config.trainer), 0)
        self._append("control", RunStarted, config_toml=config_mod.to_toml(config), seed=config.run.seed,
                     code_version=code_version(), model_config=self.model.config.to_hf_dict(),
                     config_hash=config_mod.config_hash(config))
        self._publish_weights(state)
        for step in range(1, config.run.steps + 1):
            groups = [self._rollout(step, g, stale and g % 2 == 1 and step >= 2)
                      for g in range(config.trainer.batch_groups)]
            batch = build_batch(groups)
            figures = step_split(state.model, batch, config.trainer, state.step, self.history.get) \
                if split != "none" else None
            started = time.perf_counter()  # the split is not the trainer's work
            state, result = train_step(state, batch, config)
            compute = time.perf_counter() - started
            weights = self._publish_weights(state)
            ckpt = None
            if step % config.trainer.checkpoint_every == 0 or step == config.run.steps:
                ckpt = self.blobs.put(checkpoint.checkpoint_bytes(state))
            self._append(
                "steps", StepCommitted, step=step, version=step, groups=[g.trajectory.group_id for g in groups],
                dropped=[], loss=result.loss, grad_norm=result.grad_norm, weights_sha256=result.weights_sha256,
                timing=StepTiming(wait=0.0, compute=compute, publish=0.0),
                metrics=result.metrics | (figures.figures if split == "metrics" else {}),
                staleness=result.staleness, checkpoint=ckpt, config_hash=config_mod.config_hash(config),
                code_version=code_version())
            if split == "event":
                self._append("steps", MismatchSplit, step=step, figures=figures.figures, versions=figures.versions,
                             missing_versions=figures.missing)
            assert result.weights_sha256 == weights.sha256

    def _publish_weights(self, state: TrainState):
        self.versions[state.step] = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
        ref = self.blobs.put(state_dict_bytes(state.model))
        self.history.add(state.step, ref)
        self._append("weights", WeightsPublished, version=state.step, step=state.step, weights=ref)
        return ref

    def _rollout(self, step: int, index: int, stale: bool) -> Group:
        """Sample one GRPO group for `step`, log its Trajectory and RoutingTrace, return it."""
        config, rollout = self.config, self.config.rollout
        rng = random.Random(f"{config.run.seed}-{step}-{index}")
        prompt = self.env.sample(rng)
        spans = [(0, step - 2), (rollout.max_tokens // 2, step - 1)] if stale else [(0, step - 1)]
        seed = rng.randrange(1 << 30)
        tokens, logprobs, routing = sample_group(self.engine, self.versions, prompt.ids, spans,
                                                 rollout.group_size, rollout.max_tokens, rollout.temperature,
                                                 seed, self.env.tokenizer.eos_id)
        samples = []
        for i, (toks, lps) in enumerate(zip(tokens, logprobs)):
            finished = toks[-1] == self.env.tokenizer.eos_id
            samples.append(Sample(
                tokens=Tensor.from_numpy(np.array(toks, np.int32)),
                logprobs=Tensor.from_numpy(np.array(lps, np.float32)),
                reward=self.env.reward(prompt, toks), finish_reason="stop" if finished else "length", seed=seed + i,
                spans=[(first, v) for first, v in spans if first < len(toks)]))
        group_id = f"g{step}-{index}"
        trajectory = self._append("trajectories", Trajectory, group_id=group_id, env=self.env.name,
                                  prompt=Tensor.from_numpy(np.array(prompt.ids, np.int32)), samples=samples,
                                  worker="rollout:0", meta=prompt.meta, temperature=rollout.temperature)
        self._append("routing", RoutingTrace, group_id=group_id, experts=[Tensor.from_numpy(r) for r in routing])
        return Group(trajectory, routing)

    def _append(self, stream: str, cls: type, **fields: Any) -> AnyEvent:
        event = cls(run=self.config.run.name, producer=f"runbuilder:{stream}", seq=self.seq, **fields)
        self.seq += 1
        self.entry += 1
        self.log.stream(stream).append_batch([(f"{self.entry}-0", encode(event))])
        return event


@torch.no_grad()
def sample_group(engine: MoEModel, versions: dict[int, dict[str, torch.Tensor]], prompt: list[int],
                 spans: list[tuple[int, int]], n: int, max_tokens: int, temperature: float, seed: int,
                 eos: int) -> tuple[list[list[int]], list[list[float]], list[np.ndarray]]:
    """n samples of `prompt`: tokens and log mu per sample (cut after eos) and routing [P + C - 1, L, K].

    Token j is sampled under the version of the last span starting at or before j; a weight swap
    keeps the routing already recorded for earlier positions, as an engine keeps its KV cache.
    """
    P = len(prompt)
    ids_ST = torch.tensor(prompt)[None].repeat(n, 1)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    routing_parts, logprobs = [], []
    for j in range(max_tokens):
        version = [v for first, v in spans if first <= j][-1]
        if j == 0 or any(first == j for first, _ in spans):
            engine.load_state_dict(versions[version])
        out = engine(ids_ST, return_routing=True)
        routing_parts.append(out.routing[:, :P] if j == 0 else out.routing[:, -1:])
        logp_SV = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        next_S = torch.cat([torch.multinomial(logp_SV[i].exp(), 1, generator=generators[i]) for i in range(n)])
        logprobs.append(logp_SV.gather(-1, next_S[:, None])[:, 0])
        ids_ST = torch.cat([ids_ST, next_S[:, None]], dim=1)
    routing_STLK = torch.cat(routing_parts, dim=1).numpy().astype(np.uint8)
    logprobs_ST = torch.stack(logprobs, dim=1)
    tokens, lps, routing = [], [], []
    for i in range(n):
        completion = ids_ST[i, P:].tolist()
        C = completion.index(eos) + 1 if eos in completion else max_tokens
        tokens.append(completion[:C])
        lps.append(logprobs_ST[i, :C].tolist())
        routing.append(np.ascontiguousarray(routing_STLK[i, :P + C - 1]))
    return tokens, lps, routing
