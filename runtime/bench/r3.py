"""`reel bench r3`: how far a bf16 inference and an fp32 trainer disagree, without and with router replay.

ratio = mean k3 KL without router replay / with it (runtime/bench/common/numerics.py has the method).
"""

from __future__ import annotations

import argparse
import time

from reel.bus.jsonout import print_json
from reel.runtime.bench.common.numerics import BENCH_CONFIG, KL_FLOOR, sampled, k3, score


def _r3(args: argparse.Namespace, init_std: float) -> dict:
    s = sampled(args, "bf16", init_std)
    s.model.precision = "fp32"
    free_logp, own_BTLK = score(s.model, s.tokens_BT, s.new_tokens)
    replay_logp, _ = score(s.model, s.tokens_BT, s.new_tokens, s.routing_BTLK)
    fed = slice(0, s.tokens_BT.shape[1] - 1)  # the last token was never fed at inference
    same = (own_BTLK[:, fed].sort(-1).values == s.routing_BTLK[:, fed].sort(-1).values).all(-1)
    kl_free, kl_replay = k3(free_logp, s.infer_logp_BG, s.mask_BG), k3(replay_logp, s.infer_logp_BG, s.mask_BG)
    tokens = s.infer_logp_BG.numel() if s.mask_BG is None else int(s.mask_BG.sum())
    return {**s.weights, "tokens": tokens, "entropy": round(s.entropy, 3), "kl_k3_no_replay": kl_free,
            "kl_k3_replay": kl_replay, "routing_disagreement": round(1 - same.float().mean().item(), 4),
            "ratio": round(kl_free / max(kl_replay, KL_FLOOR), 2)}


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    main = _r3(args, BENCH_CONFIG.initializer_range)
    extra = {}
    if not getattr(args, "from_run", None):
        default = _r3(args, 0.02)
        extra = {"ratio_init_0.02": default["ratio"], "routing_disagreement_init_0.02": default["routing_disagreement"]}
    print_json({"bench": "r3", "inference": "bf16", "trainer": "fp32", **main, **extra,
                      "seconds": round(time.perf_counter() - t0, 2)})
    return 0


