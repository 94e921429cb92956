"""The trainer's ranks: one logical trainer over N processes (torch.distributed + FSDP2).

Every rank holds a shard of the parameters, gradients and AdamW state (`fully_shard` per decoder
layer and at the root; expert weights [E, ...] shard on dim 0, the expert dim) and trains on its
share of each batch. Backend: NCCL when CUDA is present, gloo on CPU. torchrun starts the ranks
(RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment); without it the trainer is one process
and nothing here touches torch.distributed.

Why the loss stays a token mean over the whole batch: every rank gets the whole batch, scales its
micro-batches by their share of the batch's tokens, and gradients are *summed* across ranks (the
divide factor is 1; gloo cannot PREMUL_SUM, so the sum is forced). A rank's share of a batch
depends only on the batch and the world size, so replay on the same world size gets the same one.
With context parallelism (World.cp = C > 1) the batch is dealt to the size / C data-parallel
groups instead; the C ranks of a group train the same micro-batches, each on a slice of their
positions (runtime/model/context_parallel.py).

An `emulated` World is one process playing every rank in turn with no process group: the
reference the group is tested against (same micro-batches, accumulated in rank order).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from reel.runtime.train.batch import Batch, MicroBatch, micro_batches, take


class World(NamedTuple):
    rank: int = 0
    size: int = 1
    emulated: bool = False  # one process running every rank's share (no process group)
    cp: int = 1  # ranks of a context-parallel group: consecutive ranks that share their micro-batches

    @property
    def distributed(self) -> bool:
        return self.size > 1 and not self.emulated

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: each gets its own share of a batch (CP ranks split its positions)."""
        return self.size // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def ranks_here(self) -> range:
        """The data-parallel groups whose share of a batch this process trains."""
        return range(self.size) if self.emulated else range(self.dp_rank, self.dp_rank + 1)

    @property
    def device(self) -> torch.device:
        if self.distributed and dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


LOCAL = World()


def from_env() -> World:
    """This process's rank when torchrun started it (WORLD_SIZE > 1), else the single-process world."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return LOCAL
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    return World(dist.get_rank(), dist.get_world_size())


def shutdown(world: World, *, drain: bool = True) -> None:
    """Leave the process group. `drain` (every rank is alive and done): meet the others first, so no
    rank tears down its gloo connections while a peer is still reading from them (that peer then
    aborts at exit: "terminate called without an active exception")."""
    if world.distributed and dist.is_initialized():
        if drain:
            dist.barrier()
        dist.destroy_process_group()


# ---- the batch split ------------------------------------------------------------------------

def rank_rows(batch: Batch, rank: int, size: int) -> torch.Tensor:
    """Rows of `rank`: rows sorted by length (stable) dealt round-robin, in batch order.

    Dealing sorted rows balances tokens across ranks; size 1 keeps every row in order."""
    lengths_B = batch.attention_mask_BT.sum(dim=1)
    order = torch.argsort(lengths_B, stable=True)
    return torch.sort(order[rank::size]).values


def rank_parts(batch: Batch, max_tokens: int, rank: int, size: int) -> list[tuple[MicroBatch, Batch]]:
    """The micro-batches of one rank's rows, with their sub-batches (rows indexed in the batch)."""
    rows_R = rank_rows(batch, rank, size)
    if len(rows_R) == 0:
        return []
    mine = take(batch, MicroBatch(rows_R, int(batch.attention_mask_BT.shape[1])))
    out = []
    for mb in micro_batches(mine, max_tokens):
        whole = MicroBatch(rows_R[mb.rows_M], mb.length)
        out.append((whole, take(batch, whole)))
    return out


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch's tensors on the ranks' device (CUDA under NCCL; on CPU nothing moves)."""
    return Batch(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in batch))


class Plan(NamedTuple):
    """Who trains what in one step."""

    local: list[tuple[MicroBatch, Batch, bool]]  # (micro-batch, sub-batch, counts) run here, in order


def plan(batch: Batch, max_tokens: int, world: World) -> Plan:
    """Rows go to data-parallel groups, not ranks: the CP ranks of a group get the same micro-batches.
    Every rank runs the same number of forwards and backwards (FSDP's collectives must pair up):
    a group with fewer micro-batches repeats its last one with weight 0 (`counts` False)."""
    if world.distributed:
        batch = to_device(batch, world.device)
    by_group = [rank_parts(batch, max_tokens, d, world.dp_size) for d in range(world.dp_size)]
    if not world.distributed:
        return Plan([(mb, sub, True) for d in world.ranks_here for mb, sub in by_group[d]])
    rounds = max(len(parts) for parts in by_group)
    mine = by_group[world.dp_rank]
    filler = mine[-1] if mine else by_group[0][0]
    local = [(mb, sub, True) for mb, sub in mine] + [(*filler, False)] * (rounds - len(mine))
    return Plan(local)


# ---- collectives (identity on one process) -------------------------------------------------

def all_sum(world: World, value: float) -> float:
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return float(t.item())


def gather_tokens(world: World, values_N: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D tensor concatenated in rank order, on every rank (on the ranks' device)."""
    if not world.distributed:
        return values_N
    lengths = [torch.zeros(1, dtype=torch.int64, device=world.device) for _ in range(world.size)]
    dist.all_gather(lengths, torch.tensor([values_N.numel()], dtype=torch.int64, device=world.device))
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=values_N.dtype, device=world.device)
    padded[:values_N.numel()] = values_N.detach().to(world.device)
    out = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(out, padded)
    return torch.cat([t[:int(n)] for t, n in zip(out, lengths)])


def broadcast_bytes(world: World, data: bytes | None) -> bytes:
    """Rank 0's bytes on every rank (raw bytes in a uint8 tensor: no pickle on the wire)."""
    if not world.distributed:
        return data or b""
    size = torch.tensor([len(data) if world.rank == 0 and data else 0], dtype=torch.int64, device=world.device)
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size), dtype=torch.uint8, device=world.device)
    if world.rank == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes()


def gather_bytes(world: World, data: bytes) -> list[bytes]:
    """Every rank's bytes, in rank order, on every rank (uint8 tensors padded to the longest: no pickle)."""
    if not world.distributed:
        return [data]
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    lengths = gather_tokens(world, torch.tensor([len(data)], dtype=torch.int64)).tolist()
    padded = torch.zeros(max(*lengths, 1), dtype=torch.uint8, device=world.device)
    padded[:len(data)] = mine.to(world.device)
    out = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(out, padded)
    return [t[:n].cpu().numpy().tobytes() for t, n in zip(out, lengths)]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


# ---- FSDP2 ----------------------------------------------------------------------------------

def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sync_gradients(model: nn.Module, on: bool) -> None:
    """Reduce-scatter gradients on this backward (on) or keep accumulating locally (off)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(on)  # type: ignore[operator]


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip all gradients to a global norm of `max_norm`; -> that norm before clipping.

    With expert parallelism the experts' gradients live on another mesh than the rest, which
    torch's `clip_grad_norm_` cannot stack: one norm per mesh, combined, one clip factor."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if len(by_mesh) <= 1:
        return as_float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
    norms = [torch.nn.utils.get_total_norm(grads, foreach=False) for grads in by_mesh.values()]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in by_mesh.values():
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return float(total)


def as_float(value: torch.Tensor) -> float:
    """A (possibly DTensor) scalar as a Python float: the global value."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU: on rank 0 for a sharded model (a collective: call on every
    rank; the others get {}), the module's own state dict otherwise."""
    if not is_sharded(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
