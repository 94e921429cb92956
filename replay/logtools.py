"""`reel log verify` and `reel log cat`: read a run's on-disk log without touching it.

`reel log cat --decode` adds the text of token ids (a trajectory's prompt, each sample's turns)
with the run's tokenizer (model.path's own, else the character tokenizer): ids are what the log
holds, text is only ever made here and in the envs.

Both open the log read-only: a torn tail left by a crashed archiver is reported, not repaired
(the archiver repairs it when it next opens the log), so they are safe on a live run. A damaged
record (a flipped byte) ends what they can read of its stream; both say where, and the other
streams are still read. `reel log repair` (replay/log_repair.py) cuts a stream back to its valid
records.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from reel.bus.errors import printable
from reel.bus.events import CheckpointsPruned, Tensor, Trajectory
from reel.bus.jsonout import json_line
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.replay.integrity import run_file_problems
from reel.runtime.config import run as config
from reel.runtime.tokenizer import Tokenizer, load_tokenizer

# Tensors up to this many elements are printed whole; bigger ones as a summary and a head.
_FULL_TENSOR = 256
_HEAD = 8


def verify(args: argparse.Namespace) -> int:
    """Check every record's framing and CRC of every stream, one line each (damage -> exit 1, naming
    each damaged stream and where its valid prefix ends); then the files the log names
    (replay/integrity.py: tampering -> exit 1 via cli)."""
    damaged: list[str] = []
    with RunLog(Path(args.run_dir), readonly=True, valid_prefix=True) as run_log:
        total = 0
        for name in run_log.names():
            stream = run_log.stream(name)
            count = sum(1 for _ in stream.records())
            torn = stream.torn_bytes
            note = f"  (torn tail of {torn} bytes; repaired when the archiver next opens it)" if torn else ""
            if stream.damage is not None:
                damaged.append(str(stream.damage))
                note = f"  DAMAGED after these records: {stream.damage}"
            print(f"{name:<14}{count:>10} records{note}")
            total += count
        if damaged:
            print(f"reel: {len(damaged)} of {len(run_log.names())} streams are damaged: {'; '.join(damaged)}; "
                  f"steps whose inputs lie before the damage still replay; `reel log repair --run {args.run_dir}` "
                  f"keeps the valid records of each stream (after copying the log)", file=sys.stderr)
            return 1
        print(f"ok: {total} records in {len(run_log.names())} streams, every CRC checked")
        pruned = sorted({step for _, e in run_log.events("control") if isinstance(e, CheckpointsPruned)
                         for step in e.steps}) if "control" in run_log.names() else []
    checked, problems = run_file_problems(Path(args.run_dir))
    for problem in problems:
        print(f"tampered: {printable(problem)}")
    if problems:
        raise LogError(f"{len(problems)} of {checked} files the log names do not match it; the first: {problems[0]}")
    print(f"ok: {checked} blobs, init/ and checkpoints match the hashes the log names" +
          (f"; the checkpoints of steps {', '.join(map(str, pruned))} were deleted by retention (CheckpointsPruned)"
           if pruned else ""))
    return 0


def cat(args: argparse.Namespace) -> int:
    """Print a stream's events as JSON lines: {"entry_id": ..., "type": ..., fields...}; on a damaged
    stream, the records before the damage, then the error (exit 1)."""
    out = sys.stdout.buffer
    tokenizer = _run_tokenizer(Path(args.run_dir)) if getattr(args, "decode", False) else None
    with RunLog(Path(args.run_dir), readonly=True, valid_prefix=True) as run_log:
        try:
            for entry_id, event in run_log.events(args.stream):
                line = {"entry_id": entry_id, "type": type(event).__struct_config__.tag, **_readable(event)}
                if tokenizer is not None and isinstance(event, Trajectory):
                    _add_text(line, event, tokenizer)
                out.write(json_line(line))
            out.flush()
        except BrokenPipeError:
            # The reader (e.g. `| head`) has gone; silence the flush Python would retry at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        damage = run_log.stream(args.stream).damage
    if damage is not None:
        print(f"reel: {damage}; the records before it are printed above; `reel log repair --run {args.run_dir}` "
              f"keeps them and drops the rest", file=sys.stderr)
        return 1
    return 0


def _run_tokenizer(run_dir: Path) -> Tokenizer:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise LogError(f"{run_dir} has no config.toml, so its tokenizer is unknown; pass a run directory")
    return load_tokenizer(config.load(path).model.path)


def _add_text(line: dict[str, Any], trajectory: Trajectory, tokenizer: Tokenizer) -> None:
    """prompt_text, and per sample `text` (all of it) and `turns_text` (model and env turns alternating)."""
    line["prompt_text"] = tokenizer.decode(trajectory.prompt.numpy().tolist())
    for sample, readable in zip(trajectory.samples, line["samples"]):
        tokens = sample.tokens.numpy().tolist()
        readable["text"] = tokenizer.decode(tokens)
        cuts = sorted({0, len(tokens), *(i for span in sample.env_spans for i in span)})
        readable["turns_text"] = [tokenizer.decode(tokens[a:b]) for a, b in zip(cuts, cuts[1:])]


def _readable(value: Any) -> Any:
    """JSON-ready form: tensors as values (small) or dtype/shape and a head (big), bytes as base64."""
    if isinstance(value, Tensor):
        array = value.numpy()
        if value.dtype == "bfloat16":  # travels as raw 16-bit patterns: widen to float32 to print
            array = (array.astype(np.uint32) << 16).view(np.float32)
        summary = f"{value.dtype}{list(value.shape)}"
        if array.size <= _FULL_TENSOR:
            return {"tensor": summary, "values": array.tolist()}
        return {"tensor": summary, "nbytes": len(value.data), "head": array.reshape(-1)[:_HEAD].tolist()}
    if isinstance(value, msgspec.Struct):
        return {field: _readable(getattr(value, field)) for field in value.__struct_fields__}
    if isinstance(value, (list, tuple)):
        return [_readable(v) for v in value]
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value
