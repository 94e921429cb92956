"""Shared by several tests (was test_weight_sync.py's)."""

from __future__ import annotations
import asyncio
import torch
from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.engine import SamplingParams
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import hub_tensors
from reel.runtime.weights.publish import publish_version
from reel.runtime.model.state_dict_adapter import hub_rows
from reel.runtime.weights.shard_hash import WRITE_HASH
from reel.runtime.weights.publish import Piece, write_pieces


SMALL = MoEConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=2, head_dim=16,
                  num_attention_heads=2, num_key_value_heads=1, num_experts=4, max_position_embeddings=64)

PROBE = SamplingParams(n=1, temperature=0.0, max_tokens=4, seed=0)

def model(seed: int, config: MoEConfig = SMALL) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(config)

def tensors(m: MoEModel) -> list[tuple[str, torch.Tensor]]:
    return list(hub_tensors(m.state_dict(), m.config))

def publish(blobs: BlobStore, m: MoEModel, version: int, **kwargs) -> tuple[BlobRef, WeightManifest]:
    return publish_version(blobs, tensors(m), version=version, step=version, shard_bytes=kwargs.pop("shard_bytes", 4096),
                           **kwargs)

async def serving(engine: BuiltinEngine) -> tuple[list[int], list[tuple[int, int]]]:
    completion, = await engine.generate([1, 2, 3], PROBE)
    return list(completion.tokens), completion.spans

def trained(m: MoEModel, lr: float = 1e-6) -> MoEModel:
    """A copy of `m` after one AdamW step on random gradients of half its tensors (the rest unchanged)."""
    nxt = model(0, m.config)
    nxt.load_state_dict(m.state_dict())
    params = list(nxt.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p) if i % 2 == 0 else torch.zeros_like(p)
    optimizer.step()
    return nxt

def swapped_engine(blobs: BlobStore, *manifests: WeightManifest, start: MoEModel | None = None) -> BuiltinEngine:
    engine = BuiltinEngine(start or model(9), max_batch=2, blobs=blobs, version=-1)

    async def swap() -> None:
        async with engine:
            for m in manifests:
                await engine.update_weights(m, m.version)
    asyncio.run(swap())
    return engine


RANKS = 3  # head_dim 16 and hidden 32 split unevenly over 3 ranks; 4 experts leave one rank a single one

def rank_pieces(m: MoEModel, rank: int, ranks: int = RANKS) -> list[Piece]:
    """What `local_pieces` gives on rank `rank` of `ranks` for an FSDP2-sharded `m` (torch.chunk rows)."""
    out = []
    for name, t in m.state_dict().items():
        chunk = -(-t.shape[0] // ranks)
        start, stop = min(rank * chunk, t.shape[0]), min((rank + 1) * chunk, t.shape[0])
        if stop == start:
            continue
        for hub, piece, first in hub_rows(name, t[start:stop], start, m.config):
            whole = first is None or (first, piece.shape[0]) == (0, t.shape[0])
            out.append(Piece(hub, piece.contiguous(), None if whole else (first, first + piece.shape[0], t.shape[0])))
    return out

def ranks_version(blobs: BlobStore, m: MoEModel, version: int, dtype: str = "float32") -> WeightManifest:
    shards = [s for rank in range(RANKS)
              for s in write_pieces(blobs, rank_pieces(m, rank), dtype, shard_bytes=4096, rank=rank)]
    return WeightManifest(version=version, step=version, dtype=dtype, shards=shards, hash=WRITE_HASH)
