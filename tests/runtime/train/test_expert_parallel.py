"""Expert parallelism on one process: the config keys, the layout rule, the dispatch index maths.
(The real multi-rank runs, on gloo, are in test_fsdp.py.)"""

from __future__ import annotations

import pytest
import torch

from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import from_dict
from reel.runtime.train.distributed import World
from reel.runtime.model.expert_parallel import received_order
from reel.runtime.model.moe import combine, sort_by_expert
from reel.runtime.model.parallelize import expert_degree


@pytest.mark.parametrize("trainer, model, key", [
    ({"ranks": 4, "expert_parallel": 3}, {}, "divide trainer.ranks = 4"),
    ({"ranks": 2, "expert_parallel": 0}, {}, "trainer.expert_parallel = 0"),
    ({"ranks": 4, "expert_parallel": 4}, {"num_experts": 6, "num_experts_per_tok": 2}, "model.num_experts = 6"),
])
def test_expert_parallel_errors_name_the_key(trainer: dict, model: dict, key: str) -> None:
    with pytest.raises(ConfigError, match="trainer.expert_parallel") as err:
        from_dict({"trainer": trainer, "model": model})
    assert key in str(err.value)


def test_expert_degree_falls_back_to_plain_fsdp_where_it_does_not_divide() -> None:
    assert expert_degree(World(0, 4), 2) == 2
    assert expert_degree(World(0, 3), 2) == 1  # a replay on 3 ranks of an EP = 2 run
    assert expert_degree(World(0, 2, emulated=True), 2) == 1  # one process holds every expert


def test_received_rows_regroup_by_local_expert() -> None:
    """2 EP ranks x 3 local experts: rows arrive [source rank, local expert] and must leave grouped by
    local expert with the source ranks in order (what each source's single-process sort gives)."""
    recv_counts_RE = torch.tensor([[2, 0, 1], [1, 3, 0]])
    tag_B = torch.tensor([0, 0, 2, 10, 11, 11, 11])  # 10 * source rank + local expert of each received row
    order_B, counts_El = received_order(recv_counts_RE)
    assert tag_B[order_B].tolist() == [0, 0, 10, 11, 11, 11, 2]
    assert counts_El.tolist() == [3, 3, 1]


def test_dispatch_of_two_emulated_ranks_matches_the_single_process_sort() -> None:
    """The send/receive bookkeeping of ExpertParallelExperts.forward, with the all-to-all done by hand."""
    gen = torch.Generator().manual_seed(0)
    R, El, K = 2, 2, 2
    ids = [torch.randint(0, R * El, (5, K), generator=gen) for _ in range(R)]
    x = [torch.randn(5, 3, generator=gen) for _ in range(R)]
    sent = []  # per source rank: (order, rows sorted by expert, counts per expert)
    for r in range(R):
        order_A, counts_E = sort_by_expert(ids[r], R * El)
        sent.append((order_A, x[r][order_A // K], counts_E))
    outputs = []
    for dst in range(R):  # what rank dst receives, and what it computes: row * (1 + global expert id)
        recv_counts_RE = torch.stack([c[dst * El:(dst + 1) * El] for _, _, c in sent])
        chunks = [rows.split(c.view(R, El).sum(1).tolist())[dst] for _, rows, c in sent]
        order_B, counts_El = received_order(recv_counts_RE)
        expert_B = torch.arange(El).repeat_interleave(counts_El) + dst * El
        y_sorted_BH = torch.cat(chunks)[order_B] * (1 + expert_B[:, None])
        outputs.append(y_sorted_BH[torch.argsort(order_B)].split(recv_counts_RE.sum(1).tolist()))
    for r in range(R):
        order_A, _, _ = sent[r]
        y_AH = torch.cat([outputs[dst][r] for dst in range(R)])
        w_NK = torch.ones(5, K)
        want_NH = (x[r][:, None, :] * (1 + ids[r][:, :, None])).sum(1)
        torch.testing.assert_close(combine(y_AH, order_A, w_NK), want_NH)
