"""TensorBoard: event files under DIR (steps) and DIR/eval (eval results, a second TB run).

Evals run behind the trainer, so their steps would go backwards among the step figures; in one
event file TensorBoard reads a step going backwards as a restart and purges the later points.
Their own directory keeps each file's steps increasing. A restart adds a new event file to each
directory and TensorBoard merges them.
"""

from __future__ import annotations

from pathlib import Path

from reel.consumers.sinks.base import RunMeta, Sink, require_library

__all__ = ["TensorBoardSink", "read_scalars"]

EVAL_DIR = "eval"
TEXT_TAGS = ("config", "code_version")


def _accumulator(directory: Path):
    module = require_library("tensorboard.backend.event_processing.event_accumulator", "tensorboard")
    accumulator = module.EventAccumulator(str(directory), size_guidance={module.SCALARS: 0, module.TENSORS: 0})
    accumulator.Reload()
    return accumulator


def read_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Tag -> step -> value of every scalar in DIR's event files, by TensorBoard's own reader."""
    if not directory.is_dir():
        return {}
    accumulator = _accumulator(directory)
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, directory: Path):
        tensorboard = require_library("torch.utils.tensorboard", "tensorboard")
        require_library("tensorboard", "tensorboard")
        self.directory = directory
        self._held = {name: max(steps) for name, steps in read_scalars(directory).items() if steps}
        self._held.update({name: max(steps) for name, steps in read_scalars(directory / EVAL_DIR).items() if steps})
        self._texts = set(_accumulator(directory).Tags()["tensors"]) if directory.is_dir() else set()
        self._steps = tensorboard.SummaryWriter(str(directory))
        self._evals = tensorboard.SummaryWriter(str(directory / EVAL_DIR))

    def written(self) -> dict[str, int]:
        return dict(self._held)

    def describe(self, meta: RunMeta) -> None:
        texts = {"config": f"```toml\n{meta.config_toml}\n```", "code_version": meta.code_version or "unknown"}
        for tag, text in texts.items():
            if not any(t.startswith(tag) for t in self._texts):
                self._steps.add_text(tag, text, 0)

    def write(self, step: int, points: dict[str, float]) -> None:
        for name, value in points.items():
            self._steps.add_scalar(name, value, step)

    def write_eval(self, step: int, points: dict[str, float]) -> None:
        for name, value in points.items():
            self._evals.add_scalar(name, value, step)

    def flush(self) -> None:
        self._steps.flush()
        self._evals.flush()

    def close(self) -> None:
        self._steps.close()
        self._evals.close()
