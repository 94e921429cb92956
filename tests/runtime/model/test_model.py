"""The MoE model: KV-cache decode = full forward, router replay, precision modes, determinism, weights I/O."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as st_save

from reel.runtime import cbuild
from reel.runtime.model import native, weights
from reel.runtime.model.cached_forward import forward_cached
from reel.runtime.model.config import ModelError, MoEConfig
from reel.runtime.model.determinism import set_determinism
from reel.runtime.model.kvcache import new_cache
from reel.runtime.model.model import MoEModel

torch.set_num_threads(2)

CFG = MoEConfig(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                mlp_only_layers=[1], max_position_embeddings=64)


def _model(seed: int = 0, cfg: MoEConfig = CFG, std: float = 0.2) -> MoEModel:
    torch.manual_seed(seed)
    model = MoEModel(cfg)
    with torch.no_grad():  # wider than the 0.02 default so that routing is decisive
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, std)
    return model


def _ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_routing_shape_and_padding_invariance():
    model = _model()
    ids_BT = _ids(3, 10)
    mask_BT = torch.ones(3, 10, dtype=torch.long)
    mask_BT[1, 7:] = 0
    mask_BT[2, 1:] = 0
    with torch.no_grad():
        out = model(ids_BT, mask_BT, return_routing=True)
        alone = model(ids_BT[1:2, :7], return_routing=True)
    assert out.logits.shape == (3, 10, 40) and out.logits.dtype == torch.float32
    assert out.routing.shape == (3, 10, 2, 2) and out.routing.dtype == torch.int64
    assert out.aux_loss is None and torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.logits[1, :7], alone.logits[0], atol=1e-5, rtol=0)
    assert torch.equal(out.routing[1, :7], alone.routing[0])


def test_kv_cache_decode_matches_full_forward_token_by_token(kernels: str):
    model = _model()
    lengths = [9, 4, 6]
    seqs = [_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    with torch.no_grad():
        full = [model(s[None], return_routing=True) for s in seqs]
    cache = new_cache(model, slots=4, max_len=16)
    slot_of = [2, 0, 3]  # slots need not follow sequence order
    for p in range(max(lengths)):  # one batched call per step; finished sequences drop out
        live = [i for i, n in enumerate(lengths) if p < n]
        out = forward_cached(model, torch.stack([seqs[i][p] for i in live]), torch.tensor([slot_of[i] for i in live]),
                             torch.full((len(live),), p), cache, return_routing=True)
        for row, i in enumerate(live):
            torch.testing.assert_close(out.logits[row], full[i].logits[0, p], atol=1e-5, rtol=1e-5)
            assert torch.equal(out.routing[row], full[i].routing[0, p])


def test_mixed_prefill_chunks_and_decode_in_one_call(kernels: str):
    model = _model()
    a, b, c = _ids(8, seed=3), _ids(7, seed=4), _ids(5, seed=5)
    with torch.no_grad():
        want = [model(s[None]).logits[0] for s in (a, b, c)]
    cache = new_cache(model, slots=3, max_len=8)
    # call 1: prefill a[:5] (slot 0) and b[:3] (slot 1)
    forward_cached(model, torch.cat([a[:5], b[:3]]), torch.tensor([0] * 5 + [1] * 3),
                   torch.tensor([*range(5), *range(3)]), cache)
    # call 2: decode a[5], prefill chunk b[3:7], whole prompt c (slot 2), in one batch
    ids_N = torch.cat([a[5:6], b[3:7], c])
    slots_N = torch.tensor([0] + [1] * 4 + [2] * 5)
    pos_N = torch.tensor([5, 3, 4, 5, 6, *range(5)])
    out = forward_cached(model, ids_N, slots_N, pos_N, cache)
    torch.testing.assert_close(out.logits[0], want[0][5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[1:5], want[1][3:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[5:], want[2], atol=1e-5, rtol=1e-5)


def test_cache_overflow_names_the_position():
    model = _model()
    with pytest.raises(ModelError, match="position 4"):
        forward_cached(model, _ids(1), torch.tensor([0]), torch.tensor([4]), new_cache(model, 1, 4))


def test_replaying_own_routing_is_a_no_op(kernels: str):
    model = _model()
    ids_BT = _ids(2, 9)
    out = model(ids_BT, return_routing=True)
    replayed = model(ids_BT, replay_routing_BTLK=out.routing.to(torch.uint8), return_routing=True)
    assert torch.equal(replayed.logits, out.logits) and torch.equal(replayed.routing, out.routing)
    cache = new_cache(model, 1, 9)
    live = forward_cached(model, ids_BT[0], torch.zeros(9, dtype=torch.long), torch.arange(9), cache,
                          return_routing=True)
    cache = new_cache(model, 1, 9)
    again = forward_cached(model, ids_BT[0], torch.zeros(9, dtype=torch.long), torch.arange(9), cache,
                           replay_routing_NLK=live.routing)
    assert torch.equal(again.logits, live.logits)


def test_replaying_other_routing_changes_outputs_and_trains_the_router():
    model = _model()
    ids_BT = _ids(2, 9)
    own = model(ids_BT, return_routing=True).routing
    other = (own + 3) % CFG.num_experts
    out = model(ids_BT, replay_routing_BTLK=other, return_routing=True, aux_loss=True)
    assert torch.equal(out.routing, other)
    assert not torch.allclose(out.logits, model(ids_BT).logits)
    (out.logits.logsumexp(-1).mean() + out.aux_loss).backward()
    for i in (0, 2):
        grad = model.model.layers[i].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_replay_shape_is_checked():
    model = _model()
    with pytest.raises(ModelError, match="replay_routing_BTLK"):
        model(_ids(2, 5), replay_routing_BTLK=torch.zeros(2, 5, 3, 2, dtype=torch.long))


def test_aux_loss_is_one_when_balanced_and_ignores_padding():
    model = _model(std=0.0)  # zero router weights: uniform scores
    balanced_TK = torch.stack([torch.arange(8), torch.arange(8) + 4], -1) % 8  # each expert twice
    routing_BTLK = torch.zeros(2, 12, 2, 2, dtype=torch.long)  # padding all on expert 0
    routing_BTLK[:, :8] = balanced_TK[None, :, None, :]
    mask_BT = torch.zeros(2, 12, dtype=torch.long)
    mask_BT[:, :8] = 1
    out = model(_ids(2, 12), mask_BT, replay_routing_BTLK=routing_BTLK, aux_loss=True)
    torch.testing.assert_close(out.aux_loss, torch.tensor(1.0))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_precision_modes_change_compute_not_parameters(precision):
    model = _model()
    ids_BT = _ids(2, 6)
    ref = model(ids_BT, return_routing=True)
    model.precision = precision
    out = model(ids_BT, replay_routing_BTLK=ref.routing)  # same experts: only rounding differs
    out.logits.sum().backward()
    err = (out.logits - ref.logits).abs().max() / ref.logits.abs().max()
    assert out.logits.dtype == torch.float32 and 0 < err < {"bf16": 0.05, "fp8": 0.3}[precision]
    assert all(p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())
    with pytest.raises(ModelError, match="fp16"):
        model.precision = "fp16"


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_same_seed_same_bits_forward_and_backward(precision):
    results = []
    for _ in range(2):
        set_determinism(7, threads=2)
        model = _model(seed=7)
        model.precision = precision
        out = model(_ids(2, 8), aux_loss=True, return_routing=True)
        (out.logits.log_softmax(-1).mean() + 0.01 * out.aux_loss).backward()
        results.append([out.logits] + [p.grad for p in model.parameters()])
    torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_weights_round_trip_files_and_bytes(tmp_path):
    cfg = MoEConfig(**{**{k: getattr(CFG, k) for k in CFG.__struct_fields__}, "tie_word_embeddings": True})
    model = _model(cfg=cfg)
    weights.save(model, tmp_path)
    loaded = weights.load(tmp_path, precision="bf16")
    assert loaded.precision == "bf16" and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    loaded.precision = "fp32"
    ids_BT = _ids(1, 5)
    assert torch.equal(loaded(ids_BT).logits, model(ids_BT).logits)
    other = _model(seed=1, cfg=cfg)
    weights.load_state_dict_bytes(other, weights.state_dict_bytes(model))
    assert torch.equal(other(ids_BT).logits, model(ids_BT).logits)


def test_weight_errors_name_the_file_or_tensor(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        weights.load(tmp_path)
    model = _model()
    weights.save(model, tmp_path)
    small = MoEModel(MoEConfig(**{**{k: getattr(CFG, k) for k in CFG.__struct_fields__}, "num_experts": 4}))
    with pytest.raises(ModelError, match=r"experts\.[4-7]\.\w+\.weight but config.json says num_experts = 4"):
        weights.load_state_dict_bytes(small, weights.state_dict_bytes(model))
    with pytest.raises(ModelError, match=r"has shape \(8, 32\), the config needs \(4, 32\)"):
        weights.load_state_dict_bytes(small, st_save({"model.layers.0.mlp.gate.weight": torch.zeros(8, 32)}))
    with pytest.raises(ModelError, match=r"lacks tensor model.embed_tokens.weight"):
        weights.load_state_dict_bytes(model, st_save({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(ModelError, match="not valid safetensors"):
        weights.load_state_dict_bytes(model, b"junk")


def test_config_errors_name_the_key():
    with pytest.raises(ModelError, match="num_key_value_heads"):
        MoEConfig(vocab_size=10, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ModelError, match="hidden_act"):
        MoEConfig.from_hf_dict({"vocab_size": 10, "hidden_act": "gelu"})
    assert CFG.moe_layers == [0, 2]


@pytest.mark.parametrize("missing", ["compiler", "writable cache"])
def test_without_a_build_the_torch_path_serves(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog,
                                               missing: str) -> None:
    if missing == "compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("REEL_CACHE", str(tmp_path))
    else:  # a file where the cache directory should be
        (tmp_path / "cache").write_text("")
        monkeypatch.setenv("REEL_CACHE", str(tmp_path / "cache"))
    cbuild.load.cache_clear()
    try:
        model = _model()
        assert not native.usable(model, _ids(1))
        out = forward_cached(model, _ids(3), torch.zeros(3, dtype=torch.long), torch.arange(3), new_cache(model, 1, 4))
        with torch.no_grad():
            torch.testing.assert_close(out.logits, model(_ids(3)[None]).logits[0], atol=1e-5, rtol=1e-5)
        assert "did not build" in caplog.text
    finally:
        cbuild.load.cache_clear()


@pytest.mark.parametrize("bad", ["token", "slot", "expert"])
def test_out_of_range_indices_are_refused_not_written(kernels: str, bad: str) -> None:
    model = _model()
    cache = new_cache(model, 2, 8)
    ids, slots, pos = _ids(3), torch.zeros(3, dtype=torch.long), torch.arange(3)
    replay = torch.zeros(3, len(CFG.moe_layers), CFG.num_experts_per_tok, dtype=torch.long)
    if bad == "token":
        ids[1] = CFG.vocab_size
    elif bad == "slot":
        slots[2] = 2
    else:
        replay[0, 0, 1] = CFG.num_experts
    before = cache.k.clone()
    with pytest.raises((ModelError, IndexError, RuntimeError)):
        forward_cached(model, ids, slots, pos, cache, replay_routing_NLK=replay)
    if kernels == "C":
        assert torch.equal(cache.k, before)  # refused before anything was written
