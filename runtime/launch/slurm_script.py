"""`reel launch slurm`'s job script: one heterogeneous Slurm job whose components run the roles, vLLM pools, Redis and the blob store, rendered from a run's config."""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

from reel.bus.server import service_redis_server
from reel.runtime.config.sections import Config
from reel.runtime.config.engine import PD_CONNECTORS
from reel.runtime.launch import vllm_args
from reel.runtime.launch.role_process import beside_python
from reel.runtime.launch.slurm_job import JobOptions, check
from reel.runtime.launch.vllm_args import Expand, Pool
from reel.runtime.package_files import ops_file


TEMPLATE = ops_file("slurm", "reel.sbatch")

REDIS_CONF = ops_file("redis", "redis.conf")

# A pool task's liveness watcher (runtime/launch/pool_watch.py), as a shell command prefix.
WATCH = '"$PYTHON" -m reel.runtime.launch.pool_watch --run "$RUN_DIR"'

class Component(NamedTuple):
    name: str
    nodes: int
    options: list[str]  # sbatch options of this het group
    runs: str  # what runs there, for the script's header


def render(c: Config, run_dir: Path, opts: JobOptions) -> str:
    """The job script for config `c` with run directory `run_dir` (absolute, shared by every node)."""
    check(c, run_dir, opts)
    vllm = c.engine.kind == "vllm"
    pools = vllm_args.pools(c, opts.rollout_nodes) if vllm else []
    components = _components(c, opts, pools)
    trainer = len(components) - 1
    lines = ["# the job's liveness watcher: names a stalled role here; a hung trainer or archiver stops the run",
             "watch_liveness", "", *_control_lines(c), *_blob_store_lines(c), *_trainer_lines(c, opts, trainer)]
    # Each worker under its task's watcher (runtime/launch/pool_watch.py): stalled, it is restarted in place.
    worker = ["env", "OMP_NUM_THREADS=1", "REEL_TORCH_THREADS=1", "bash", "-c",
              f'exec {WATCH} --role "rollout-$SLURM_PROCID" -- "$REEL" role rollout --run "$RUN_DIR" '
              f'--worker "$SLURM_PROCID"']
    if vllm:
        lines += [*_vllm_lines(c, pools), "# het group 0: the rollout workers, once vLLM answers",
                  start_line("rollout", 0, "rollout-%t.log", ["--nodes=1", f"--ntasks={c.rollout.workers}"], worker)]
    else:
        lines += ["# het group 1: rollout workers (built-in engine); worker index = task rank",
                  start_line("rollout", 1, "rollout-%t.log",
                             [f"--nodes={opts.rollout_nodes}", f"--ntasks={c.rollout.workers}"], worker)]
    lines += _eval_lines(c, vllm, len(components) - 2)
    lines += _mismatch_lines(c)
    ends_itself = " ".join(name for name, every in (("eval", c.eval.every), ("mismatch", c.mismatch.every)) if every)
    settings = {"RUN_DIR": str(run_dir), "RUN_NAME": c.run.name, **_binaries(c),
                "FINISHER": "trainer", "DRAINER": "archiver", "ENDS_ITSELF": ends_itself}
    if c.bus.cluster:  # every role's bus client follows the cluster's MOVED replies
        settings |= {"REEL_BUS_CLUSTER": "1"}
    return job_script(header=_header(c, run_dir, components, vllm), components=components, opts=opts,
                      job_name=f"reel-{c.run.name}", output=f"{run_dir}/slurm/job-%j.out", chdir=str(run_dir),
                      settings=settings, body="\n".join(lines))


def _components(c: Config, opts: JobOptions, pools: list[Pool]) -> list[Component]:
    """The het groups: control, the rollout side (built-in workers or vLLM pools), the trainer."""
    vllm = bool(pools)
    control = ["redis-server (ops/redis/redis.conf: AOF, fsync every second; a password made for this job; "
               "bound to this node's address)", "the archiver", "the metrics exporter"]
    if c.bus.cluster:
        control[0] = f"no Redis: the bus is the Redis Cluster at bus.url ({c.bus.partitions} partition(s))"
    if c.blobs.backend == "mooncake" and not c.blobs.mooncake_master:
        control.append("the Mooncake blob store (master + holder)")
    if c.engine.kv_connector == "MooncakeStoreConnector":
        control.append("the Mooncake store master")
    if c.engine.pd_disaggregation:
        control.append("vllm-router (P/D)")
    if vllm:
        control.append(f"{c.rollout.workers} rollout worker(s), clients of vLLM (`reel role rollout --worker K`)")
    components = [Component("control", 1, ["--nodes=1", f"--ntasks={c.rollout.workers if vllm else 1}"],
                            ", ".join(control))]
    gpus = [f"--gpus-per-node={opts.gpus_per_node}", "--exclusive"] if opts.gpus_per_node else []
    components += [Component(pool.role, pool.nodes, [f"--nodes={pool.nodes}", "--ntasks-per-node=1", *gpus],
                             _pool_summary(c, pool)) for pool in pools]
    if not vllm:
        components.append(Component("rollout", opts.rollout_nodes,
                                    [f"--nodes={opts.rollout_nodes}", f"--ntasks={c.rollout.workers}", *gpus],
                                    f"{c.rollout.workers} rollout worker(s) on the built-in engine "
                                    f"(`reel role rollout --worker K`, K = task rank)"))
    if vllm and c.eval.every:
        components.append(Component("eval", 1, ["--nodes=1", "--ntasks=1", *gpus],
                                    "the eval role (`reel role eval`) on its own in-process vLLM"))
    components.append(Component("trainer", opts.trainer_nodes,
                                [f"--nodes={opts.trainer_nodes}", "--ntasks-per-node=1",
                                 f"--cpus-per-task={c.trainer.threads or 1}", *gpus],
                                f"`reel role trainer` as one trainer over "
                                f"{opts.trainer_nodes * trainer_procs_per_node(c, opts)} rank(s) "
                                f"(torchrun, {trainer_procs_per_node(c, opts)} per node)"))
    return components


def _eval_lines(c: Config, vllm: bool, group: int) -> list[str]:
    """[eval] every > 0: the eval role as a step of its own, with an engine of its own (never the
    rollout's `vllm serve`, which holds the rollout's version): built-in, on the first rollout node;
    vLLM, in-process on the eval het group's node (engine.vllm_server = "inprocess" is required)."""
    if not c.eval.every:
        return []
    role = [Expand("$REEL"), "role", "eval", "--run", Expand("$RUN_DIR")]
    if not vllm:
        return ["# het group 1: the eval role (its own built-in engine) on the first rollout node",
                start_line("eval", 1, "eval.log", ["--nodes=1", "--ntasks=1"],
                           ["env", f"OMP_NUM_THREADS={c.engine.threads}", f"REEL_TORCH_THREADS={c.engine.threads}",
                            *role]), ""]
    return [f"# het group {group}: the eval role, its own vLLM in-process (not the rollout's servers)",
            start_line("eval", group, "eval.log", ["--nodes=1", "--ntasks=1"],
                       ["env", "-u", "REEL_VLLM_URL", "-u", "REEL_VLLM_SERVERS", *role]), ""]


def _mismatch_lines(c: Config) -> list[str]:
    """[mismatch] every > 0: the mismatch role (consumers/mismatch.py) on the control node, with the
    trainer's thread count (its figures are bitwise those `reel replay` recomputes)."""
    if not c.mismatch.every:
        return []
    threads = c.trainer.threads or 1
    return ["# het group 0: the mismatch role (the numerics/drift split, off the trainer's step)",
            start_line("mismatch", 0, "mismatch.log", ["--nodes=1", "--ntasks=1"],
                       ["env", f"OMP_NUM_THREADS={threads}", f"REEL_TORCH_THREADS={threads}",
                        Expand("$REEL"), "role", "mismatch", "--run", Expand("$RUN_DIR")]), ""]


def _control_lines(c: Config) -> list[str]:
    # With bus.cluster the bus is the Redis Cluster of bus.url; the launcher's URL adds the
    # password (REEL_BUS_PASSWORD or bus.password_file) and the TLS files (runtime/launch/bus_access.py),
    # through a variable and the 0600 bus_url file, never argv.
    bus = ["BUS_HOST=$(group_addr 0 0)",
           'REEL_BUS_URL=$("$PYTHON" -m reel.runtime.launch.bus_access "$RUN_DIR/config.toml") || exit 2',
           '(umask 077; printf \'%s\\n\' "$REEL_BUS_URL" > "$RUN_DIR/bus_url")'] \
        if c.bus.cluster else ["start_bus 0"]
    # Each role's own Redis user (runtime/launch/role_users.py): its URL in RUN_DIR/bus_url.ROLE (0600),
    # which `reel role ROLE` reads; REEL_BUS_URL is the launcher's and is not exported to the roles.
    users = 'REEL_BUS_URL=$REEL_BUS_URL "$PYTHON" -m reel.runtime.launch.role_users "$RUN_DIR" || exit 2'
    return ["# het group 0: control", *bus, 'wait_until "the bus" bus_ok', users,
            start_line("archiver", 0, "archiver.log", ["--nodes=1", "--ntasks=1"],
                       [Expand("$REEL"), "role", "archiver", "--run", Expand("$RUN_DIR")]),
            "METRICS_PORT=$((PORT_BASE + 1))",
            start_line("metrics", 0, "metrics.log", ["--nodes=1", "--ntasks=1"],
                       [Expand("$REEL"), "metrics", "serve", "--run", Expand("$RUN_DIR"),
                        "--port", Expand("$METRICS_PORT"), "--addr", Expand("$BUS_HOST")]),  # where it is announced
            'echo "reel: metrics at http://$BUS_HOST:$METRICS_PORT/metrics"', ""]


def _blob_store_lines(c: Config) -> list[str]:
    """blobs.backend = "mooncake" without a running store: a master and a holder on the control node."""
    b = c.blobs
    if b.backend != "mooncake" or b.mooncake_master:
        return []
    device = [f"--device_names={b.mooncake_device}"] if b.mooncake_device else []
    return ["# the run's Mooncake blob store: its master, and the holder that owns the memory blobs live in",
            "BLOB_HOST=$(group_addr 0 0) BLOB_MASTER_PORT=$((PORT_BASE + 5)) BLOB_META_PORT=$((PORT_BASE + 6))",
            'export REEL_MOONCAKE_MASTER="$BLOB_HOST:$BLOB_MASTER_PORT"',
            'export REEL_MOONCAKE_METADATA="http://$BLOB_HOST:$BLOB_META_PORT/metadata"',
            start_line("blob-master", 0, "blob-master.log", ["--nodes=1", "--ntasks=1"],
                       [Expand("$MOONCAKE_MASTER"), Expand("--rpc_address=$BLOB_HOST"),
                        Expand("--rpc_port=$BLOB_MASTER_PORT"), "--enable_http_metadata_server=true",
                        Expand("--http_metadata_server_host=$BLOB_HOST"),
                        Expand("--http_metadata_server_port=$BLOB_META_PORT"), Expand("--metrics_host=$BLOB_HOST"),
                        Expand("--metrics_port=$((PORT_BASE + 7))")]),
            start_line("blob-holder", 0, "blob-holder.log", ["--nodes=1", "--ntasks=1"],
                       [Expand("$MOONCAKE_CLIENT"), f"--global_segment_size={b.mooncake_segment_bytes}",
                        "--local_buffer_size=0", Expand("--master_server_address=$REEL_MOONCAKE_MASTER"),
                        Expand("--metadata_server=$REEL_MOONCAKE_METADATA"), Expand("--host=$BLOB_HOST"),
                        Expand("--port=$((PORT_BASE + 8))"), Expand("--http_port=$((PORT_BASE + 9))"),
                        f"--protocol={b.mooncake_protocol}", *device]),
            ""]


def _trainer_lines(c: Config, opts: JobOptions, group: int) -> list[str]:
    threads = c.trainer.threads or 1
    return [f"# het group {group}: trainer (torchrun rendezvous on its first node)",
            f"TRAINER_HEAD=$(group_addr {group} 0)", "TRAINER_PORT=$((PORT_BASE + 2))",
            start_line("trainer", group, "trainer-%n.log", [f"--nodes={opts.trainer_nodes}", "--ntasks-per-node=1"],
                       ["env", f"OMP_NUM_THREADS={threads}", f"REEL_TORCH_THREADS={threads}", Expand("$TORCHRUN"),
                        f"--nnodes={opts.trainer_nodes}", f"--nproc-per-node={trainer_procs_per_node(c, opts)}",
                        "--rdzv-backend=c10d", Expand("--rdzv-endpoint=$TRAINER_HEAD:$TRAINER_PORT"),
                        Expand("--rdzv-id=$SLURM_JOB_ID"),
                        # "--": torchrun would otherwise take the role's --run for an abbreviated option
                        "--no-python", "--", Expand("$REEL"), "role", "trainer", "--run", Expand("$RUN_DIR")]),
            ""]


def trainer_procs_per_node(c: Config, opts: JobOptions) -> int:
    """One rank per GPU; on CPU nodes trainer.ranks spread evenly over the trainer nodes."""
    return opts.gpus_per_node or max(1, c.trainer.ranks // opts.trainer_nodes)


def _binaries(c: Config) -> dict[str, str]:
    found = {"REEL": beside_python("reel"), "PYTHON": sys.executable, "TORCHRUN": beside_python("torchrun"),
             "REDIS_SERVER": service_redis_server(), "REDIS_CONF": str(REDIS_CONF)}
    if c.engine.pd_disaggregation:
        found["VLLM_ROUTER"] = beside_python("vllm-router")
    if c.engine.kv_connector == "MooncakeStoreConnector" or c.blobs.backend == "mooncake":
        found["MOONCAKE_MASTER"] = beside_python("mooncake_master")
    if c.blobs.backend == "mooncake":
        found["MOONCAKE_CLIENT"] = beside_python("mooncake_client")
    return found


def job_script(*, header: str, components: list[Component], opts: JobOptions, job_name: str, output: str,
               chdir: str, settings: dict[str, str], body: str) -> str:
    """Fill ops/slurm/reel.sbatch: `settings` become exported shell variables, `body` starts the steps."""
    sbatch = [f"#SBATCH --job-name={job_name} --output={output} --chdir={chdir}"]
    for i, comp in enumerate(components):
        if i:
            sbatch.append("#SBATCH hetjob")
        extra = [f"--time={opts.time}"] + [f"--partition={opts.partition}"] * bool(opts.partition) \
            + [f"--account={opts.account}"] * bool(opts.account)
        sbatch.append(f"#SBATCH {' '.join(comp.options + extra)}  # {i}: {comp.name}")
    values = {"HEADER": header, "SBATCH": "\n".join(sbatch), "COMPONENTS": body,
              "SETTINGS": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in settings.items())}
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], TEMPLATE.read_text())


def _vllm_lines(c: Config, pools: list[Pool]) -> list[str]:
    # The run's API key (RUN_DIR/vllm_api_key, 0600): servers and rollout workers get it by environment.
    lines = ['VLLM_API_KEY=$("$PYTHON" -m reel.runtime.launch.vllm_key "$RUN_DIR") || exit 2', "export VLLM_API_KEY"]
    store = c.engine.kv_connector == "MooncakeStoreConnector"
    if store:
        lines += ["# het group 0: the Mooncake store master (each vLLM node adds its segment to the store)",
                  "MOONCAKE_PORT=$((PORT_BASE + 4))",
                  start_line("mooncake-master", 0, "mooncake-master.log", ["--nodes=1", "--ntasks=1"],
                         [Expand("$MOONCAKE_MASTER"), Expand("--rpc_address=$BUS_HOST"),
                          Expand("--rpc_port=$MOONCAKE_PORT")]), ""]
    for group, pool in enumerate(pools, start=1):
        lines += [_comment(f"het group {group}: {_pool_summary(c, pool)}"), f"{pool.head_var}=$(group_addr {group} 0)"]
        for node in range(pool.nodes):
            addr = Expand(f"$(group_addr {group} {node})")
            if store:
                text = json.dumps(vllm_args.mooncake_store_config(c, "@ADDR@", "@MASTER@"))
                text = text.replace("@ADDR@", addr).replace("@MASTER@", "$BUS_HOST:$MOONCAKE_PORT")
                lines += [f'cat > "{vllm_args.mooncake_config_path(pool, node)}" <<EOF', text, "EOF"]
            env = [f"{k}={v}" if not isinstance(v, Expand) else Expand(f"{k}={v}")
                   for k, v in vllm_args.serve_env(c, pool, node, addr).items()]
            name = f"vllm-{pool.role}-{node}"
            # A one-node pool's server under a watcher that probes it (runtime/launch/pool_watch.py): wedged,
            # it is restarted in place. A server of a data-parallel group over nodes cannot rejoin it alone.
            watch = [Expand("$PYTHON"), "-m", "reel.runtime.launch.pool_watch", "--run", Expand("$RUN_DIR"),
                     "--role", name, "--probe", Expand(f"http://{addr}:{vllm_args.API_PORT}"), "--"] \
                if pool.nodes == 1 else []
            lines.append(start_line(name, group, f"{name}.log", ["--nodes=1", "--ntasks=1", f"--relative={node}"],
                                    ["env", *env, *watch, *vllm_args.serve_argv(c, pool, node, addr)]))
        lines.append("")
    heads = [f"http://${p.head_var}:{vllm_args.API_PORT}" for p in pools]
    if c.engine.pd_disaggregation:
        # vllm-router sends its own `Authorization: Bearer $OPENAI_API_KEY` to the servers (not the
        # client's), so it gets the run's key in that variable, by environment. It checks no key from its
        # clients: it listens on loopback, for the rollout workers beside it on this node only.
        lines += ["# het group 0: the P/D router in front of the prefill and decode pools",
                  "ROUTER_PORT=$((PORT_BASE + 3))",
                  start_line("vllm-router", 0, "vllm-router.log", ["--nodes=1", "--ntasks=1"],
                         ["bash", "-c", 'OPENAI_API_KEY=$VLLM_API_KEY exec "$@"', "vllm-router",
                          Expand("$VLLM_ROUTER"), "--vllm-pd-disaggregation", "--prefill", Expand(heads[0]),
                          "--decode", Expand(heads[1]), "--host", "127.0.0.1", "--port",
                          Expand("$ROUTER_PORT"), "--policy", "consistent_hash"]),
                  'export REEL_VLLM_URL="http://127.0.0.1:$ROUTER_PORT"']
    else:
        lines.append(f'export REEL_VLLM_URL="{heads[0]}"')
    lines.append(f'export REEL_VLLM_SERVERS="{",".join(heads)}"  # every API server: weight updates go to each')
    lines += [f'wait_until "vLLM at {url}" http_ok "{url}/health"' for url in heads]
    if c.engine.pd_disaggregation:
        lines.append('wait_until "the P/D router" http_ok "$REEL_VLLM_URL/health"')
    return lines


def _pool_summary(c: Config, pool: Pool) -> str:
    e = c.engine
    what = {"rollout": "vLLM (prefill and decode)", "prefill": "vLLM prefill", "decode": "vLLM decode"}[pool.role]
    parts = [f"{what}, data parallel {e.data_parallel_size} x tensor parallel {e.tensor_parallel_size}"]
    if e.expert_parallel:
        backend = vllm_args.ALL2ALL.get(pool.role)
        parts.append("expert parallel" + (f" ({backend})" if backend else ""))
    if e.kv_connector:
        parts.append(e.kv_connector + (" + CPU offload" if e.kv_connector in PD_CONNECTORS
                                       and e.kv_offload_cpu_gib else ""))
    return ", ".join(parts)


def _header(c: Config, run_dir: Path, components: list[Component], vllm: bool) -> str:
    text = [f'Reel run "{c.run.name}" as one Slurm heterogeneous job, rendered by `reel launch slurm` from '
            f"ops/slurm/reel.sbatch. Run directory (shared by every node): {run_dir}; the run's config is "
            f"its config.toml.", ""]
    text += [f"Het group {i}, {comp.name} ({comp.nodes} node{'s' * (comp.nodes > 1)}): {comp.runs}."
             for i, comp in enumerate(components)]
    text += ["", "Every role finds Redis through its own Redis user's URL, RUN_DIR/bus_url.ROLE (mode 0600, "
                 "made once the bus answers; with Redis < 7 every role reads the job's REEL_BUS_URL "
                 "(redis://:PASSWORD@HOST:PORT/0) from RUN_DIR/bus_url, mode 0600), while the job runs."]
    if vllm:
        text.append("Rollout workers send generate requests to REEL_VLLM_URL and weight updates to every "
                    "server in REEL_VLLM_SERVERS.")
    text += ["Setup: none here. The trainer role publishes RunStarted and the version-0 weights itself when "
             "the run has no WeightsPublished yet, so this script only starts roles.",
             "End: when the trainer exits 0 (and the eval role, if any, has scored the last version), "
             "RunFinished is announced, the archiver drains and exits, and the rest stop (Redis last): exit 0. "
             "When a component ends before that (or the job is signalled), the log records how the run "
             "ended (RunFinished \"failed: NAME exited CODE\" or \"stopped: SIGNAL\"), its name and exit code go to "
             "stderr, the others stop, and the job exits with that code.",
             "Paths below were resolved where the job was submitted: every node must see them."]
    out: list[str] = []
    for para in text:
        indent = "#   " if para.startswith("Het group") else "# "
        out += ["#"] if not para else textwrap.wrap(para, 98, initial_indent="# ", subsequent_indent=indent,
                                                    break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def start_line(name: str, group: int, log: str, srun: list[str], command: list[str]) -> str:
    words = ["start", name, str(group), Expand(f"$ROLES/{log}"), *srun, "--", *command]
    return _wrap([f'"{w}"' if isinstance(w, Expand) else shlex.quote(w) for w in words])


def _wrap(words: list[str], width: int = 100) -> str:
    """Join shell words into continued lines of at most ~width, keeping `--flag value` together."""
    units: list[str] = []
    for word in words:
        if units and units[-1].startswith("--") and " " not in units[-1] and "=" not in units[-1] \
                and not word.startswith("-"):
            units[-1] += " " + word
        else:
            units.append(word)
    lines, line = [], ""
    for unit in units:
        if line and len(line) + 1 + len(unit) > width:
            lines.append(line + " \\")
            line = "    " + unit
        else:
            line = f"{line} {unit}" if line else unit
    return "\n".join(lines + [line])


def _comment(text: str) -> str:
    return "\n".join(textwrap.wrap(text, 98, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False))
