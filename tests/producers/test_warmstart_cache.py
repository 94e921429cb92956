"""The warm-start cache under concurrency: processes that need the same warm-start at once compute it once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WARM_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from reel.producers.warmstart import warm_start
from reel.runtime.config import run as config_mod
raw = {"run": {"name": "w", "seed": 0, "steps": 1},
       "model": {"hidden_size": 32, "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2},
       "init": {"warmup_steps": 30}, "env": {"name": "reverse_text", "min_len": 3, "max_len": 4}}
model, reward = warm_start(config_mod.from_dict(raw, source="test"))
print(repr(reward), sum(float(p.double().sum()) for p in model.parameters()))
"""


def test_two_processes_needing_one_warm_start_train_it_once_and_get_the_same_policy(tmp_path: Path):
    env = {**os.environ, "REEL_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", WARM_START], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    trained = [err for _, err in outs if "warm-start step 30/30" in err]
    from_cache = [err for _, err in outs if " from cache " in err]
    assert len(trained) == 1 and len(from_cache) == 1, "one process trains, the other waits and reads its result"
    assert outs[0][0] == outs[1][0]  # same reward, same weights
    entries = [p.name for p in (tmp_path / "cache" / "warmstart").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
