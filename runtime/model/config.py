"""MoE model config: Qwen3-MoE keys, read from and written to an HF `config.json`.

No torch here, so `reel` can validate configs before importing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from reel.bus.errors import ReelError


class ModelError(ReelError, ValueError):
    """A model config, checkpoint or model input the user must fix; the message names it."""


class MoEConfig(msgspec.Struct, kw_only=True):
    vocab_size: int  # tokenizer vocabulary (rows of embed_tokens and lm_head)
    hidden_size: int = 64  # residual stream width H
    intermediate_size: int = 128  # dense MLP width (layers in mlp_only_layers or off the sparse step)
    moe_intermediate_size: int = 64  # width I of each expert's SwiGLU
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention: heads share k/v in groups
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2  # top-k
    norm_topk_prob: bool = True  # renormalise the top-k gate weights to sum to 1
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: list[int] = []  # layers with a dense MLP instead of experts
    initializer_range: float = 0.02  # std of the normal init of every matrix

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                    "decoder_sparse_step", "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise ModelError(f"model.{key} = {getattr(self, key)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"model.num_attention_heads = {self.num_attention_heads} must be a multiple of "
                             f"model.num_key_value_heads = {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelError(f"model.head_dim = {self.head_dim} must be even (RoPE rotates pairs)")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelError(f"model.num_experts_per_tok = {self.num_experts_per_tok} exceeds "
                             f"model.num_experts = {self.num_experts}")

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers that route to experts (the L of routing tensors)."""
        return [i for i in range(self.num_hidden_layers)
                if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0]

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json for transformers' Qwen3MoeForCausalLM and vLLM (both rope spellings)."""
        d = msgspec.structs.asdict(self)
        d.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            use_sliding_window=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            output_router_logits=False,
            dtype="float32",
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MoEConfig:
        """Reads an HF config dict (unknown keys ignored).

        Both spellings of transformers 4/5: rope_theta at top level or in rope_parameters,
        num_experts or num_local_experts.
        """
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelError(f"config.json rope type {rope.get('rope_type')!r} is not supported; use 'default'")
        for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
            if d.get(key, ok) != ok:
                raise ModelError(f"config.json {key} = {d[key]!r} is not supported; Reel needs {ok!r}")
        fields = {k: d[k] for k in cls.__struct_fields__ if d.get(k) is not None}
        if "num_experts" not in fields and d.get("num_local_experts") is not None:  # transformers 5 spelling
            fields["num_experts"] = d["num_local_experts"]
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        if "head_dim" not in fields and "hidden_size" in fields and "num_attention_heads" in fields:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        try:
            return msgspec.convert(fields, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ModelError(f"model config: {exc}") from exc


ARCHITECTURES = ("Qwen3MoeForCausalLM",)
# Keys Reel cannot take a default for: they fix the shapes of the checkpoint's tensors.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "num_experts_per_tok")


def read_checkpoint_config(directory: Path) -> MoEConfig:
    """The MoEConfig of an HF checkpoint directory, checked: a directory with a readable config.json
    of a supported architecture, the keys Reel needs, safetensors weights. ModelError names what is wrong."""
    if not directory.is_dir():
        raise ModelError(f"{directory} is not a directory; point it at an HF checkpoint directory")
    path = directory / "config.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(d, dict):
        raise ModelError(f"{path} is not a JSON object")
    architectures = d.get("architectures") or [d.get("model_type", "?")]
    if not set(architectures) & set(ARCHITECTURES) and d.get("model_type") != "qwen3_moe":
        raise ModelError(f"{path}: architecture {', '.join(map(str, architectures))} is not supported; "
                         f"Reel trains {', '.join(ARCHITECTURES)} (model_type qwen3_moe)")
    missing = [k for k in REQUIRED_KEYS if d.get(k) is None]
    if d.get("num_experts") is None and d.get("num_local_experts") is None:
        missing.append("num_experts")
    if missing:
        raise ModelError(f"{path} lacks {', '.join(missing)}")
    if d.get("quantization_config"):
        raise ModelError(f"{path}: quantized checkpoints (quantization_config) are not supported by the trainer; "
                         "use the BF16/FP32 checkpoint")
    if not any(directory.glob("*.safetensors")):
        raise ModelError(f"{directory} has no *.safetensors weights")
    return MoEConfig.from_hf_dict(d)
