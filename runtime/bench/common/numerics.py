"""What `reel bench r3` and `reel bench fp8` share: sample with the engine path, score with the trainer path.

Both sample completions from a tiny random-init MoE with the KV-cached engine path, record the
sampled tokens' logprobs and routing, then score the same tokens with the full-sequence trainer
path. Mismatch is mean k3 = r - 1 - log r, r = pi_train / pi_inference, over sampled tokens.
  r3   inference bf16, trainer fp32; ratio = KL without router replay / KL with it
  fp8  inference fp8, trainer replays routing; ratio = KL of a bf16 trainer / KL of an fp8 trainer

`--from-run DIR` measures on a trained run instead: its latest weights and its own prompts
(runtime/bench/common/from_run.py), completions scored up to their end-of-sequence token.

Init: matrices ~ N(0, 0.1). At HF's default 0.02 a random model of this width is a near-uniform
policy (entropy close to log V) whose expert outputs barely move the logits, unlike a trained
one; r3 also reports the ratio at 0.02 so the choice is visible.

Shape legend: B sequences, T = prompt + completion tokens, G completion tokens, V vocab,
L MoE layers, K top-k.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch

from reel.runtime.model.cached_forward import forward_cached
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.determinism import set_determinism
from reel.runtime.model.kvcache import new_cache
from reel.runtime.model.model import MoEModel

BENCH_CONFIG = MoEConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=16, num_experts_per_tok=2, max_position_embeddings=256,
                         initializer_range=0.1)


@torch.no_grad()
def sample(model: MoEModel, prompts_BP: torch.Tensor, new_tokens: int, seed: int):
    """Engine-style sampling: one prefill call for all prompts, then batched decode steps.

    -> tokens [B, T], inference logprobs of the completion [B, G], routing of every token [B, T, L, K]
    (the last token is never fed back, so its routing row stays 0; nothing scores it), mean entropy.
    """
    B, P = prompts_BP.shape
    T = P + new_tokens
    cache = new_cache(model, B, T)
    gen = torch.Generator().manual_seed(seed)
    tokens_BT = torch.zeros(B, T, dtype=torch.long)
    tokens_BT[:, :P] = prompts_BP
    routing_BTLK = torch.zeros(B, T, len(model.config.moe_layers), model.config.num_experts_per_tok, dtype=torch.long)
    logprobs_BG = torch.zeros(B, new_tokens)
    entropy = 0.0
    slots_B = torch.arange(B)
    out = forward_cached(model, prompts_BP.flatten(), slots_B.repeat_interleave(P), torch.arange(P).repeat(B), cache,
                         return_routing=True)
    routing_BTLK[:, :P] = out.routing.view(B, P, *out.routing.shape[1:])
    logits_BV = out.logits.view(B, P, -1)[:, -1]
    for g in range(new_tokens):
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        entropy -= float((logp_BV.exp() * logp_BV).sum(-1).mean()) / new_tokens
        next_B = torch.multinomial(logp_BV.exp(), 1, generator=gen).squeeze(1)
        tokens_BT[:, P + g] = next_B
        logprobs_BG[:, g] = logp_BV.gather(1, next_B[:, None]).squeeze(1)
        if g + 1 < new_tokens:
            out = forward_cached(model, next_B, slots_B, torch.full((B,), P + g), cache, return_routing=True)
            routing_BTLK[:, P + g] = out.routing
            logits_BV = out.logits
    return tokens_BT, logprobs_BG, routing_BTLK, entropy


@torch.no_grad()
def score(model: MoEModel, tokens_BT: torch.Tensor, new_tokens: int, replay_BTLK: torch.Tensor | None = None):
    """-> trainer logprobs of the completion [B, G], trainer's own routing [B, T, L, K]."""
    out = model(tokens_BT, replay_routing_BTLK=replay_BTLK, return_routing=True)
    logp_BTV = torch.log_softmax(out.logits[:, -new_tokens - 1:-1], dim=-1)
    return logp_BTV.gather(2, tokens_BT[:, -new_tokens:, None]).squeeze(2), out.routing


# A KL below this is reported as this in ratios (fp32 round-off is ~1e-13): an aligned trainer that
# reproduces the sampler's numbers exactly would otherwise make the ratio infinite.
KL_FLOOR = 1e-12


def k3(train_logp: torch.Tensor, infer_logp: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    log_r = train_logp.double() - infer_logp.double()
    k3_all = log_r.exp() - 1 - log_r
    return float(k3_all.mean() if mask is None else k3_all[mask].mean())


class Sampled(NamedTuple):
    model: MoEModel
    tokens_BT: torch.Tensor
    infer_logp_BG: torch.Tensor
    routing_BTLK: torch.Tensor
    entropy: float
    mask_BG: torch.Tensor | None  # the completion tokens that count (None = all)
    weights: dict  # what the weights are, for the JSON line

    @property
    def new_tokens(self) -> int:
        return self.infer_logp_BG.shape[1]


def sampled(args: argparse.Namespace, inference_precision: str, init_std: float) -> Sampled:
    """Random weights (init_std) and prompts, or with --from-run the run's latest weights and prompts."""
    set_determinism(0)
    B, P, G = (8, 16, 32) if args.quick else (32, 32, 128)
    if getattr(args, "from_run", None):
        from reel.runtime.bench.common.from_run import completion_mask, load_trained_run

        # Completions of a trained policy are short (it stops): more prompts for as many tokens.
        run = load_trained_run(Path(args.from_run), prompts=8 * B)
        run.model.precision = inference_precision
        tokens_BT, logp_BG, routing_BTLK, entropy = sample(run.model, run.prompts_BP, run.new_tokens, seed=1)
        return Sampled(run.model, tokens_BT, logp_BG, routing_BTLK, entropy,
                       completion_mask(tokens_BT, run.new_tokens, run.eos),
                       {"from_run": args.from_run, "version": run.version})
    model = MoEModel(msgspec.structs.replace(BENCH_CONFIG, initializer_range=init_std), precision=inference_precision)
    prompts_BP = torch.randint(0, BENCH_CONFIG.vocab_size, (B, P))
    return Sampled(model, *sample(model, prompts_BP, G, seed=1), None, {"init_std": init_std})
