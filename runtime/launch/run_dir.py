"""A run directory and its bus: created atomically or checked for a resume, the Redis it uses, the URLs each role gets."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reel.runtime.config.run import RunDirError, load_run_config
from reel.runtime.config.sections import Config
from reel.runtime.launch import resume as resume_mod


def use_cluster_client(config: Config) -> None:
    """bus.cluster = true: every bus client of this process and of the roles it starts is a cluster
    client (reel.bus.streams.connect reads REEL_BUS_CLUSTER). Likewise bus.ride_out_s, the Redis pause
    they ride out (reel.bus.redis_boundary reads REEL_BUS_RIDE_OUT_S)."""
    from reel.bus.cluster import CLUSTER_ENV
    from reel.bus.redis_boundary import RIDE_OUT_ENV

    if config.bus.cluster:
        os.environ[CLUSTER_ENV] = "1"
    os.environ[RIDE_OUT_ENV] = f"{config.bus.ride_out_s:g}"


def prepare_run_dir(run_dir: Path, config_text: str, config: Config, *, resume: bool) -> dict[str, list]:
    """Create the run directory atomically (a crash leaves no half-written run), or check a resume:
    returns the keys a resume changes (launch/resume.py says which may)."""
    if resume:
        changes = resume_mod.config_changes(load_run_config(run_dir), config)
        resume_mod.check_changes(run_dir / "config.toml", changes, resume_mod.last_committed_step(run_dir))
        return changes
    if run_dir.exists():
        raise RunDirError(f"{run_dir} already exists; pass --resume to continue it or choose another run.name/--out")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.", dir=run_dir.parent))
    try:
        for sub in ("log", "blobs", "redis", "roles"):
            (staging / sub).mkdir()
        (staging / "config.toml").write_text(config_text)
        staging.rename(run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {}


@contextmanager
def bus_for(run_dir: Path, config: Config) -> Iterator[str]:
    """The run's bus URL; starts (and finally stops) the embedded Redis when bus.url is empty."""
    url_file = run_dir / "bus_url"
    if config.bus.url:
        from reel.runtime.launch.bus_access import bus_url

        url = bus_url(config)
        _write_private(url_file, url)  # it holds the password
        try:
            yield url
        finally:
            url_file.unlink(missing_ok=True)
        return
    from reel.bus.server import EmbeddedRedis

    server = EmbeddedRedis(run_dir)
    url = server.start()
    _write_private(url_file, url)
    try:
        yield url
    finally:
        url_file.unlink(missing_ok=True)
        server.stop()


@contextmanager
def role_urls_for(url: str, config: Config) -> Iterator[dict[str, str]]:
    """With ACLs on (bus.url), each role's own Redis user (runtime/launch/role_users.py); the embedded
    Redis has no users: only this Unix user can reach its socket."""
    if not config.bus.url:
        yield {}
        return
    from reel.runtime.launch import role_users

    with role_users.for_run(url, config.run.name, cluster=config.bus.cluster) as urls:
        yield urls


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an older file may have had a wider mode
        f.write(text)


def read_bus_url(run_dir: Path, role: str | None = None) -> str:
    """The bus URL of `role` (its own Redis user's, a Slurm job's RUN_DIR/bus_url.ROLE), else the run's."""
    from reel.runtime.launch.role_users import url_file

    own = url_file(run_dir, role) if role else None
    try:
        return (own if own is not None and own.is_file() else run_dir / "bus_url").read_text().strip()
    except FileNotFoundError:
        raise RunDirError(
            f"no live bus for {run_dir} (no bus_url file); pass --bus URL or set REEL_BUS_URL"
        ) from None


def announce_finished(url: str, run: str, reason: str, partitions: int = 1, run_dir: Path | None = None) -> None:
    """Publish RunFinished; the archiver exits once it has logged it and drained every stream."""
    import asyncio

    from reel.bus.events import RunFinished
    from reel.bus.seqs import recover_seq
    from reel.bus.streams import Publisher, connect, dead_letters_added, recover_next_seq

    async def publish() -> None:
        redis = connect(url)
        try:
            producer = "launcher:0"
            seq = (await recover_seq(redis, run_dir, run, producer, ["control"], partitions) if run_dir is not None
                   else await recover_next_seq(redis, run, producer, partitions))
            publisher = Publisher(redis, run, producer, seq)
            dead = await dead_letters_added(redis, run, partitions)
            await publisher.publish([publisher.stamp(RunFinished, reason=reason, dead_letters=dead)])
        finally:
            await redis.aclose()

    asyncio.run(publish())
