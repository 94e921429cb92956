"""Reel's model and transformers' Qwen3MoeForCausalLM read each other's checkpoints and agree."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from reel.runtime.model import weights  # noqa: E402
from reel.runtime.model.config import MoEConfig  # noqa: E402
from reel.runtime.model.model import MoEModel  # noqa: E402

torch.set_num_threads(2)

TINY = dict(vocab_size=61, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=64, mlp_only_layers=[1])


def _randomise(model: torch.nn.Module) -> None:
    """Default inits leave routers near-uniform; wider weights make routing decisive."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.1)


def _hf_model(norm_topk_prob: bool = True):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{**TINY, "norm_topk_prob": norm_topk_prob},
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                      attn_implementation="eager")
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    _randomise(hf)
    return hf


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_transformers_checkpoint_loads_in_reel(tmp_path, norm_topk_prob):
    hf = _hf_model(norm_topk_prob)
    hf.save_pretrained(tmp_path)
    model = weights.load(tmp_path)
    assert model.config.num_experts == 6 and model.config.rope_theta == 5000.0
    ids_BT = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids_BT).logits
        got = model(ids_BT).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_reel_checkpoint_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    model = MoEModel(MoEConfig(**TINY, rope_theta=5000.0))
    _randomise(model)
    weights.save(model, tmp_path)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.num_experts == 6
    ids_BT = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids_BT).logits, hf(ids_BT).logits, atol=1e-4, rtol=0)


def test_padded_batch_matches_transformers_with_mask(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    model = weights.load(tmp_path)
    ids_BT = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    mask_BT = torch.ones(2, 9, dtype=torch.long)
    mask_BT[1, 6:] = 0
    with torch.no_grad():
        got = model(ids_BT, mask_BT).logits
        want = hf(ids_BT[1:, :6]).logits
    torch.testing.assert_close(got[1, :6], want[0], atol=1e-4, rtol=0)


def test_config_reads_both_rope_spellings():
    base = {**TINY, "num_local_experts": 6}
    base.pop("num_experts")
    legacy = MoEConfig.from_hf_dict({**base, "rope_theta": 123.0})
    v5 = MoEConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 321.0}})
    assert (legacy.rope_theta, v5.rope_theta, v5.num_experts) == (123.0, 321.0, 6)
    written = MoEConfig.from_hf_dict(json.loads(json.dumps(v5.to_hf_dict())))
    assert written == v5
