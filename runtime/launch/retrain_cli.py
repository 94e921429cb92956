"""`reel retrain`: the offline trainer (consumers/retrain.py) wired to the envs that re-score its
samples (producers/envs/rescore.py, for --rescore). The shell is the floor that imports both sides."""

from __future__ import annotations

import argparse


def main(args: argparse.Namespace) -> int:
    from reel.consumers import retrain  # here: both import torch, which `reel --help` must not
    from reel.producers.envs.rescore import rescorer

    return retrain.main(args, rescorer=rescorer)
