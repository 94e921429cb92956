"""`reel init`: write a starting config, for a task, on a tiny MoE or on an HF model directory.

The file holds the keys a user is likely to change, each with a comment; `reel config show FILE`
prints every other key with its default. What is written is loaded (and, for --from-model, the
checkpoint checked) before it is written, so `reel run FILE` starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reel.runtime.config import checks
from reel.runtime.config import run as config_mod
from reel.runtime.config.keys import ConfigError
from reel.producers.envs.registry import check_config

__all__ = ["main", "scaffold"]

TINY_MODEL = """[model]            # a tiny Qwen3-MoE from these keys (or: path = "HF model directory")
hidden_size = 64
moe_intermediate_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
num_experts = 8
num_experts_per_tok = 2

[init]
warmup_steps = 300  # supervised steps on the task before RL, so RL starts from a policy that sometimes solves it
"""
MODEL_PATH = """[model]
path = {path}  # an HF Qwen3-MoE checkpoint directory; its config.json gives the shapes, its tokenizer the ids

[init]
warmup_steps = 0  # start RL from the checkpoint as it is (> 0: supervised steps on the task first)
"""
STRING_TASKS = ("reverse_text", "sort_digits")  # tasks with min_len / max_len


def scaffold(task: str, from_model: str | None) -> str:
    name = f"{Path(from_model).resolve().name}_{task}" if from_model else task
    model = MODEL_PATH.format(path=_toml_string(str(Path(from_model).resolve()))) if from_model else TINY_MODEL
    lengths = "min_len = 3  # question characters\nmax_len = 6\n" if task in STRING_TASKS else ""
    return f"""# Written by `reel init`. `reel config show THIS_FILE` lists every key with its default.
#   reel run THIS_FILE

[run]
name = {_toml_string(''.join(c if c.isalnum() or c in '_.-' else '_' for c in name))}  # the run directory under out_dir
seed = 0
steps = 60

{model}
[env]
name = {_toml_string(task)}
{lengths}
[rollout]
workers = 1
concurrency = 32  # groups in flight per worker
group_size = 16  # samples per prompt (GRPO compares them)
async_level = 1  # workers sample at most this many policy versions ahead of the trainer (0 = synchronous)
max_tokens = 10

[trainer]
lr = 1e-3
batch_groups = 32  # groups per step
max_off_policy_steps = 1  # groups with older tokens are dropped (and recorded)
checkpoint_every = 10
"""


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"{out} already exists; choose another --out or remove it")
    if args.from_model and not (Path(args.from_model) / "config.json").is_file():
        raise ConfigError(f"--from-model {args.from_model} has no config.json; pass an HF model directory")
    text = scaffold(args.task, args.from_model)
    source = f"the config for --task {args.task}"
    config = config_mod.loads(text, source=source)
    check_config(config, source)  # names a bad task
    checks.check_model_path(config, text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} (run {config.run.name!r}, task {args.task}); `reel run {out}` starts it, "
          f"`reel config show {out}` lists every key")
    return 0


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
