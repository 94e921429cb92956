"""One rank of test_context_parallel's 2-rank gloo run: what torch's CP sharding gives each rank of
one CP group (no attention: torch's ring attention has no CPU kernel).

    cp_peer.py OUT    rank r writes OUT/rank{r}.json: per micro-batch of fsdp_peer's first batch, the
                      real tokens of its slice as (row, position id, input id, target, loss mask)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fsdp_peer import MICRO_BATCH_TOKENS, batches
from reel.runtime.train import distributed
from reel.runtime.model.context_parallel import sequence_shard


def main(out: str) -> None:
    # cp set by hand: context_degree refuses CPU ranks, for the attention; the sharding runs here.
    world = distributed.from_env()._replace(cp=2)
    local = distributed.plan(batches(1)[0], MICRO_BATCH_TOKENS, world).local
    slices = []
    for mb, sub, counts in local:
        with sequence_shard(world, sub) as (piece, positions_BT):
            real_BT = piece.attention_mask_BT.bool()
            rows_BT = mb.rows_M[:, None].expand_as(real_BT)
            fields = (rows_BT, positions_BT, piece.input_ids_BT, piece.targets_BT, piece.loss_mask_BT)
            slices.append({"counts": counts, "width": int(real_BT.shape[1]),
                           "tokens": torch.stack([f[real_BT].long() for f in fields], 1).tolist()})
    (Path(out) / f"rank{world.rank}.json").write_text(json.dumps(slices))
    distributed.shutdown(world)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
