"""Turn logged GRPO groups into the tensors of one training step.

Pure: the same events in the same order give the same tensors, so the trainer, `reel replay` and
`reel retrain` build identical batches from the bus or from the log.

Legend: B samples (rows), T positions, L MoE layers, K experts per token, G groups, S samples per group.
Row b holds prompt + completion[:-1] (what went through the inference forward); the target at
position t is the token at t + 1, so completion token j is predicted at position P + j - 1. In a
multi-turn sample the tokens an env appended (Sample.env_spans) are targets the loss never sees.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np
import torch

from reel.bus.events import RoutingTrace, Tensor, Trajectory
from reel.bus.logcodec import unpack
from reel.bus.logformat import BadRecord
from reel.runtime.train.loss import grpo_advantages


class Group(NamedTuple):
    """One GRPO group with its routing resolved to arrays (blob traces already fetched)."""

    trajectory: Trajectory
    routing: list[np.ndarray]  # per sample [P + C - 1, L, K]


class Batch(NamedTuple):
    input_ids_BT: torch.Tensor  # int64, right-padded with 0
    attention_mask_BT: torch.Tensor  # int64, 1 = real token
    targets_BT: torch.Tensor  # int64 next token (0 where not a completion token)
    loss_mask_BT: torch.Tensor  # bool, True where the target is a completion token the model sampled
    logp_mu_BT: torch.Tensor  # float32 logged inference logprob of the target
    advantages_BT: torch.Tensor  # float32 GRPO advantage of the row, on completion targets
    versions_BT: torch.Tensor  # int64 policy version that sampled the target (-1 elsewhere)
    routing_BTLK: torch.Tensor | None  # int64 logged expert ids, None when a trace is missing
    temperature_B: torch.Tensor  # float32 sampling temperature per row
    rewards_B: torch.Tensor  # float32
    group_ids: list[str]

    @property
    def tokens(self) -> int:
        return int(self.loss_mask_BT.sum())


def decode_routing(trace: RoutingTrace, blob_bytes: bytes | None) -> list[np.ndarray]:
    """Per-sample expert ids of a trace; `blob_bytes` is the blob's content when the trace has one."""
    if trace.blob is None:
        return [t.numpy() for t in trace.experts]
    if blob_bytes is None:
        raise ValueError(f"routing trace of group {trace.group_id} is in a blob that was not fetched")
    try:
        data = unpack(blob_bytes)  # zstd-packed (bus/logcodec.py), or raw msgpack (a run from before packing)
    except BadRecord as exc:
        raise ValueError(f"the routing blob {trace.blob.sha256} of group {trace.group_id} holds {exc}") from None
    return [t.numpy() for t in msgspec.msgpack.decode(data, type=list[Tensor])]


def routing_problem(group: Group, moe_layers: int, top_k: int, num_experts: int) -> str | None:
    """Why a group's routing cannot be replayed (it must then be dropped), or None when it can."""
    traj = group.trajectory
    if len(group.routing) != len(traj.samples):
        return f"routing trace has {len(group.routing)} samples, the trajectory {len(traj.samples)}"
    for i, (sample, ids) in enumerate(zip(traj.samples, group.routing)):
        want = (len(traj.prompt.numpy()) + len(sample.tokens.numpy()) - 1, moe_layers, top_k)
        if tuple(ids.shape) != want:
            return f"routing of sample {i} has shape {list(ids.shape)}, its tokens need {list(want)}"
        if ids.size and int(ids.max()) >= num_experts:
            return f"routing of sample {i} names expert {int(ids.max())} of {num_experts}"
    return None


def token_versions(spans: list[tuple[int, int]], length: int) -> np.ndarray:
    """Policy version of each completion token from its spans [(first_token, version)]."""
    versions = np.zeros(length, dtype=np.int64)
    for first, version in spans:
        versions[first:] = version
    return versions


def sampled_mask(env_spans: list[tuple[int, int]], length: int) -> np.ndarray:
    """True at the completion tokens the model sampled, False at those an env appended."""
    mask = np.ones(length, dtype=bool)
    for first, end in env_spans:
        mask[first:end] = False
    return mask


def build_batch(groups: list[Group]) -> Batch:
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, float, np.ndarray]] = []
    rewards: list[float] = []
    advantages: list[float] = []
    for group in groups:
        traj = group.trajectory
        prompt = traj.prompt.numpy().astype(np.int64)
        rewards_S = torch.tensor([s.reward for s in traj.samples], dtype=torch.float32)
        adv_S = grpo_advantages(rewards_S[None, :])[0]
        for i, sample in enumerate(traj.samples):
            completion = sample.tokens.numpy().astype(np.int64)
            routing = group.routing[i] if i < len(group.routing) else None
            rows.append((prompt, completion, sample.logprobs.numpy(), token_versions(sample.spans, len(completion)),
                         routing, traj.temperature, sampled_mask(sample.env_spans, len(completion))))
            rewards.append(sample.reward)
            advantages.append(float(adv_S[i]))
    lengths = [len(p) + len(c) - 1 for p, c, *_ in rows]
    B, T = len(rows), max(lengths)
    has_routing = all(r[4] is not None and len(r[4]) == n for r, n in zip(rows, lengths))
    if not has_routing and any(r[4] is not None and len(r[4]) for r in rows):
        # Router replay would silently be off for every group of the step: refuse instead (the
        # trainer drops a group whose routing fails routing_problem before it gets here).
        row_groups = [g.trajectory.group_id for g in groups for _ in g.trajectory.samples]
        bad = next(g for g, r, n in zip(row_groups, rows, lengths) if r[4] is None or len(r[4]) != n)
        raise ValueError(f"group {bad} has no routing that matches its tokens while others have; "
                         "drop it (reel.runtime.train.batch.routing_problem) or drop every trace")
    input_ids = np.zeros((B, T), np.int64)
    mask = np.zeros((B, T), np.int64)
    targets = np.zeros((B, T), np.int64)
    loss_mask = np.zeros((B, T), bool)
    logp_mu = np.zeros((B, T), np.float32)
    adv = np.zeros((B, T), np.float32)
    versions = np.full((B, T), -1, np.int64)
    routing = None
    if has_routing:
        L, K = rows[0][4].shape[1:]
        routing = np.zeros((B, T, L, K), np.int64)
    for b, ((prompt, completion, lp, ver, rt, _, sampled), n) in enumerate(zip(rows, lengths)):
        P, C = len(prompt), len(completion)
        input_ids[b, :n] = np.concatenate([prompt, completion[:-1]])
        mask[b, :n] = 1
        targets[b, P - 1:P - 1 + C] = completion
        loss_mask[b, P - 1:P - 1 + C] = sampled
        logp_mu[b, P - 1:P - 1 + C] = lp
        adv[b, P - 1:P - 1 + C] = advantages[b]
        versions[b, P - 1:P - 1 + C] = ver
        if routing is not None:
            routing[b, :n] = rt
    return Batch(
        input_ids_BT=torch.from_numpy(input_ids), attention_mask_BT=torch.from_numpy(mask),
        targets_BT=torch.from_numpy(targets), loss_mask_BT=torch.from_numpy(loss_mask),
        logp_mu_BT=torch.from_numpy(logp_mu), advantages_BT=torch.from_numpy(adv),
        versions_BT=torch.from_numpy(versions),
        routing_BTLK=torch.from_numpy(routing) if routing is not None else None,
        temperature_B=torch.tensor([r[5] for r in rows], dtype=torch.float32),
        rewards_B=torch.tensor(rewards, dtype=torch.float32),
        group_ids=[g.trajectory.group_id for g in groups],
    )


class MicroBatch(NamedTuple):
    rows_M: torch.Tensor  # int64 indices of the batch rows it holds
    length: int  # positions kept: its longest row


def micro_batches(batch: Batch, max_tokens: int) -> list[MicroBatch]:
    """Rows grouped by length into micro-batches of at most max_tokens padded positions (`length_groups`)."""
    lengths = batch.attention_mask_BT.sum(dim=1).tolist()
    if max_tokens <= 0:
        return [MicroBatch(torch.arange(len(lengths)), int(batch.attention_mask_BT.shape[1]))]
    return [MicroBatch(torch.tensor(rows), int(lengths[rows[-1]])) for rows in length_groups(lengths, max_tokens)]


def length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch of rows of these lengths, at most max_tokens padded positions each.

    0 = one micro-batch with every row in order. Otherwise rows are ordered by length (stable),
    so a long-tail batch does not pad every short row to its longest sample; each micro-batch is
    trimmed to its own longest row, its last. The grouping depends only on the batch: replay gets the same.
    """
    if max_tokens <= 0:
        return [list(range(len(lengths)))]
    out: list[list[int]] = []
    current: list[int] = []
    for b in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and lengths[b] * (len(current) + 1) > max_tokens:  # ascending: the newest row is the longest
            out.append(current)
            current = []
        current.append(b)
    out.append(current)
    return out


class PaddedWork(NamedTuple):
    """What a step's forward and backward passes compute over, padding included."""

    positions: int  # each micro-batch's rows times its longest row
    scores: int  # attention scores: each micro-batch's rows times its longest row squared


def padded_work(lengths: list[int], max_tokens: int) -> PaddedWork:
    """The padded positions and attention scores of rows of these lengths in micro-batches of max_tokens."""
    parts = [(len(rows), max(lengths[b] for b in rows)) for rows in length_groups(lengths, max_tokens)]
    return PaddedWork(sum(n * t for n, t in parts), sum(n * t * t for n, t in parts))


def take(batch: Batch, mb: MicroBatch) -> Batch:
    """The rows of one micro-batch, positions trimmed to its longest row."""
    rows, T = mb.rows_M, mb.length
    return Batch(
        input_ids_BT=batch.input_ids_BT[rows, :T], attention_mask_BT=batch.attention_mask_BT[rows, :T],
        targets_BT=batch.targets_BT[rows, :T], loss_mask_BT=batch.loss_mask_BT[rows, :T],
        logp_mu_BT=batch.logp_mu_BT[rows, :T], advantages_BT=batch.advantages_BT[rows, :T],
        versions_BT=batch.versions_BT[rows, :T],
        routing_BTLK=None if batch.routing_BTLK is None else batch.routing_BTLK[rows, :T],
        temperature_B=batch.temperature_B[rows], rewards_B=batch.rewards_B[rows],
        group_ids=batch.group_ids,
    )
