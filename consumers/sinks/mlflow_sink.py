"""MLflow: one MLflow run per Reel run (tag reel.run), in a local store or at a tracking URI.

The default store is SQLite in the run directory (MLflow's file store is in maintenance mode);
any tracking URI MLflow accepts (http://host:5000, sqlite:///path, databricks) works the same.
Eval scores go under eval/ at the trainer step of the version they scored.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from reel.consumers.sinks.base import RunMeta, Sink, SinkError, require_library

__all__ = ["MlflowSink", "default_uri", "find_run"]

RUN_TAG = "reel.run"
PARAM_MAX = 6000  # MLflow's limit on a param value's length


def default_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'tracking' / 'mlflow.db').resolve()}"


def find_run(client: Any, experiment_id: str, run: str) -> Any | None:
    """The MLflow run that holds Reel run `run`, if a sink already created it."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run}'", max_results=1)
    return found[0] if found else None


def _create_sqlite_store(tracking: Any, path: Path) -> None:
    """A new SQLite store is created aside and renamed into place: MLflow builds its tables in many
    migrations, and a sink killed halfway would leave a store no later MLflow can open."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f"{path.name}.{os.getpid()}.new")
    aside.unlink(missing_ok=True)
    tracking.MlflowClient(f"sqlite:///{aside}").search_experiments()  # runs the migrations
    os.replace(aside, path)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:PARAM_MAX]
    return flat


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run: str, artifacts: Path):
        tracking = require_library("mlflow.tracking", "mlflow")
        self._entities = require_library("mlflow.entities", "mlflow")
        try:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            if tracking_uri.startswith("sqlite:///"):
                _create_sqlite_store(tracking, Path(tracking_uri.removeprefix("sqlite:///")))
            self.client = tracking.MlflowClient(tracking_uri)
            known = self.client.get_experiment_by_name(experiment)
            experiment_id = (known.experiment_id if known else
                             self.client.create_experiment(experiment, artifact_location=Path(artifacts).resolve().as_uri()))
            held = find_run(self.client, experiment_id, run)
            self.run_id = held.info.run_id if held else self.client.create_run(
                experiment_id, run_name=run, tags={RUN_TAG: run}).info.run_id
        except Exception as exc:  # MLflow raises its own and its stores' errors (SQLAlchemy, HTTP)
            raise SinkError(f"MLflow at {tracking_uri} cannot be used: {exc}; check metrics.mlflow_tracking_uri") from exc
        self._params = dict(held.data.params) if held else {}
        self._held = {key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
                      for key in (held.data.metrics if held else {})}

    def written(self) -> dict[str, int]:
        return dict(self._held)

    def describe(self, meta: RunMeta) -> None:
        params = {k: v for k, v in _flatten(meta.config).items() if k not in self._params}
        entities = self._entities
        self.client.log_batch(self.run_id, params=[entities.Param(k, v) for k, v in params.items()],
                              tags=[entities.RunTag("reel.code_version", meta.code_version or "unknown")])
        self._params.update(params)
        self.client.log_text(self.run_id, meta.config_toml, "config.toml")

    def write(self, step: int, points: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._entities.Metric(k, v, now, step) for k, v in points.items()])

    def write_eval(self, step: int, points: dict[str, float]) -> None:
        self.write(step, points)

    def flush(self) -> None:
        pass  # every log_batch is one committed write to the store

    def close(self) -> None:
        pass
