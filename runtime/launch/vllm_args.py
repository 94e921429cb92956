"""`vllm serve` command lines for a production run, and the engine keys that decide them.

`reel launch slurm` runs vLLM as one or two pools of nodes:
    rollout            one pool serving prefill and decode (engine.pd_disaggregation = false)
    prefill + decode   two pools joined by a P/D connector (NixlConnector or MooncakeConnector)
Each pool is one vLLM deployment of engine.data_parallel_size x engine.tensor_parallel_size GPUs:
the API server on the pool's first node, the other nodes `--headless`. With expert parallelism
the all-to-all backend follows the pool's work: DeepEP high-throughput for prefill, DeepEP
low-latency (with decode-only CUDA graphs) for decode; a mixed pool keeps vLLM's default.

KV tiers (engine.kv_connector):
    NixlConnector | MooncakeConnector   move KV from the prefill pool to the decode pool (P/D)
    OffloadingConnector                 CPU tier (kv_offload_cpu_gib), plus a disk tier
                                        (kv_offload_disk_dir) behind it
    MooncakeStoreConnector              a Mooncake store pooled over the nodes (each adds
                                        kv_offload_cpu_gib); its master runs on the control node
With a P/D connector, kv_offload_cpu_gib > 0 adds the OffloadingConnector (a MultiConnector).
Offloaded blocks survive weight updates: Reel salts the prefix cache per policy version.

Router replay needs vLLM's routed-expert capture (--enable-return-routed-experts), which
rejects P/D connectors, so that combination is refused at config load (runtime/config/run.py).

Weight updates reach the servers over HTTP (producers/vllm_http.py): /pause, /collective_rpc into
Reel's worker extension (--worker-extension-cls), /update_weight_version, /resume; those endpoints
exist only with VLLM_SERVER_DEV_MODE=1 in the server's environment, and the token-ids generate
route only with --enable-scale-out (403 without it). Every route but /health requires the run's
API key (VLLM_API_KEY, runtime/launch/vllm_key.py; --middleware producers/vllm_auth.py), and the
worker extension loads weights only from the run's blob store (REEL_BLOBS_DIR), by hash.

`reel run` with engine.vllm_server = "local" starts one `vllm serve` on this machine with the same
flags (local_serve_argv), serving the run's version-0 weights (RUN_DIR/init).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import NamedTuple

from reel.runtime.config.sections import Config
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.engine import PD_CONNECTORS

# vLLM pools run on nodes of their own, so their ports are fixed.
API_PORT = 8000
DP_RPC_PORT = 13345
NIXL_SIDE_CHANNEL_PORT = 5600
MOONCAKE_BOOTSTRAP_PORT = 8998
MOONCAKE_LOCAL_BUFFER_BYTES = 4 << 30  # a store client's staging buffer
# Loads Reel's weight blobs inside vLLM's workers; named, not imported (runtime/ never imports producers/).
WORKER_EXTENSION = "reel.producers.vllm_worker.ReelWorkerExtension"
# Requires the run's API key on every route, the dev-mode ones included (producers/vllm_auth.py).
AUTH_MIDDLEWARE = "reel.producers.vllm_auth.RequireKey"
BLOBS_ENV = "REEL_BLOBS_DIR"  # the run's blob store: the only place the worker extension loads weights from

DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}
# vLLM's online quantisation with DeepSeek-style 128x128 block scales, the trainer's FP8 numerics
# (vLLM refuses `--quantization fp8` on an unquantised checkpoint).
ONLINE_FP8 = "fp8_per_block"
ALL2ALL = {"prefill": "deepep_high_throughput", "decode": "deepep_low_latency"}


class Expand(str):
    """A word the job's shell expands ("$DECODE_HEAD", "$(group_addr 2 0)"): rendered in double quotes."""


class Pool(NamedTuple):
    role: str  # "rollout" (prefill and decode together) | "prefill" | "decode"
    nodes: int
    nodes_key: str  # what sets `nodes`, for error messages

    @property
    def head_var(self) -> str:
        """Shell variable holding the address of the pool's first node (its API server)."""
        return f"{self.role.upper()}_HEAD"


def quantization(precision: str, model_dir: str | Path) -> str | None:
    """vLLM's `quantization` for a checkpoint served at `precision` (None: the checkpoint's own).

    An FP8 checkpoint (config.json has a quantization_config) carries its block scales and needs no
    flag; an unquantised one served at fp8 is quantised online in blocks. A directory this machine
    cannot read (a Slurm login node) counts as unquantised.
    """
    if precision != "fp8":
        return None
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        hf = {}
    return None if hf.get("quantization_config") else ONLINE_FP8


def precision_args(precision: str, model_dir: str | Path) -> list[str]:
    quant = quantization(precision, model_dir)
    return ["--dtype", DTYPE[precision], *(["--quantization", quant] if quant else [])]


def pools(c: Config, rollout_nodes: int) -> list[Pool]:
    if c.engine.pd_disaggregation:
        return [Pool("prefill", c.engine.prefill_nodes, "engine.prefill_nodes"),
                Pool("decode", c.engine.decode_nodes, "engine.decode_nodes")]
    return [Pool("rollout", rollout_nodes, "--rollout-nodes")]


def check_layout(c: Config, pool: Pool, gpus_per_node: int) -> None:
    """Refuse a pool whose deployment does not fit its nodes."""
    e = c.engine
    _require(gpus_per_node >= 1, "engine.kind = \"vllm\" needs GPUs: pass --gpus-per-node")
    _require(e.data_parallel_size % pool.nodes == 0,
             f"engine.data_parallel_size = {e.data_parallel_size} must be a multiple of the {pool.role} pool's "
             f"{pool.nodes} nodes ({pool.nodes_key}): each node runs the same number of DP ranks")
    per_node = e.data_parallel_size // pool.nodes * e.tensor_parallel_size
    _require(per_node <= gpus_per_node,
             f"the {pool.role} pool puts {per_node} GPUs on each node (engine.data_parallel_size / "
             f"{pool.nodes_key} x engine.tensor_parallel_size) but --gpus-per-node is {gpus_per_node}")


def kv_transfer_config(c: Config, pool: Pool) -> dict | None:
    """The --kv-transfer-config of a pool's servers (None: no connector)."""
    e = c.engine
    parts: list[dict] = []
    if e.kv_connector == "NixlConnector":
        parts.append({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"})
    elif e.kv_connector == "MooncakeConnector":
        role = "kv_producer" if pool.role == "prefill" else "kv_consumer"
        parts.append({"kv_connector": "MooncakeConnector", "kv_role": role})
    elif e.kv_connector == "MooncakeStoreConnector":
        parts.append({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})
    if e.kv_connector in (*PD_CONNECTORS, "OffloadingConnector") and e.kv_offload_cpu_gib > 0:
        extra: dict = {"cpu_bytes_to_use": int(e.kv_offload_cpu_gib * (1 << 30))}
        if e.kv_offload_disk_dir:
            extra |= {"spec_name": "TieringOffloadingSpec",
                      "secondary_tiers": [{"type": "fs", "root_dir": e.kv_offload_disk_dir}]}
        parts.append({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": extra})
    if len(parts) <= 1:
        return parts[0] if parts else None
    # The first connector that has a block wins: the P/D transfer, then the local tiers.
    return {"kv_connector": "MultiConnector", "kv_role": parts[0]["kv_role"],
            "kv_connector_extra_config": {"connectors": parts}}


def common_serve_args(c: Config, model_dir: str | Path) -> list[str]:
    """What every `vllm serve` of a run gets, on Slurm pools and the local server alike."""
    e = c.engine
    argv = ["--seed", str(c.run.seed), "--max-num-seqs", str(e.max_batch),
            # Token ids in and out (/inference/v1/generate exists only with --enable-scale-out).
            "--enable-scale-out", "--skip-tokenizer-init",
            # Reel salts the prefix cache per policy version and compares processed logprobs.
            "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", WORKER_EXTENSION, "--middleware", AUTH_MIDDLEWARE,
            *precision_args(e.precision, model_dir)]
    if e.max_seq_len:
        argv += ["--max-model-len", str(e.max_seq_len)]
    if c.trainer.router_replay:
        argv.append("--enable-return-routed-experts")
    return argv


def local_serve_argv(c: Config, vllm: str, model_dir: Path, port: int) -> list[str]:
    """The `vllm serve` that `reel run` starts for a run (engine.vllm_server = "local")."""
    argv = [vllm, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            *common_serve_args(c, model_dir)]
    if not _has_cuda():
        argv.append("--enforce-eager")  # no graphs to capture on a CPU; saves the compile at start
        # vLLM's CPU sampler cannot go on with a seeded request whose prefill was split over two
        # steps (the engine dies: "CPU Generator does not use offset"), and Reel seeds every
        # sample: a step's token budget holds max_batch whole sequences, so no prefill is split.
        argv += ["--max-num-batched-tokens", str(c.engine.max_batch * _max_model_len(c, model_dir))]
    return argv + shlex.split(c.engine.serve_args)


def _max_model_len(c: Config, model_dir: Path) -> int:
    """The longest sequence the server takes: engine.max_seq_len, else the served checkpoint's limit."""
    if c.engine.max_seq_len:
        return c.engine.max_seq_len
    return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])


def local_serve_env(c: Config, api_key: str, blobs_dir: Path) -> dict[str, str]:
    # vLLM's workers import Reel's worker extension (reel.producers.vllm) from the installed `reel`
    # package, the same interpreter as the server's.
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENGINE_READY_TIMEOUT_S": "3600",
           "OMP_NUM_THREADS": str(c.engine.threads), "VLLM_API_KEY": api_key, BLOBS_ENV: str(blobs_dir)}
    if c.trainer.router_replay:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return env | cpu_env()


def cpu_env() -> dict[str, str]:
    """The CPU build's settings: a small KV cache (GiB), no pinning of threads to cores the roles share."""
    return {} if _has_cuda() else {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def check_local_server(c: Config) -> None:
    """Refuse what the local `vllm serve` cannot do on this machine, before anything starts."""
    if _has_cuda():
        return
    _require(c.engine.precision == "fp32",
             f"engine.precision = \"{c.engine.precision}\": the CPU build of vLLM serves float32 only "
             f"(bf16 crashes its attention kernel); set engine.precision = \"fp32\" or run on a GPU")
    reason = router_replay_unsupported()
    _require(not (c.trainer.router_replay and reason), str(reason))


def router_replay_unsupported() -> str | None:
    """Why vLLM on this machine cannot return routed experts (None when it can).

    The capture lives in vLLM's Model Runner V2, which needs Triton kernels on a GPU; the CPU build
    falls back to the V1 runner and fails such requests ("AuxOutput Connector requires Model Runner
    V2"), so router replay is refused before anything starts.
    """
    if _has_cuda():
        return None
    return ("trainer.router_replay = true needs vLLM's routed-expert capture (Model Runner V2, GPU only) and "
            "this machine has no GPU: set trainer.router_replay = false or engine.kind = \"builtin\"")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def serve_argv(c: Config, pool: Pool, node: int, addr: str) -> list[str]:
    """`vllm serve` for node `node` (from 0) of `pool`, bound to `addr` (the node's own address, not
    every interface); Expand words refer to the job's shell."""
    e = c.engine
    # Under the job's Python, as `reel run` starts its server: a `vllm` script elsewhere on PATH may import
    # another Reel, without this run's worker extension and middleware.
    argv = [Expand("$PYTHON"), "-m", "vllm.entrypoints.cli.main", "serve", c.model.path, "--host", addr,
            "--port", str(API_PORT),
            *common_serve_args(c, c.model.path)]
    if e.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(e.tensor_parallel_size)]
    if e.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(e.data_parallel_size)]
        if pool.nodes > 1:
            local = e.data_parallel_size // pool.nodes
            argv += ["--data-parallel-size-local", str(local), "--data-parallel-start-rank", str(node * local),
                     "--data-parallel-address", Expand(f"${pool.head_var}"),
                     "--data-parallel-rpc-port", str(DP_RPC_PORT)]
            if node > 0:
                argv.append("--headless")
    if e.expert_parallel:
        argv.append("--enable-expert-parallel")
        if e.eplb:
            argv.append("--enable-eplb")
        backend = ALL2ALL.get(pool.role)
        if backend:
            argv += ["--all2all-backend", backend]
        if backend == "deepep_low_latency":
            argv += ["--compilation-config", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"}, separators=(",", ":"))]
    kv = kv_transfer_config(c, pool)
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return argv + shlex.split(e.serve_args)


def serve_env(c: Config, pool: Pool, node: int, addr: str) -> dict[str, str]:
    """Environment of a pool's node; `addr` is the node's own address (usually an Expand)."""
    e = c.engine
    env = {"VLLM_SERVER_DEV_MODE": "1",  # the pause / update_weights / resume endpoints (behind the API key)
           "VLLM_ENGINE_READY_TIMEOUT_S": "3600",  # big MoE checkpoints load for tens of minutes
           BLOBS_ENV: Expand("$RUN_DIR/blobs")}  # VLLM_API_KEY: exported by the job (runtime/launch/slurm.py)
    if e.precision == "fp8":
        env |= {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "1"}
    if c.trainer.router_replay:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # routed-expert capture lives in Model Runner V2
    if e.kv_connector == "NixlConnector":
        env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": addr, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT)}
    elif e.kv_connector == "MooncakeConnector":
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(MOONCAKE_BOOTSTRAP_PORT)
    elif e.kv_connector == "MooncakeStoreConnector":
        # Every node must hash blocks alike to find each other's entries in the shared store.
        env |= {"MOONCAKE_CONFIG_PATH": Expand(mooncake_config_path(pool, node)), "PYTHONHASHSEED": "0"}
    return env


def mooncake_config_path(pool: Pool, node: int) -> str:
    return f"$RUN_DIR/slurm/mooncake-{pool.role}-{node}.json"


def mooncake_store_config(c: Config, addr: str, master: str) -> dict:
    """MOONCAKE_CONFIG_PATH contents for a node: it adds kv_offload_cpu_gib to the shared store."""
    return {"local_hostname": addr, "metadata_server": "P2PHANDSHAKE", "master_server_address": master,
            "global_segment_size": int(c.engine.kv_offload_cpu_gib * (1 << 30)),
            "local_buffer_size": MOONCAKE_LOCAL_BUFFER_BYTES, "protocol": c.engine.mooncake_protocol,
            "device_name": ""}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
