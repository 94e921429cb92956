"""The [engine] section of a run's config: its keys, and the checks that refuse what vLLM would
reject. Its own module so that runtime/config/run.py stays the schema of a whole run and the `vllm
serve` renderers (runtime/launch/) read the connector names from here, not from the launcher side.
"""

from __future__ import annotations

import shlex
from typing import Literal

import msgspec

from reel.runtime.config.keys import ConfigError, require

Precision = Literal["fp32", "bf16", "fp8"]


class EngineSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["builtin", "vllm"] = "builtin"
    precision: Precision = "fp32"
    max_batch: int = 64  # sequences decoded together (KV cache slots)
    max_seq_len: int = 0  # 0 = model.max_position_embeddings
    threads: int = 1  # torch threads of the built-in engine's step thread
    # vLLM-only keys (rendered into `vllm serve` by `reel launch slurm`)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    pd_disaggregation: bool = False
    prefill_nodes: int = 1
    decode_nodes: int = 1
    kv_connector: str = ""  # NixlConnector | MooncakeConnector | OffloadingConnector | MooncakeStoreConnector
    kv_offload_cpu_gib: float = 0.0
    kv_offload_disk_dir: str = ""
    # Added for `reel launch slurm` (checked with the keys above, by validate_engine):
    eplb: bool = False  # --enable-eplb: rebalance experts across expert-parallel ranks
    mooncake_protocol: Literal["rdma", "tcp"] = "rdma"  # MooncakeStoreConnector transport
    serve_args: str = ""  # more `vllm serve` arguments, as shell words ("--gpu-memory-utilization 0.9")
    # Where `reel run` puts vLLM: "local" = one `vllm serve` for the run, started and stopped with it, that
    # the rollout workers reach over HTTP (its log in roles/vllm.log); "inprocess" = vLLM's AsyncLLM inside
    # each rollout worker. Slurm jobs always run `vllm serve` pools.
    vllm_server: Literal["local", "inprocess"] = "local"


# KV connectors of `vllm serve` (engine.kv_connector); the first two join a prefill and a decode pool.
PD_CONNECTORS = ("NixlConnector", "MooncakeConnector")
CONNECTORS = (*PD_CONNECTORS, "OffloadingConnector", "MooncakeStoreConnector")
# Keys that only `vllm serve` reads: set with the built-in engine they would silently do nothing.
VLLM_ONLY_KEYS = ("tensor_parallel_size", "data_parallel_size", "expert_parallel", "eplb",
                  "pd_disaggregation", "prefill_nodes", "decode_nodes", "kv_connector",
                  "kv_offload_cpu_gib", "kv_offload_disk_dir", "mooncake_protocol", "serve_args", "vllm_server")


def validate_engine(e: EngineSection, *, router_replay: bool) -> None:
    """Refuse engine settings vLLM would reject or that contradict each other."""
    if e.kind == "builtin":
        default = EngineSection()
        for key in VLLM_ONLY_KEYS:
            require(getattr(e, key) == getattr(default, key),
                     f"engine.{key} is read only by vLLM; set engine.kind = \"vllm\" or remove engine.{key}")
        return
    for key in ("tensor_parallel_size", "data_parallel_size", "prefill_nodes", "decode_nodes"):
        require(getattr(e, key) >= 1, f"engine.{key} = {getattr(e, key)} must be at least 1")
    require(e.kv_connector in ("", *CONNECTORS),
             f"engine.kv_connector = {e.kv_connector!r} is unknown; use one of {', '.join(CONNECTORS)} (or \"\")")
    require(not (e.expert_parallel and e.tensor_parallel_size * e.data_parallel_size == 1),
             "engine.expert_parallel = true needs more than one GPU per deployment; raise "
             "engine.data_parallel_size (or engine.tensor_parallel_size), or set expert_parallel = false")
    require(not (e.eplb and not e.expert_parallel),
             "engine.eplb = true balances experts across expert-parallel ranks; set engine.expert_parallel = true")
    if e.pd_disaggregation:
        require(e.kv_connector in PD_CONNECTORS,
                 f"engine.pd_disaggregation = true needs a connector that moves KV from prefill to decode: set "
                 f"engine.kv_connector = \"NixlConnector\" or \"MooncakeConnector\" (it is {e.kv_connector!r})")
        require(not router_replay,
                 f"trainer.router_replay = true cannot run with engine.pd_disaggregation = true and "
                 f"engine.kv_connector = \"{e.kv_connector}\": vLLM's routed-expert capture rejects P/D "
                 f"connectors; set trainer.router_replay = false or engine.pd_disaggregation = false")
    else:
        require(e.kv_connector not in PD_CONNECTORS,
                 f"engine.kv_connector = \"{e.kv_connector}\" joins prefill and decode pools; set "
                 f"engine.pd_disaggregation = true, or use OffloadingConnector or MooncakeStoreConnector")
    require(e.kv_offload_cpu_gib >= 0, f"engine.kv_offload_cpu_gib = {e.kv_offload_cpu_gib} must be >= 0")
    if e.kv_connector in ("OffloadingConnector", "MooncakeStoreConnector"):
        require(e.kv_offload_cpu_gib > 0,
                 f"engine.kv_connector = \"{e.kv_connector}\" needs engine.kv_offload_cpu_gib > 0 "
                 f"(the CPU memory each node gives the KV tier)")
    require(bool(e.kv_connector) or e.kv_offload_cpu_gib == 0,
             "engine.kv_offload_cpu_gib is set but no KV connector uses it; set "
             "engine.kv_connector = \"OffloadingConnector\" (or MooncakeStoreConnector)")
    require(not e.kv_offload_disk_dir or e.kv_connector in (*PD_CONNECTORS, "OffloadingConnector"),
             "engine.kv_offload_disk_dir is the OffloadingConnector's disk tier; set engine.kv_connector = "
             "\"OffloadingConnector\" (or a P/D connector) with engine.kv_offload_cpu_gib > 0")
    require(not e.kv_offload_disk_dir or e.kv_offload_cpu_gib > 0,
             "engine.kv_offload_disk_dir is a tier behind the CPU tier; set engine.kv_offload_cpu_gib > 0")
    try:
        shlex.split(e.serve_args)
    except ValueError as exc:
        raise ConfigError(f"engine.serve_args = {e.serve_args!r} is not valid shell words: {exc}") from exc
