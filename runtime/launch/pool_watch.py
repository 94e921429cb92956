"""`reel run`'s liveness rules in a Slurm job, per pool: the watchers the job script starts.

The decision is runtime/launch/liveness.py's (`Liveness.decide`, the same as `reel run`'s); these
act on it where the processes are, since a task of a Slurm step can be killed and started again
only from its own node:

    python -m reel.runtime.launch.pool_watch --run RUN_DIR --role ROLE [--probe URL] -- COMMAND...
        one task of a pool (a rollout worker, a `vllm serve`): runs COMMAND as its child (its own
        process group; pid in roles/ROLE.pid) and watches ROLE's beat. Stalled, the child is killed
        (SIGKILL) and started again, and the task goes on: the step, and the job, never see it. With
        --probe URL the watcher writes the beat itself (runtime/launch/server_probe.py, a vLLM
        server). Each restart is counted in roles/ROLE.restarts ("COUNT WHY") before the kill: the
        job's watcher says it in the job's output, and a rollout worker's watcher restarts its
        worker too when a vLLM server's count moves (its requests to the old server are lost: its
        in-flight groups go as after kill -9). A child that ends by itself ends the task with its
        code; SIGTERM (the job's stop) is passed on to it.
    python -m reel.runtime.launch.pool_watch --run RUN_DIR --job
        the job's own watcher (control node): names every stalled role, and every restart a task's
        watcher made, in the job's output (the job script drops an earlier job's beats before it
        starts any role); when the trainer or archiver is hung it writes the name to
        RUN_DIR/slurm/hung and exits: the job script then stops the run as if that role had died,
        with the resume command.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reel.runtime.config import run as config_mod
from reel.runtime.launch.liveness import Liveness
from reel.runtime.launch.server_probe import ServerProbe
from reel.runtime.launch.vllm_key import KEY_ENV

__all__ = ["main", "HUNG_FILE", "RESTARTS_SUFFIX"]

CHECK_EVERY_S = 1.0
HUNG_FILE = "hung"  # in RUN_DIR/slurm: the trainer or archiver the job's watcher found hung
RESTARTS_SUFFIX = ".restarts"  # roles/<server>.restarts: how often a vLLM server's watcher restarted it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reel.runtime.launch.pool_watch")
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--role")
    parser.add_argument("--probe", help="the server's URL: the watcher writes its beat")
    parser.add_argument("--job", action="store_true", help="the job's watcher: names stalls, stops a hung run")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    stall_s = config_mod.load_run_config(args.run).run.stall_s
    if args.job:
        return watch_job(args.run, stall_s)
    if not args.role or not args.command:
        parser.error("a pool's watcher needs --role ROLE and, after --, the command it runs")
    return TaskWatch(args.run, args.role, args.command, stall_s, args.probe).run()


def watch_job(run_dir: Path, stall_s: float) -> int:
    """Until the trainer or archiver is hung (returns 0 after writing its name) or SIGTERM."""
    liveness = Liveness(run_dir / "roles", stall_s, drop_stale=False)  # the job script dropped them before any role
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    restarts = _restarts(run_dir / "roles")
    while True:
        verdict = liveness.decide()
        for line in verdict.lines:
            print(line, flush=True)
        for path, text in (seen := _restarts(run_dir / "roles")).items():
            if restarts.get(path) != text:  # a pool task's watcher acted: said here too, where the job's output is
                count, why = text.split(" ", 1)
                print(f"reel: {path[:-len(RESTARTS_SUFFIX)]} was killed, {why}, and started again by its task's "
                      f"watcher (restart {count})", flush=True)
        restarts = seen
        if verdict.stop is not None:
            (run_dir / "slurm" / HUNG_FILE).write_text(verdict.stop + "\n")
            return 0
        time.sleep(CHECK_EVERY_S)


def _restarts(roles: Path) -> dict[str, str]:
    """roles/ROLE.restarts: "COUNT WHY" of the last restart a task's watcher made."""
    return {p.name: p.read_text() for p in roles.glob(f"*{RESTARTS_SUFFIX}")}  # whole (os.replace)


class TaskWatch:
    """One pool task: its child, restarted when stalled (or when a server it uses restarts)."""

    def __init__(self, run_dir: Path, role: str, command: list[str], stall_s: float, probe: str | None):
        self.roles = run_dir / "roles"
        self.role = role
        self.command = command
        self.liveness = Liveness(self.roles, stall_s, only=[role])
        self.probe_url = probe
        self.probe: ServerProbe | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.servers_seen = self._server_restarts()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._pass_on)
        self._start()
        while True:
            assert self.child is not None
            code = self.child.poll()
            restarted = self._server_restarts()
            if code is not None and (self.stopping or restarted == self.servers_seen):
                if self.probe is not None:
                    self.probe.stop()
                return 128 - code if code < 0 else code  # killed by a signal: its code as a shell gives it
            verdict = self.liveness.decide()
            for line in verdict.lines:
                print(line, file=sys.stderr, flush=True)
            if restarted != self.servers_seen:  # its requests to the old server are lost: start afresh
                changed = sorted(name for name, count in restarted.items() if self.servers_seen.get(name) != count)
                self._restart(f"whose vLLM server {changed[0].removesuffix(RESTARTS_SUFFIX)} was restarted")
            elif self.role in verdict.restart:
                self._restart("which had stalled")
            time.sleep(CHECK_EVERY_S)

    def _start(self) -> None:
        self.child = subprocess.Popen(self.command, start_new_session=True)
        (self.roles / f"{self.role}.pid").write_text(str(self.child.pid))  # for operators (and tests)
        if self.probe_url:  # a fresh probe: it writes nothing until the new server answers
            self.probe = ServerProbe(self.role, self.probe_url, self.roles, os.environ.get(KEY_ENV)).start()

    def _restart(self, why: str) -> None:
        assert self.child is not None
        # Counted before the kill: a server's clients' watchers see it as soon as their requests fail.
        path = self.roles / f"{self.role}{RESTARTS_SUFFIX}"
        count = int(path.read_text().split()[0]) + 1 if path.exists() else 1
        path.with_name(path.name + ".part").write_text(f"{count} {why}")
        os.replace(path.with_name(path.name + ".part"), path)  # whole: a reader never sees it empty
        if self.probe is not None:
            self.probe.stop()
        try:
            os.killpg(self.child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.child.wait()
        self.liveness.forget(self.role)
        self.servers_seen = self._server_restarts()
        print(f"reel: killed {self.role}, {why}, and started it again", file=sys.stderr, flush=True)
        self._start()

    def _server_restarts(self) -> dict[str, str]:
        """The restart counts of the vLLM servers (a rollout worker's watcher restarts its worker on a change)."""
        if not self.role.startswith("rollout-"):
            return {}
        return {name: text for name, text in _restarts(self.roles).items() if name.startswith("vllm")}

    def _pass_on(self, *_: object) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
