"""The tiny Qwen3-MoE the vLLM tests serve, and the calls they share (tests/producers/conftest.py
starts one `vllm serve` on it for the session: the vLLM tests share one xdist worker)."""

from __future__ import annotations

from pathlib import Path

import torch

from reel.bus.blob_backends.file import BlobStore
from reel.producers.vllm_http import VLLMHTTPEngine
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import state_dict_bytes

TINY = MoEConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention: head_dim >= 32
                 num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=1024)
# The run config whose [engine] the server is started for (vllm_args.local_serve_argv, as `reel run` does).
RUN = """
[model]
hidden_size = 64
[engine]
kind = "vllm"
max_batch = 16
[trainer]
router_replay = false
"""

# The `models` fixture: (directory vLLM starts from, the model saved there, another model of the same shape).
Models = tuple[Path, MoEModel, MoEModel]


def tiny_model(seed: int) -> MoEModel:
    torch.manual_seed(seed)
    model = MoEModel(TINY)
    with torch.no_grad():  # wider than the default init, so greedy tokens are decided by clear margins
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.05) if "norm" in name else p.normal_(0.0, 0.08)
    return model.eval()


def http_engine(models: Models, url: str, blobs: BlobStore, **kwargs) -> VLLMHTTPEngine:
    return VLLMHTTPEngine(models[0], url=url, blobs=blobs, version=-1, routed_experts=False, **kwargs)


async def push(engine, model: MoEModel, blobs: BlobStore, version: int) -> None:
    await engine.update_weights(blobs.put(state_dict_bytes(model)), version)


def reel_logprobs(model: MoEModel, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each completion token under Reel's own forward (teacher-forced)."""
    ids_BT = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits_TV = model(ids_BT).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits_TV, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
