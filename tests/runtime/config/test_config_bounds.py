"""Config values that name resources have bounds: each error names the key and the limit, at load,
before anything starts (the values below hung, filled the disk or crashed the allocator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reel.runtime.config import run as config_mod
from reel.runtime.config.bounds import machine_memory, memory_estimate
from reel.runtime.config.keys import ConfigError
from reel.runtime.launch.cli import main

CASES = [
    ("rollout", "group_size", 1_000_000_000, "rollout.group_size = 1000000000 is outside [2, 4,096]"),
    ("rollout", "stats_every_s", 0.0, "rollout.stats_every_s = 0.0 is outside [0.1, 3,600]"),
    ("bus", "partitions", 1_000_000, "bus.partitions = 1000000 is outside [1, 1,024]"),
    ("model", "hidden_size", 1_000_000_000, "model.hidden_size = 1000000000 is outside [1, 131,072]"),
    ("engine", "max_batch", 1_000_000_000, "engine.max_batch = 1000000000 is outside [1, 65,536]"),
    ("model", "max_position_embeddings", 1_000_000_000, "model.max_position_embeddings = 1000000000 is outside"),
    ("bus", "block_ms", -5, "bus.block_ms = -5 is outside [1, 600,000]"),
    ("bus", "ride_out_s", -1.0, "bus.ride_out_s = -1.0 is outside [0, 3,600]"),
    ("trainer", "micro_batch_tokens", -1, "trainer.micro_batch_tokens = -1 is outside [0,"),
    ("engine", "max_seq_len", -1, "engine.max_seq_len = -1 is outside [0,"),
]


@pytest.mark.parametrize(("section", "key", "value", "says"), CASES, ids=[f"{s}.{k}" for s, k, _, _ in CASES])
def test_out_of_range_values_name_the_key_and_the_range(section: str, key: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError) as error:
        config_mod.from_dict({section: {key: value}})
    assert says in str(error.value)


def test_shapes_that_cannot_fit_this_machine_are_refused_with_the_estimate(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    big = {"model": {"hidden_size": 16384, "moe_intermediate_size": 16384, "num_experts": 4096,
                     "num_hidden_layers": 64}}
    path = tmp_path / "big.toml"
    path.write_text("[model]\n" + "".join(f"{k} = {v}\n" for k, v in big["model"].items()))
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the model and engine shapes need about" in err and "of this machine's" in err
    assert "lower the [model] sizes, engine.max_batch or engine.max_seq_len" in err
    assert len(err.strip().splitlines()) == 1


def test_the_estimate_counts_parameters_and_the_kv_cache() -> None:
    c = config_mod.from_dict({"model": {"hidden_size": 32, "moe_intermediate_size": 16, "num_experts": 4,
                                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "head_dim": 8, "intermediate_size": 64, "vocab_size": 50,
                                        "max_position_embeddings": 128},
                              "engine": {"max_batch": 4}})
    attention = 32 * 8 * (2 * 4 + 2 * 2)
    experts = 4 * 3 * 32 * 16 + 32 * 4
    params = 50 * 32 * 2 + 2 * (attention + experts)
    kv = 4 * 128 * 2 * 2 * 2 * 8
    need, parts = memory_estimate(c)
    assert need == params * 16 + (params + kv + 2 * 128 * 8) * 4
    assert f"{params:,} parameters" in parts
    assert need < machine_memory()

