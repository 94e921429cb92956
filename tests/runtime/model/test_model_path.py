"""`model.path`: a real HF checkpoint directory (tokenizer trained here, random Qwen3-MoE saved by
transformers) is what the run trains and serves, with its own tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import Trajectory, WeightsPublished
from reel.bus.run_log import RunLog
from hf_checkpoint import make_checkpoint
from reel.runtime.launch.cli import main
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.config import MoEConfig
from reel.runtime.tokenizer import HFTokenizer
from reel.runtime.weights.load import version_bytes

RUN = """
[run]
name = "ckpt"
steps = 3
[model]
path = "{path}"
{extra}
[env]
name = "reverse_text"
min_len = 2
max_len = 3
[rollout]
concurrency = 2
group_size = 2
async_level = 1
max_tokens = 6
[trainer]
batch_groups = 2
checkpoint_every = 3
max_off_policy_steps = 1
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe")


def _config(tmp_path: Path, path: Path | str, extra: str = "") -> Path:
    config = tmp_path / "run.toml"
    config.write_text(RUN.format(path=path, extra=extra))
    return config


def _by_param(tensors, config: MoEConfig) -> dict[tuple[str, int | None], torch.Tensor]:
    """Hub tensors keyed by where they land in Reel's model (per-expert and fused layouts alike)."""
    return {(name, expert): t for hub, tensor in tensors
            for name, expert, t in state_dict_adapter.param_slices(hub, tensor, config)}


def _checkpoint_tensors(directory: Path):
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@pytest.mark.slow
def test_run_trains_the_checkpoint_with_its_tokenizer(tmp_path: Path, checkpoint: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    # Every version kept (retention would delete version 0), so version 0 can be compared with the checkpoint.
    config_path = _config(tmp_path, checkpoint, extra="[log]\nkeep_weights_every = 1\n")
    assert main(["run", str(config_path), "--out", str(run_dir), "--no-live"]) == 0
    assert not json.loads((run_dir / "init" / "init.json").read_text()).get("reward_mean")  # no warm-start
    with RunLog(run_dir, readonly=True) as log:
        weights = [e for _, e in log.events("weights") if isinstance(e, WeightsPublished)]
        trajectories = [e for _, e in log.events("trajectories") if isinstance(e, Trajectory)]
    assert sorted(w.version for w in weights) == [0, 1, 2, 3]

    # Version 0 is the checkpoint, bit for bit.
    config = MoEConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    first = next(w for w in weights if w.version == 0)
    v0 = st_load(version_bytes(BlobStore(run_dir / "blobs"), first.weights, first.format))
    published, original = _by_param(v0.items(), config), _by_param(_checkpoint_tensors(checkpoint), config)
    assert published.keys() == original.keys()
    assert all(published[k].dtype == original[k].dtype and torch.equal(published[k], original[k]) for k in original)

    # Prompts are the checkpoint's chat template around the task text; its eos ends completions.
    tok = HFTokenizer.from_dir(checkpoint)
    prompt = tok.decode(trajectories[0].prompt.numpy().tolist())
    assert prompt.startswith("<|im_start|>user\nreverse:") and prompt.endswith("=<|im_end|>\n<|im_start|>assistant\n")
    for sample in (s for t in trajectories for s in t.samples):
        tokens = sample.tokens.numpy().tolist()
        assert (sample.finish_reason == "stop") == (tokens[-1] in tok.stop_ids)

    capsys.readouterr()
    assert main(["log", "cat", "--run", str(run_dir), "--stream", "trajectories", "--decode"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["prompt_text"] == tok.decode(first["prompt"]["values"])
    assert first["prompt_text"].startswith("<|im_start|>user\nreverse:")
    assert first["samples"][0]["text"] == tok.decode(first["samples"][0]["tokens"]["values"])


def _unsupported(tmp_path: Path, checkpoint: Path) -> Path:
    other = tmp_path / "llama"
    other.mkdir()
    for f in checkpoint.iterdir():
        (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"],
                                                   "model_type": "llama"}))
    return other


@pytest.mark.parametrize("case", ["missing", "unsupported", "contradiction"])
def test_config_errors_are_one_line_exit_2_nothing_created(tmp_path: Path, checkpoint: Path, case: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path, extra, expected = {
        "missing": (tmp_path / "nowhere", "", "is not a directory"),
        "unsupported": (_unsupported(tmp_path, checkpoint), "", "architecture LlamaForCausalLM is not supported"),
        "contradiction": (checkpoint, "num_experts_per_tok = 99", "model.num_experts_per_tok = 99 contradicts"),
    }[case]
    out_dir = tmp_path / "runs" / "x"
    assert main(["run", str(_config(tmp_path, path, extra)), "--out", str(out_dir), "--no-live"]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "model." in err and len(err.splitlines()) == 1, err
    assert not out_dir.exists() and not (tmp_path / "runs").exists()
