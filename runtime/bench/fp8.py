"""`reel bench fp8`: an fp8 inference against a bf16 and an fp8 trainer, both replaying routing.

ratio = mean k3 KL of the bf16 trainer / of the fp8 trainer (runtime/bench/common/numerics.py has the method).
"""

from __future__ import annotations

import argparse
import time

from reel.bus.jsonout import print_json
from reel.runtime.bench.common.numerics import BENCH_CONFIG, KL_FLOOR, sampled, k3, score


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    s = sampled(args, "fp8", BENCH_CONFIG.initializer_range)
    s.model.precision = "bf16"
    bf16_logp, _ = score(s.model, s.tokens_BT, s.new_tokens, s.routing_BTLK)
    s.model.precision = "fp8"
    fp8_logp, _ = score(s.model, s.tokens_BT, s.new_tokens, s.routing_BTLK)
    kl_bf16, kl_fp8 = k3(bf16_logp, s.infer_logp_BG, s.mask_BG), k3(fp8_logp, s.infer_logp_BG, s.mask_BG)
    print_json({
        "bench": "fp8", "inference": "fp8", "router_replay": True, **s.weights,
        "tokens": s.infer_logp_BG.numel() if s.mask_BG is None else int(s.mask_BG.sum()),
        "entropy": round(s.entropy, 3), "kl_k3_bf16_trainer": kl_bf16, "kl_k3_fp8_trainer": kl_fp8,
        "ratio": round(kl_bf16 / max(kl_fp8, KL_FLOOR), 2), "kl_floor": KL_FLOOR,
        "seconds": round(time.perf_counter() - t0, 2),
    })
    return 0
