"""Metric sinks: W&B, TensorBoard and MLflow as readers of a run's log and live stream.

A sink is one more watcher (consumers/metrics.py): it reads the run's on-disk log, then the live
bus with plain XREAD, and writes every committed step's figures at their step, every EvalResult,
the config and the code version into the tracker. It asks the tracker what it already holds
(each library's own files) and skips those points, so a restart resumes without a duplicate step
and a finished run is backfilled whole. `reel metrics wandb|tensorboard|mlflow --run DIR` runs one;
`[metrics] sinks = [...]` makes `reel run` start them beside the other roles.
"""
