"""Reel's in-memory parameter names <-> Hugging Face Hub names (what transformers and vLLM load).

Everything is a plain module path except the experts, which Reel stacks for grouped GEMMs:
  Reel  model.layers.{i}.mlp.experts.gate_proj            [E, I, H]   (up_proj alike; down_proj [E, H, I])
  Hub   model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I, H]
transformers 5 keeps a fused layout in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); `param_slices` accepts it too, in case a checkpoint was written raw.
With tied embeddings the Hub omits lm_head.weight.
"""

from __future__ import annotations

import re

import torch

from reel.runtime.model.config import MoEConfig

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")


def to_hf(state_dict: dict[str, torch.Tensor], config: MoEConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if m := _STACKED.match(name):
            for e in range(t.shape[0]):
                out[f"{m[1]}.{e}.{m[2]}.weight"] = t[e]
        elif not (name == "lm_head.weight" and config.tie_word_embeddings):
            out[name] = t
    return out


def hub_rows(name: str, t: torch.Tensor, start: int, config: MoEConfig) -> list[tuple[str, torch.Tensor, int | None]]:
    """Rows [start, start + len(t)) of Reel parameter `name` as Hub tensors: [(Hub name, tensor, first row
    of the Hub tensor, or None where it is whole)]. Stacked experts give whole per-expert tensors (the rows
    are experts); any other parameter is the same rows of its Hub tensor."""
    if m := _STACKED.match(name):
        return [(f"{m[1]}.{start + e}.{m[2]}.weight", t[e], None) for e in range(t.shape[0])]
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return []
    return [(name, t, start)]


def param_slices(name: str, t: torch.Tensor, config: MoEConfig) -> list[tuple[str, int | None, torch.Tensor]]:
    """Where one Hub tensor goes: [(Reel parameter, expert index or None for the whole, tensor)].

    Per tensor, so a checkpoint can be copied in one shard (one tensor) at a time.
    """
    if m := _PER_EXPERT.match(name):
        return [(f"{m[1]}.{m[3]}", int(m[2]), t)]
    if m := _FUSED.match(name):
        gate, up = t.chunk(2, dim=1)
        return [(f"{m[1]}.gate_proj", None, gate), (f"{m[1]}.up_proj", None, up)]
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return []
    return [(name, None, t)]
