"""`reel export`: one policy version of a run as a Hugging Face model directory.

    config.json + model.safetensors    the weights (Qwen3-MoE names; transformers and vLLM load them)
    tokenizer files                    model.path's own, or the character tokenizer as tokenizer.json
    generation_config.json             the run's sampling (temperature, top_p, max_tokens) and special ids
    reel_export.json                   provenance: run, step, weight hashes, the run directory

Written to a staging directory and renamed, so an interrupted export leaves no half model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from reel.bus.errors import ReelError
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load_run_config
from reel.runtime.model.weights import save
from reel.runtime.tokenizer import CharTokenizer, load_tokenizer

__all__ = ["main", "export", "PROVENANCE_FILE"]

PROVENANCE_FILE = "reel_export.json"
# What a checkpoint directory's tokenizer is made of (whichever of them it has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")


class ExportError(ReelError):
    """An export that cannot be written as asked."""


def main(args: argparse.Namespace) -> int:
    out = export(Path(args.run_dir), args.step, Path(args.out))
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    print(f"exported step {provenance['step']} of run {provenance['run']} to {out} "
          f"(weights sha256 {provenance['weights_sha256'][:12]}); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}) or `vllm serve {out}`")
    return 0


def export(run_dir: Path, step: int | None, out: Path) -> Path:
    """Write version `step` (None: the newest committed) of the run in `run_dir` to `out`; returns `out`."""
    from reel.replay.version_weights import find_version, load_version  # torch: only once arguments are checked

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} already exists and is not empty; choose a new directory")
    config = load_run_config(run_dir)
    found, commits = find_version(run_dir, step)
    model = load_version(run_dir, run_blobs(run_dir, config), found, commits)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save(model, staging)
        special = _write_tokenizer(config, staging, model.config.max_position_embeddings)
        (staging / "generation_config.json").write_text(json.dumps(_generation_config(config, special), indent=2) + "\n")
        sha = found.commit.weights_sha256 if found.commit else ""
        blob = found.published.weights.sha256 if found.published else ""
        provenance = {"run": config.run.name, "step": found.version, "version": found.version,
                      "weights_sha256": sha or _file_sha256(staging / "model.safetensors"), "blob_sha256": blob,
                      "run_dir": str(run_dir.resolve()), "source": "init" if found.published is None else "weights"}
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_tokenizer(config: Config, out: Path, max_length: int) -> dict[str, int | None]:
    """The run's tokenizer files in `out`; returns its bos/eos/pad ids."""
    tokenizer = load_tokenizer(config.model.path)
    if isinstance(tokenizer, CharTokenizer):
        _char_tokenizer_as_hf(tokenizer, max_length).save_pretrained(out)
    else:
        source = Path(config.model.path)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def _char_tokenizer_as_hf(tokenizer: CharTokenizer, max_length: int):
    """Reel's character tokenizer as a transformers fast tokenizer: same ids, <bos> before a prompt."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {tokenizer.decode([i]): i for i in range(tokenizer.vocab_size)}
    core = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   model_max_length=max_length)


def _generation_config(config: Config, special: dict[str, int | None]) -> dict[str, object]:
    r = config.rollout
    return {**{k: v for k, v in special.items() if v is not None}, "do_sample": True, "temperature": r.temperature,
            "top_p": r.top_p, "max_new_tokens": r.max_tokens}


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
