"""`reel launch slurm`: the rendered job script is valid bash and says what it runs; vLLM command
lines carry the flags and JSON a production run needs; impossible combinations are refused with the
key to change (exit 2); the job's Redis config (ops/redis/redis.conf) starts a durable, password-only
Redis. No Slurm needed here (tests/runs/test_slurm_cluster.py submits to a real one)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from reel.bus.errors import ReelError
from reel.bus.server import service_redis_server
from reel.runtime.config import run as config
from reel.runtime.config import engine as config_engine
from reel.runtime.config.keys import ConfigError
from reel.runtime.launch import role_users, vllm_args
from reel.runtime.launch import slurm_job, slurm_script
from reel.runtime.launch import run_dir as run_dir_mod
from reel.runtime.launch.cli import main
from paths import REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "reverse_text.toml"

WIDE_EP_PD = """
[run]
name = "moe-pd"
[model]
path = "/models/moe-fp8"
[engine]
kind = "vllm"
precision = "fp8"
data_parallel_size = 16
expert_parallel = true
pd_disaggregation = true
prefill_nodes = 2
decode_nodes = 2
kv_connector = "NixlConnector"
kv_offload_cpu_gib = 64
kv_offload_disk_dir = "/local/kv"
serve_args = "--gpu-memory-utilization 0.9"
[rollout]
workers = 4
[trainer]
router_replay = false
"""


def bash_ok(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def commands(script: str, prefix: str) -> list[list[str]]:
    """The `start NAME...` lines of a script whose NAME starts with `prefix`, as argv lists."""
    lines = script.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.startswith(f"start {prefix}")]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def render(text: str, tmp_path: Path, **opts) -> str:
    return slurm_script.render(config.loads(text), tmp_path / "run", slurm_job.JobOptions(**opts))


def test_dry_run_prints_a_valid_script_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["launch", "slurm", str(EXAMPLE), "--dry-run", "--run-dir", str(run_dir), "--partition", "cpu",
                 "--time", "00:20:00"]) == 0
    script = capsys.readouterr().out
    bash_ok(script)
    assert not run_dir.exists()
    header = script.split("#SBATCH")[0]
    for said in ("control", "redis-server", "archiver", "metrics exporter", "rollout worker", "torchrun",
                 "reel role trainer", "REEL_BUS_URL", "version-0 weights", str(run_dir)):
        assert said in header, said
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch.count("#SBATCH hetjob") == 2  # control, rollout, trainer
    assert sum("--partition=cpu" in line for line in sbatch) == 3
    trainer, = commands(script, "trainer")
    assert trainer[trainer.index("--") + 1:][-6:] == ["--", "$REEL", "role", "trainer", "--run", "$RUN_DIR"]
    rollout, = commands(script, "rollout")
    assert "--worker \"$SLURM_PROCID\"" in rollout[-1]
    assert "requirepass" not in script.replace("requirepass %s", "")  # the password is made in the job


def test_fp8_serving_quantises_online_only_an_unquantised_checkpoint(tmp_path: Path) -> None:
    plain, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    for directory, extra in ((plain, {}), (fp8, {"quantization_config": {"quant_method": "fp8",
                                                                           "weight_block_size": [128, 128]}})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **extra}))
    assert vllm_args.precision_args("fp8", plain) == ["--dtype", "bfloat16", "--quantization", "fp8_per_block"]
    assert vllm_args.precision_args("fp8", fp8) == ["--dtype", "bfloat16"]  # the checkpoint's own block scales
    assert vllm_args.precision_args("bf16", plain) == ["--dtype", "bfloat16"]


@pytest.mark.parametrize("nodes,gpus,ranks,per_node", [(2, 4, 8, 4), (2, 0, 4, 2), (1, 0, 1, 1)])
def test_one_trainer_group_over_nodes_times_gpus(tmp_path: Path, nodes: int, gpus: int, ranks: int,
                                                 per_node: int) -> None:
    text = EXAMPLE.read_text().replace("[trainer]\n", f"[trainer]\nranks = {ranks}\n")
    script = render(text, tmp_path, trainer_nodes=nodes, gpus_per_node=gpus)
    bash_ok(script)
    trainer, = commands(script, "trainer")  # one step: one torchrun per node, one rendezvous
    assert f"--nodes={nodes}" in trainer and "--ntasks-per-node=1" in trainer
    assert f"--nnodes={nodes}" in trainer and f"--nproc-per-node={per_node}" in trainer
    assert "--rdzv-backend=c10d" in trainer and "--rdzv-id=$SLURM_JOB_ID" in trainer
    body = [line for line in script.replace("\\\n", " ").splitlines() if not line.startswith("#")]
    assert sum("role trainer" in line for line in body) == 1  # its rank 0 is the run's only trainer on the bus
    assert f"one trainer over {nodes * per_node} rank(s)" in script.split("#SBATCH")[0].replace("\n#   ", " ")


def test_wide_ep_pd_vllm_command_lines(tmp_path: Path) -> None:
    script = render(WIDE_EP_PD, tmp_path, gpus_per_node=8, trainer_nodes=2)
    bash_ok(script)
    prefill, decode = commands(script, "vllm-prefill-"), commands(script, "vllm-decode-")
    assert len(prefill) == 2 and len(decode) == 2
    for pool, backend in ((prefill, "deepep_high_throughput"), (decode, "deepep_low_latency")):
        for node, argv in enumerate(pool):
            serve = argv[argv.index("serve") - 3:]  # the job's Python runs vLLM's CLI, not a `vllm` on PATH
            assert serve[:5] == ["$PYTHON", "-m", "vllm.entrypoints.cli.main", "serve", "/models/moe-fp8"]
            assert "--enable-expert-parallel" in serve
            assert flag(serve, "--data-parallel-size") == "16"
            assert flag(serve, "--data-parallel-size-local") == "8"
            assert flag(serve, "--data-parallel-start-rank") == str(8 * node)
            assert ("--headless" in serve) == (node > 0)
            assert flag(serve, "--all2all-backend") == backend
            # /models/moe-fp8 is not readable here: an unquantised checkpoint, quantised online in 128x128 blocks
            assert flag(serve, "--quantization") == "fp8_per_block"
            assert "--enable-scale-out" in serve  # the token-ids generate route
            assert "--enable-return-routed-experts" not in serve
            assert serve[-2:] == ["--gpu-memory-utilization", "0.9"]
            kv = json.loads(flag(serve, "--kv-transfer-config"))
            assert kv["kv_connector"] == "MultiConnector"
            nixl, offload = kv["kv_connector_extra_config"]["connectors"]
            assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}
            assert offload["kv_connector"] == "OffloadingConnector"
            assert offload["kv_connector_extra_config"] == {
                "cpu_bytes_to_use": 64 << 30, "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [{"type": "fs", "root_dir": "/local/kv"}]}
            assert f"VLLM_NIXL_SIDE_CHANNEL_HOST=$(group_addr {1 if pool is prefill else 2} {node})" in argv
        cudagraphs = "--compilation-config" in pool[0]
        assert cudagraphs == (backend == "deepep_low_latency")
    assert json.loads(flag(decode[0], "--compilation-config")) == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    router, = commands(script, "vllm-router")
    assert flag(router, "--prefill") == "http://$PREFILL_HEAD:8000"
    assert flag(router, "--decode") == "http://$DECODE_HEAD:8000"
    rollout, = commands(script, "rollout")
    assert rollout[2] == "0"  # vLLM's clients run on the control node
    assert 'REEL_VLLM_SERVERS="http://$PREFILL_HEAD:8000,http://$DECODE_HEAD:8000"' in script
    assert "--gpus-per-node=8 --exclusive" in script
    trainer, = commands(script, "trainer")
    assert "--nnodes=2" in trainer and "--nproc-per-node=8" in trainer


def test_mooncake_pd_roles_and_router_replay_with_offload(tmp_path: Path) -> None:
    pd = WIDE_EP_PD.replace("NixlConnector", "MooncakeConnector").replace('kv_offload_disk_dir = "/local/kv"\n', "")
    script = render(pd, tmp_path, gpus_per_node=8)
    roles = {argv[1]: json.loads(flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"]["connectors"][0]
             for argv in commands(script, "vllm-prefill-0") + commands(script, "vllm-decode-0")}
    assert roles["vllm-prefill-0"]["kv_role"] == "kv_producer" and roles["vllm-decode-0"]["kv_role"] == "kv_consumer"

    replay = """
[model]
path = "/models/moe"
[engine]
kind = "vllm"
precision = "bf16"
tensor_parallel_size = 2
data_parallel_size = 4
expert_parallel = true
kv_connector = "OffloadingConnector"
kv_offload_cpu_gib = 0.5
[trainer]
router_replay = true
"""
    script = render(replay, tmp_path, gpus_per_node=8)
    bash_ok(script)
    argv, = commands(script, "vllm-rollout-0")
    assert "--enable-return-routed-experts" in argv and "VLLM_USE_V2_MODEL_RUNNER=1" in argv
    assert flag(argv, "--dtype") == "bfloat16" and "--quantization" not in argv
    assert flag(argv, "--tensor-parallel-size") == "2" and "--all2all-backend" not in argv  # mixed pool
    assert json.loads(flag(argv, "--kv-transfer-config")) == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 29}}
    assert 'REEL_VLLM_URL="http://$ROLLOUT_HEAD:8000"' in script


def test_mooncake_store_gets_a_master_and_a_config_per_node(tmp_path: Path) -> None:
    store = """
[model]
path = "/models/moe"
[engine]
kind = "vllm"
data_parallel_size = 2
kv_connector = "MooncakeStoreConnector"
kv_offload_cpu_gib = 2
mooncake_protocol = "tcp"
"""
    script = render(store, tmp_path, gpus_per_node=1, rollout_nodes=2)
    bash_ok(script)
    master, = commands(script, "mooncake-master")
    assert "--rpc_port=$MOONCAKE_PORT" in master
    blocks = re.findall(r'cat > "\$RUN_DIR/slurm/mooncake-rollout-(\d)\.json" <<EOF\n(.*)\nEOF', script)
    assert [node for node, _ in blocks] == ["0", "1"]
    for node, text in blocks:
        cfg = json.loads(text)
        assert cfg["local_hostname"] == f"$(group_addr 1 {node})"
        assert cfg["master_server_address"] == "$BUS_HOST:$MOONCAKE_PORT"
        assert cfg["global_segment_size"] == 2 << 30 and cfg["protocol"] == "tcp"
    for node, argv in enumerate(commands(script, "vllm-rollout-")):
        assert f"MOONCAKE_CONFIG_PATH=$RUN_DIR/slurm/mooncake-rollout-{node}.json" in argv
        assert json.loads(flag(argv, "--kv-transfer-config"))["kv_connector"] == "MooncakeStoreConnector"


VLLM = '[model]\npath = "/m"\n[engine]\nkind = "vllm"\n'
REFUSED = [
    (VLLM + 'pd_disaggregation = true\nkv_connector = "NixlConnector"\n',
     ["trainer.router_replay", "engine.pd_disaggregation", "engine.kv_connector", "routed-expert capture"]),
    (VLLM + "pd_disaggregation = true\n[trainer]\nrouter_replay = false\n",
     ["engine.pd_disaggregation", "engine.kv_connector"]),
    (VLLM + "expert_parallel = true\n", ["engine.expert_parallel", "engine.data_parallel_size"]),
    (VLLM + 'kv_connector = "MooncakeConnector"\n', ["engine.kv_connector", "engine.pd_disaggregation"]),
    (VLLM + 'kv_connector = "LMCacheConnector"\n', ["engine.kv_connector", "unknown"]),
    (VLLM + 'kv_connector = "OffloadingConnector"\n', ["engine.kv_offload_cpu_gib"]),
    (VLLM + "kv_offload_cpu_gib = 8\n", ["engine.kv_offload_cpu_gib", "engine.kv_connector"]),
    (VLLM + 'kv_connector = "OffloadingConnector"\nkv_offload_disk_dir = "/d"\n', ["engine.kv_offload_cpu_gib"]),
    (VLLM + "eplb = true\n", ["engine.eplb", "engine.expert_parallel"]),
    (VLLM + "data_parallel_size = 0\n", ["engine.data_parallel_size"]),
    (VLLM + "serve_args = \"--x 'unclosed\"\n", ["engine.serve_args"]),
    ("[engine]\ntensor_parallel_size = 2\n", ["engine.tensor_parallel_size", 'engine.kind = "vllm"']),
]


@pytest.mark.parametrize("text,keys", REFUSED, ids=[k[0] for _, k in REFUSED])
def test_bad_engine_combinations_name_their_keys(text: str, keys: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        config.loads(text)
    for key in keys:
        assert key in str(info.value)


LAUNCH_REFUSED = [
    ("", ["--rollout-nodes", "2"], "--rollout-nodes 2 exceeds rollout.workers"),
    (VLLM, [], "--gpus-per-node"),
    ('[engine]\nkind = "vllm"\n', ["--gpus-per-node", "8"], "needs model.path"),
    (VLLM + "data_parallel_size = 3\n", ["--gpus-per-node", "4", "--rollout-nodes", "2"],
     "engine.data_parallel_size = 3 must be a multiple"),
    (VLLM + "data_parallel_size = 8\ntensor_parallel_size = 2\n", ["--gpus-per-node", "8"], "--gpus-per-node is 8"),
    (VLLM + 'pd_disaggregation = true\nkv_connector = "NixlConnector"\n[trainer]\nrouter_replay = false\n',
     ["--gpus-per-node", "8", "--rollout-nodes", "2"], "drop --rollout-nodes"),
    ('[bus]\nurl = "redis://elsewhere:6379/0"\n', [], "remove bus.url"),
    ("", ["--time", "1 hour"], "--time '1 hour' is not a Slurm time"),
    ("[trainer]\nranks = 4\n", ["--trainer-nodes", "2", "--gpus-per-node", "4"], "trainer.ranks = 4 but"),
    ("[trainer]\nranks = 3\n", ["--trainer-nodes", "2"], "trainer.ranks = 3 does not split evenly"),
]


@pytest.mark.parametrize("text,flags,said", LAUNCH_REFUSED, ids=[s for _, _, s in LAUNCH_REFUSED])
def test_impossible_jobs_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              text: str, flags: list[str], said: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert main(["launch", "slurm", str(path), "--dry-run", "--run-dir", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and err.startswith("reel: ") and err.count("\n") == 1


def test_run_dir_that_a_script_cannot_carry_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "slurm", str(EXAMPLE), "--dry-run", "--run-dir", str(tmp_path / "a b")]) == 2
    assert "--run-dir" in capsys.readouterr().err


def test_without_slurm_submit_fails_clearly_and_leaves_no_run_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    run_dir = tmp_path / "run"
    assert main(["launch", "slurm", str(EXAMPLE), "--run-dir", str(run_dir)]) == 1
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize("verb", ["status", "cancel"])
def test_status_and_cancel_need_a_submitted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str) -> None:
    assert main(["launch", verb, "--run", str(tmp_path)]) == 1
    assert "no slurm_job_id" in capsys.readouterr().err


def test_builtin_engine_accepts_no_vllm_keys_but_vllm_keys_have_defaults() -> None:
    default = config_engine.EngineSection()
    assert all(hasattr(default, key) for key in config_engine.VLLM_ONLY_KEYS)
    config.loads(EXAMPLE.read_text())


@contextmanager
def job_redis(tmp_path: Path) -> Iterator[int]:
    """A redis-server as start_bus runs it (ops/redis/redis.conf, a password); yields its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "job.conf").write_text(f"include {slurm_script.REDIS_CONF}\nbind 127.0.0.1\nport {port}\n"
                                       f"requirepass s3cret\ndir {tmp_path}\n")
    proc = subprocess.Popen([service_redis_server(), str(tmp_path / "job.conf")], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password="s3cret")
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server with ops/redis/redis.conf did not start"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_production_redis_conf_is_durable_and_needs_the_password(tmp_path: Path) -> None:
    with job_redis(tmp_path) as port:
        client = redis.Redis(port=port, password="s3cret")
        settings = {k: client.config_get(k)[k] for k in ("appendonly", "appendfsync", "save", "maxmemory-policy")}
        assert settings == {"appendonly": "yes", "appendfsync": "everysec", "save": "",
                            "maxmemory-policy": "noeviction"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()


def test_each_role_reads_its_own_redis_user_from_a_private_file(tmp_path: Path) -> None:
    """The job's URL (its Redis password) is not exported to the roles; once the bus answers the job
    makes one Redis user per role and leaves each URL in RUN_DIR/bus_url.ROLE (0600), which
    `reel role ROLE` reads; a rollout worker's user cannot XADD to `steps`."""
    script = render('[run]\nname = "roles"\n', tmp_path)
    bash_ok(script)
    assert "export REEL_BUS_URL" not in script and 'rm -f "$RUN_DIR/bus_url" "$RUN_DIR"/bus_url.*' in script
    users = next(line for line in script.splitlines() if "reel.runtime.launch.role_users" in line)
    assert script.index('wait_until "the bus" bus_ok') < script.index(users) < script.index("start archiver")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text('[run]\nname = "roles"\n')
    env = {k: v for k, v in os.environ.items() if k != "REEL_BUS_URL"} | {"PYTHON": sys.executable,
                                                                        "RUN_DIR": str(run_dir)}
    with job_redis(tmp_path) as port:
        job = f'REEL_BUS_URL="redis://:s3cret@127.0.0.1:{port}/0"\n{users}\nbash -c \'printf "${{REEL_BUS_URL-unset}}"\''
        done = subprocess.run(["bash", "-c", job], env=env, capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout == "unset", done.stderr  # what srun hands a role
        assert "one Redis user per role" in done.stderr
        for role in role_users.ROLES:
            path = role_users.url_file(run_dir, role)
            assert path.stat().st_mode & 0o777 == 0o600
            assert f"//reel.roles.{role}:" in path.read_text() and "s3cret" not in path.read_text()
        rollout = run_dir_mod.read_bus_url(run_dir, "rollout")
        assert rollout == role_users.url_file(run_dir, "rollout").read_text().strip()
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(rollout).xadd("reel:{roles}:steps", {"e": b"x"})
        redis.Redis.from_url(rollout).xadd("reel:{roles}:trajectories", {"e": b"x"})


def test_partitioned_run_on_a_redis_cluster_with_mooncake_blobs(tmp_path: Path) -> None:
    script = render('[bus]\nurl = "redis://10.0.0.5:7000"\ncluster = true\npartitions = 4\n'
                    '[blobs]\nbackend = "mooncake"\nmooncake_protocol = "rdma"\nmooncake_device = "mlx5_0"\n'
                    '[rollout]\nworkers = 2\n', tmp_path)
    bash_ok(script)
    assert "export REEL_BUS_CLUSTER=1" in script
    assert 'REEL_BUS_URL=$("$PYTHON" -m reel.runtime.launch.bus_access "$RUN_DIR/config.toml")' in script
    assert "start_bus" not in script.split("# het group 0: control")[1]  # no Redis of its own
    master, = commands(script, "blob-master")
    holder, = commands(script, "blob-holder")
    assert "--rpc_port=$BLOB_MASTER_PORT" in master and "--enable_http_metadata_server=true" in master
    assert "--global_segment_size=1073741824" in holder and "--protocol=rdma" in holder
    assert "--device_names=mlx5_0" in holder and "--local_buffer_size=0" in holder
    assert 'export REEL_MOONCAKE_MASTER="$BLOB_HOST:$BLOB_MASTER_PORT"' in script
    assert script.index("blob-holder") < script.index("start trainer")  # the store is up before any role


def test_slurm_refuses_a_bus_url_that_is_not_a_cluster(tmp_path: Path) -> None:
    with pytest.raises(ReelError, match="bus.cluster = true"):
        render('[bus]\nurl = "redis://10.0.0.5:7000"\n', tmp_path)


def test_cluster_mode_hands_roles_the_password_and_tls_files(tmp_path: Path) -> None:
    """The job composes REEL_BUS_URL from the config and REEL_BUS_PASSWORD at run time: the roles get
    the password and the TLS files, which neither the script nor any argv holds."""
    text = ('[run]\nname = "c"\n[bus]\nurl = "rediss://reel@10.0.0.5:7000"\ncluster = true\n'
            f'tls_ca = "{tmp_path}/ca.crt"\n')
    script = render(text, tmp_path)
    assert "s3cret" not in script
    (tmp_path / "config.toml").write_text(text)
    line = next(x for x in script.splitlines() if "reel.runtime.launch.bus_access" in x)
    env = {**os.environ, "PYTHON": sys.executable, "RUN_DIR": str(tmp_path), "REEL_BUS_PASSWORD": "s3cret"}
    out = subprocess.run(["bash", "-c", f'{line}\nprintf "%s" "$REEL_BUS_URL"'], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out == f"rediss://reel:s3cret@10.0.0.5:7000?ssl_ca_certs={quote(str(tmp_path), safe='')}%2Fca.crt"


def test_the_announced_metrics_address_is_the_one_bound(tmp_path: Path) -> None:
    script = render("", tmp_path)
    metrics, = commands(script, "metrics")
    assert flag(metrics, "--addr") == "$BUS_HOST" and flag(metrics, "--port") == "$METRICS_PORT"
    assert 'echo "reel: metrics at http://$BUS_HOST:$METRICS_PORT/metrics"' in script


def test_vllm_servers_bind_their_node_and_get_the_runs_key_by_environment(tmp_path: Path) -> None:
    script = render(VLLM, tmp_path, gpus_per_node=8)
    server, = commands(script, "vllm-rollout-0")
    assert flag(server, "--host") == "$(group_addr 1 0)" and "0.0.0.0" not in script
    assert flag(server, "--middleware") == "reel.producers.vllm_auth.RequireKey"
    assert not any("key" in word.lower() for word in server if not word.startswith(("--middleware", "reel.")))
    key_line = 'VLLM_API_KEY=$("$PYTHON" -m reel.runtime.launch.vllm_key "$RUN_DIR") || exit 2'
    assert script.index(key_line) < script.index("start vllm-rollout-0") < script.index("start rollout")
    assert "REEL_BLOBS_DIR=$RUN_DIR/blobs" in " ".join(server)


@pytest.fixture
def eval_script(tmp_path: Path) -> str:
    """The example's job script with an eval role scoring every 5th version (built-in engine)."""
    return render(EXAMPLE.read_text() + "\n[eval]\nevery = 5\n", tmp_path)


def test_the_mismatch_role_runs_on_the_control_node_unless_switched_off(tmp_path: Path) -> None:
    """[mismatch] every > 0 (the default): the mismatch role on het group 0 with the trainer's threads, ending
    by itself after the last step; every = 0: no such role."""
    script = render(EXAMPLE.read_text(), tmp_path)
    bash_ok(script)
    role, = commands(script, "mismatch")
    assert role[:3] == ["start", "mismatch", "0"] and "--ntasks=1" in role
    assert role[-5:] == ["$REEL", "role", "mismatch", "--run", "$RUN_DIR"]
    assert "export ENDS_ITSELF=mismatch" in script
    off = render(EXAMPLE.read_text() + "\n[mismatch]\nevery = 0\n", tmp_path)
    assert not commands(off, "mismatch") and "export ENDS_ITSELF=''" in off


def test_eval_role_gets_a_step_and_an_engine_of_its_own(tmp_path: Path, eval_script: str) -> None:
    """[eval]: the eval role is started like the other roles; the job waits for it to score the last
    version before RunFinished, and its exit 0 is no failure. Built-in: on the first rollout node;
    vLLM: its own het group, in-process vLLM (the rollout's server URL is removed from its environment)."""
    plain = render(EXAMPLE.read_text(), tmp_path)
    assert not commands(plain, "eval") and "export ENDS_ITSELF=mismatch" in plain
    bash_ok(eval_script)
    evaluator, = commands(eval_script, "eval")
    assert evaluator[:3] == ["start", "eval", "1"] and "--ntasks=1" in evaluator
    assert evaluator[-5:] == ["$REEL", "role", "eval", "--run", "$RUN_DIR"]
    assert "export ENDS_ITSELF='eval mismatch'" in eval_script
    assert "#SBATCH hetjob" in eval_script and eval_script.count("#SBATCH hetjob") == 2  # no group of its own
    vllm = WIDE_EP_PD.replace("[trainer]", "[eval]\nevery = 10\n[trainer]").replace(
        "[engine]\n", "[engine]\nvllm_server = \"inprocess\"\n")
    script = render(vllm, tmp_path, gpus_per_node=8)
    bash_ok(script)
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    groups = [line.rsplit("# ", 1)[1] for line in sbatch if "  # " in line]
    assert groups == ["0: control", "1: prefill", "2: decode", "3: eval", "4: trainer"]
    assert "--gpus-per-node=8" in next(line for line in sbatch if line.endswith("# 3: eval"))
    evaluator, = commands(script, "eval")
    assert evaluator[:3] == ["start", "eval", "3"]
    assert evaluator[evaluator.index("--") + 1:][:5] == ["env", "-u", "REEL_VLLM_URL", "-u", "REEL_VLLM_SERVERS"]
    trainer, = commands(script, "trainer")
    assert trainer[:3] == ["start", "trainer", "4"]


def test_a_component_that_ends_itself_is_awaited_before_run_finished(tmp_path: Path, eval_script: str) -> None:
    """The job script's own supervision, run by bash with stand-ins for srun and the bus: the eval
    role's exit 0 is no failure, and `finish` waits for it before announcing RunFinished."""
    order = tmp_path / "order"
    order.touch()
    stand_ins = f"""
srun() {{ while [[ $1 != bash ]]; do shift; done; "$@"; }}
squeue() {{ :; }}
announce_finished() {{ echo announce >> {order}; }}
start archiver 0 {tmp_path}/archiver.log -- bash -c 'until grep -q announce {order}; do sleep 0.1; done'
start eval 1 {tmp_path}/eval.log -- bash -c 'sleep 2; echo eval >> {order}'
start trainer 2 {tmp_path}/trainer.log -- bash -c 'echo trainer >> {order}'
supervise
"""
    job = eval_script.split("# ---- This job's components")[0] + stand_ins
    done = subprocess.run(["bash", "-c", job], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_JOB_ID": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert order.read_text().split() == ["trainer", "eval", "announce"]
    assert "waiting up to 300s for eval to end" in done.stdout


def test_a_failed_component_is_recorded_in_the_log_before_the_job_ends(tmp_path: Path) -> None:
    """The job script run by bash with stand-ins for srun and the bus: a component that fails stops the
    others, then RunFinished("failed: NAME exited CODE") is announced while the archiver still runs."""
    script = render(EXAMPLE.read_text(), tmp_path)
    order = tmp_path / "order"
    order.touch()
    stand_ins = f"""
STOP_TIMEOUT_S=20
srun() {{ while [[ $1 != bash ]]; do shift; done; "$@"; }}
squeue() {{ :; }}
announce_finished() {{ echo "announce $1" >> {order}; }}
start archiver 0 {tmp_path}/archiver.log -- \\
    bash -c 'until grep -q announce {order}; do sleep 0.1; done; echo archived >> {order}'
start trainer 2 {tmp_path}/trainer.log -- bash -c 'sleep 2; echo trainer >> {order}'
start rollout 1 {tmp_path}/rollout.log -- bash -c 'exit 3'
supervise
"""
    job = script.split("# ---- This job's components")[0] + stand_ins
    done = subprocess.run(["bash", "-c", job], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_JOB_ID": "1"})
    assert done.returncode == 3, done.stdout + done.stderr
    assert order.read_text().splitlines() == ["trainer", "announce failed: rollout exited 3", "archived"]


def test_each_pool_task_runs_under_its_liveness_watcher_and_the_jobs_watcher_starts_first(tmp_path: Path) -> None:
    """runtime/launch/pool_watch.py: a rollout worker, and a one-node pool's vLLM server (probed at its own
    address), restarted in place when stalled; the job's watcher starts before any role."""
    script = render(VLLM, tmp_path, gpus_per_node=8)
    bash_ok(script)
    server, = commands(script, "vllm-rollout-0")
    watch = server.index("reel.runtime.launch.pool_watch")
    assert flag(server, "--role") == "vllm-rollout-0" and flag(server, "--probe") == "http://$(group_addr 1 0):8000"
    assert server[watch - 2:watch] == ["$PYTHON", "-m"] and server[server.index("--probe") + 2] == "--"
    assert server.index("--probe") < server.index("vllm.entrypoints.cli.main")
    worker, = commands(script, "rollout")
    assert worker[-1].startswith('exec "$PYTHON" -m reel.runtime.launch.pool_watch --run "$RUN_DIR" '
                                 '--role "rollout-$SLURM_PROCID" -- "$REEL" role rollout')
    assert script.index("\nwatch_liveness\n") < script.index("start_bus 0")
    builtin, = commands(render("", tmp_path), "rollout")
    assert "pool_watch" in builtin[-1] and "--probe" not in builtin[-1]
