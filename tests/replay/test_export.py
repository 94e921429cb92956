"""`reel export`: a policy version of a run as an HF directory that transformers (and vLLM) load
with Reel's logits, its tokenizer and sampling, and where it came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import StepCommitted, WeightsPublished
from reel.bus.run_log import RunLog
from reel.runtime.train.initial_policy import load_initial_model
from reel.runtime.launch.cli import main
from reel.runtime.model.weights import load_state_dict_bytes
from reel.runtime.tokenizer import CharTokenizer
from runbuilder import build_run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("export") / "run", {"run": {"name": "exported"}})


def _logged(run_dir: Path) -> tuple[dict[int, WeightsPublished], dict[int, StepCommitted]]:
    with RunLog(run_dir, readonly=True) as log:
        weights = {e.version: e for _, e in log.events("weights") if isinstance(e, WeightsPublished)}
        commits = {e.step: e for _, e in log.events("steps") if isinstance(e, StepCommitted)}
    return weights, commits


def _reel_model(run_dir: Path, version: int):
    """Reel's model at `version`, read straight from the logged blob (not through the export)."""
    model = load_initial_model(run_dir)
    published, _ = _logged(run_dir)
    load_state_dict_bytes(model, BlobStore(run_dir / "blobs").get(published[version].weights))
    return model.eval()


def test_export_loads_in_transformers_with_reels_logits(run_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    assert main(["export", "--run", str(run_dir), "--step", "3", "--out", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    provenance = json.loads((out / "reel_export.json").read_text())
    _, commits = _logged(run_dir)
    assert (provenance["run"], provenance["step"]) == ("exported", 3)
    assert provenance["weights_sha256"] == commits[3].weights_sha256

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    reel = _reel_model(run_dir, 3)
    ids_BT = torch.randint(0, reel.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids_BT).logits, reel(ids_BT).logits, atol=1e-5, rtol=1e-5)
        # A different version gives different logits: the export is of step 3, not any step.
        assert not torch.allclose(_reel_model(run_dir, 1)(ids_BT).logits, reel(ids_BT).logits, atol=1e-4)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    char = CharTokenizer()
    assert tokenizer("reverse:abc=").input_ids == char.prompt_ids("reverse:abc=")
    assert tokenizer.decode(char.encode("cba<eos>"), skip_special_tokens=True) == "cba"
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.bos_token_id) == (char.eos_id, char.bos_id)


def test_export_defaults_to_the_last_step_and_zero_is_the_initial_policy(run_dir: Path, tmp_path: Path) -> None:
    assert main(["export", "--run", str(run_dir), "--out", str(tmp_path / "last")]) == 0
    assert json.loads((tmp_path / "last" / "reel_export.json").read_text())["step"] == 4
    assert main(["export", "--run", str(run_dir), "--step", "0", "--out", str(tmp_path / "init")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "init", attn_implementation="eager").eval()
    ids_BT = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids_BT).logits, load_initial_model(run_dir).eval()(ids_BT).logits,
                                   atol=1e-5, rtol=1e-5)


def test_export_errors_name_the_fix_and_write_nothing(run_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--run", str(run_dir), "--step", "9", "--out", str(tmp_path / "a")]) == 1
    assert "step 9 is not committed" in capsys.readouterr().err and not (tmp_path / "a").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert main(["export", "--run", str(run_dir), "--out", str(taken)]) == 1
    assert "not empty" in capsys.readouterr().err and (taken / "keep.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".*"))  # no staging directory left behind


def test_a_version_gone_from_the_store_names_the_nearest_checkpoint(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = build_run(tmp_path / "run", {"run": {"name": "retained"}})
    published, _ = _logged(run_dir)
    BlobStore(run_dir / "blobs").path(published[3].weights).unlink()  # what retention does to a non-checkpoint version
    assert main(["export", "--run", str(run_dir), "--step", "3", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "weights of version 3 are not in the blob store" in err and "checkpoint of step 2" in err, err
    assert "Traceback" not in err and not (tmp_path / "m").exists()
