"""Same inputs, same bits: seeds, deterministic kernels and a fixed thread count."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def set_determinism(seed: int, threads: int | None = None) -> None:
    # cuBLAS reads this when it creates its handle; deterministic mode requires it on CUDA.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    if threads is not None:
        torch.set_num_threads(threads)  # CPU reductions split by thread: a different count, different bits
