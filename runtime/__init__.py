"""What both sides of a run share, in rooms by concern, and the shell that starts a run.

    config/       the run's TOML schema, its checks, `--set`, `reel config schema`
    model/        the MoE (Qwen3-MoE names), its kernels, FP8, parallelism plans
    train/        one training step and what feeds it: batches, loss, ranks, re-execution
    weights/      policy versions as shard manifests: publish, load, deltas, digests
    checkpoint/   trainer checkpoints: one file, or DCP shards from N ranks
    launch/       the shell: `reel`, the supervisor, Slurm, vLLM command lines
    bench/        `reel bench NAME`, one module per bench, and their harness

At the root: what belongs to no room (the C build, shipped files, tokenizers, the run's blob
store, terminal tables, progress of long work, a role's heartbeat and event loop). The core (config, model, train, weights,
checkpoint and the root) imports bus/ only; launch/ and bench/ sit above producers/ and
consumers/ and import what they start.
"""
