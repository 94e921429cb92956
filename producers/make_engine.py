"""The configured inference engine of a rollout worker or the eval role: built-in, vLLM in process, or vLLM over HTTP."""

from __future__ import annotations

import json
import os
from pathlib import Path

from reel.bus.blobs import BlobBackend
from reel.producers.engine import Engine, EngineError
from reel.runtime.config.sections import Config


def make_engine(config: Config, model_dir: Path, blobs: BlobBackend, worker: int = 0) -> Engine:
    """The configured engine for the model in `model_dir` (HF layout); version -1 until weights arrive.

    vLLM runs as `vllm serve` servers reached over HTTP when REEL_VLLM_URL is set (the Slurm job's
    pools, or the one `reel run` starts), else in this process (engine.vllm_server = "inprocess").
    The servers are shared, so only worker 0 pushes weights to them.
    """
    e = config.engine
    if e.kind == "vllm" and os.environ.get("REEL_VLLM_URL"):
        from reel.producers.vllm_http import VLLMHTTPEngine

        url = os.environ["REEL_VLLM_URL"]
        servers = [s for s in os.environ.get("REEL_VLLM_SERVERS", "").split(",") if s]
        return VLLMHTTPEngine(model_dir, url=url, servers=servers, max_batch=e.max_batch, blobs=blobs, version=-1,
                              routed_experts=config.trainer.router_replay, push_weights=worker == 0)
    if e.kind == "vllm" and e.vllm_server == "local":
        raise EngineError("engine.vllm_server = \"local\" serves through the `vllm serve` that `reel run` starts; "
                          "a rollout role started by hand needs REEL_VLLM_URL (the server's http://host:port)")
    if e.kind == "vllm":
        from reel.producers.vllm import VLLMEngine

        return VLLMEngine(model_dir, max_batch=e.max_batch, max_seq_len=e.max_seq_len, precision=e.precision,
                          tensor_parallel_size=e.tensor_parallel_size, data_parallel_size=e.data_parallel_size,
                          expert_parallel=e.expert_parallel, blobs=blobs, version=-1,
                          routed_experts=config.trainer.router_replay)
    from reel.producers.builtin_engine import BuiltinEngine
    from reel.runtime.model.config import MoEConfig
    from reel.runtime.model.model import MoEModel

    model = MoEModel(MoEConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text())), e.precision)
    return BuiltinEngine(model, max_batch=e.max_batch, max_seq_len=e.max_seq_len, blobs=blobs, version=-1,
                         threads=e.threads)
