"""Trainer checkpoints: model, AdamW state and RNG, never pickle.

    single.py         one process: one safetensors file
    sharded.py        N ranks: torch.distributed.checkpoint (DCP) shards, resharded on load
    dcp_metadata.py   DCP's .metadata read without trusting it

Imports bus/ and train/distributed.py.
"""
