"""Local supervisor: one process per role, all stop when one fails.

`reel run CONFIG` lays out the run directory, starts the embedded Redis (unless bus.url is set),
then starts the archiver, the trainer and the rollout workers as separate processes, shows
progress, and stops everything when the trainer has committed its last step, on Ctrl-C, or when
any role fails (then prints that role's last log lines and exits non-zero), hangs (the liveness
rules, runtime/launch/liveness.py), or the embedded Redis exits (runtime/launch/bus_probe.py).

Run directory:
    config.toml      the config as given (the run's identity; --resume checks it)
    bus_url          where the live bus is, password included (mode 0600; removed when the run stops)
    bus_url.ROLE     a Slurm job's per-role Redis user (runtime/launch/role_users.py), read by `reel role ROLE`
    log/             the archiver's event log       blobs/   weights, checkpoints, big traces
    redis/           embedded Redis (AOF)           roles/<role>.log   each process's output
Roles reach each other only through the bus and these files, so `reel role NAME --run DIR`
starts the same process on another node.

With engine.kind = "vllm" and engine.vllm_server = "local", the supervisor also runs one
`vllm serve` (roles/vllm.log) on the run's version-0 weights once the trainer has written them
(RUN_DIR/init), and gives the rollout workers its address (REEL_VLLM_URL); they wait for it to be
healthy. It stops with the run, and a server that dies stops the run like any role. A probe writes
its beat (runtime/launch/server_probe.py): a server that stops answering, or holds requests without
generating, for longer than its bound is killed and started again with the rollout workers (their
requests to it are lost: their in-flight groups go as after kill -9).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from reel.bus.errors import ReelError
from reel.runtime.config import checks
from reel.runtime.blob_store import mooncake_for
from reel.runtime.config.sections import Config
from reel.producers.envs.registry import check_config
from reel.runtime.config.overrides import load_with_sets
from reel.runtime.train.torchrun import torchrun_argv
from reel.runtime.launch import resume as resume_mod
from reel.runtime.launch import vllm_args
from reel.runtime.launch.vllm_key import KEY_ENV, run_api_key
from reel.runtime.launch.bus_loss import describe
from reel.runtime.launch.bus_probe import refuses
from reel.runtime.launch.liveness import Liveness
from reel.runtime.launch.server_probe import ServerProbe
from reel.runtime.launch.progress import Progress
from reel.runtime.launch.signals import StopRequested, exit_code, stop_on_signals
from reel.runtime.work_progress import PROGRESS_FILE
from reel.runtime.launch.role_process import RoleProcess, free_port
from reel.runtime.launch.run_dir import (announce_finished, bus_for, prepare_run_dir, role_urls_for, use_cluster_client)


SINK_DRAIN_S = 60.0  # how long a finished run waits for its sinks to write the last steps
STOP_TIMEOUT_S = 20.0
# RunFinished.reason of a run that did not complete: "failed: <role> exited <code>", "stopped: <SIGNAL>".
FAILED, STOPPED = "failed", "stopped"
EVAL_FINISH_TIMEOUT_S = 300.0  # after the last commit, how long the eval role may take to score the last version
# After the last commit, how long the mismatch role may take to split the steps it lags behind.
MISMATCH_FINISH_TIMEOUT_S = 300.0
BUS_GONE = "redis"  # what _watch returns when the embedded Redis has exited (runtime/launch/bus_probe.py)


def main_run(args: argparse.Namespace) -> int:
    with stop_on_signals():  # SIGTERM/SIGHUP (Slurm, timeout, systemd, a closed terminal) stop it like Ctrl-C
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # Every config error surfaces before anything is written; --set overrides end up in config.toml.
    config, text = load_with_sets(args.config, args.set, allow_empty=args.defaults)
    check_config(config, args.config)
    if serves_vllm_locally(config):
        vllm_args.check_local_server(config)
    use_cluster_client(config)
    if config.metrics.sinks:
        from reel.consumers.sinks.cli import check_available  # here: the trackers' libraries, checked before anything starts

        check_available(config.metrics.sinks)
    checks.check_model_path(config, text)
    run_dir = Path(args.out) if args.out else Path(config.run.out_dir) / config.run.name
    changes = prepare_run_dir(run_dir, text, config, resume=args.resume)
    after = resume_mod.last_committed_step(run_dir) if args.resume else 0
    if args.resume:
        if after >= config.run.steps:
            print(f"reel: run {config.run.name} is already complete ({after} of {config.run.steps} steps committed); "
                  f"raise run.steps in {args.config} and resume again to extend it", file=sys.stderr)
            return 0
        changed = "".join(f", {key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
        print(f"reel: resuming run {config.run.name} in {run_dir} after step {after} of {config.run.steps}{changed}",
              file=sys.stderr, flush=True)
    with bus_for(run_dir, config) as url, role_urls_for(url, config) as role_urls, mooncake_for(run_dir, config):
        window = None
        if args.resume:  # also ends the log's record of a stopped or failed end (RunFinished): the run goes on
            window = resume_mod.record_resume(run_dir, url, config, text, changes, after)
        supervisor = Supervisor(run_dir, url, config, live=not args.no_live and sys.stdout.isatty(),
                                resumed_after=after)
        supervisor.role_urls = role_urls
        # With --set the overrides live in the run's config.toml: resuming from it keeps them.
        config_arg = run_dir / "config.toml" if args.set else args.config
        supervisor.resume_command = f"reel run {config_arg} --resume --out {run_dir}"
        if window is not None:  # what Redis lost of the log: a line ...
            print(f"reel: {describe(window)}", file=sys.stderr, flush=True)
            # ... and a metric: the trainer's next StepCommitted carries it (metrics.bus_lost_*).
            supervisor.trainer_env = {"REEL_BUS_LOST_EVENTS": str(window.events),
                                      "REEL_BUS_LOST_WINDOW_S": str(window.seconds)}
        return supervisor.run()


def serves_vllm_locally(config: Config) -> bool:
    """Whether `reel run` starts a `vllm serve` for the run (not when REEL_VLLM_URL names one already)."""
    return (config.engine.kind == "vllm" and config.engine.vllm_server == "local"
            and not os.environ.get("REEL_VLLM_URL"))


class Supervisor:
    """Starts the roles of a run and watches them until the run ends or one fails."""

    run_dir: Path
    url: str
    config: Config
    roles: dict[str, RoleProcess]
    progress: Progress
    vllm_port: int | None  # the local `vllm serve` (engine.vllm_server = "local"), started once init/ exists
    trainer_env: dict[str, str]  # set before run(): what the trainer must record (a bus loss window)
    role_urls: dict[str, str]  # set before run(): each role's own Redis user (empty: every role uses url)
    resume_command: str  # what continues this run, for the messages of a stopped or failed run
    liveness: Liveness  # names a role whose heartbeat stops moving (runtime/launch/liveness.py)
    probe: ServerProbe | None  # writes the local `vllm serve`'s beat while it runs

    def __init__(self, run_dir: Path, url: str, config: Config, *, live: bool, resumed_after: int = 0):
        self.run_dir = run_dir
        self.url = url
        self.config = config
        self.roles = {}
        self.progress = Progress(url, config, live=live, resumed_after=resumed_after,
                                 work_file=run_dir / "roles" / PROGRESS_FILE)
        self.vllm_port = free_port() if serves_vllm_locally(config) else None
        self.trainer_env = {}
        self.role_urls = {}
        self.resume_command = f"reel run CONFIG --resume --out {run_dir}"
        self.liveness = Liveness(run_dir / "roles", config.run.stall_s)
        self.probe = None

    def _start(self, name: str, role: str, *extra: str, threads: int = 1, env: dict[str, str] | None = None,
               ranks: int = 1) -> None:
        args = ["role", role, "--run", str(self.run_dir), *extra]
        python = torchrun_argv(ranks) if ranks > 1 else ["-m", "reel.runtime.launch.cli"]
        # The bus URL (maybe with a password) goes by environment: argv is public to `ps`.
        env = {"REEL_BUS_URL": self.role_urls.get(role, self.url), **(self.trainer_env if role == "trainer" else {}),
               **(env or {})}
        self.roles[name] = RoleProcess(name, [sys.executable, *python, *args], self.run_dir / "roles" / f"{name}.log",
                                       threads, env)

    def _start_vllm_when_ready(self) -> None:
        """Start the local `vllm serve` once the trainer has written the version-0 weights it loads."""
        if self.vllm_port is None or "vllm" in self.roles:
            return
        from reel.runtime.train.initial_policy import init_dir  # here: it imports the model (torch)

        weights = init_dir(self.run_dir)
        if not (weights / "config.json").is_file():
            return
        # Under this interpreter, as vllm_serve.local_vllm does: the server imports Reel's middleware and
        # worker extension, which must be this run's `reel` (another environment's `vllm` script on
        # PATH imports its own, which may lack them).
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main",
                *vllm_args.local_serve_argv(self.config, "vllm", weights, self.vllm_port)[1:]]
        env = vllm_args.local_serve_env(self.config, run_api_key(self.run_dir), self.run_dir / "blobs")
        self.roles["vllm"] = RoleProcess("vllm", argv, self.run_dir / "roles" / "vllm.log", self.config.engine.threads,
                                         env)
        self.probe = ServerProbe("vllm", f"http://127.0.0.1:{self.vllm_port}", self.run_dir / "roles",
                                 run_api_key(self.run_dir)).start()

    def run(self) -> int:
        trainer_threads = self.config.trainer.threads or 1
        rollout_env = self._rollout_env()
        try:
            self._start("archiver", "archiver")
            self._start("trainer", "trainer", threads=trainer_threads, ranks=self.config.trainer.ranks)
            for w in range(self.config.rollout.workers):
                self._start(f"rollout-{w}", "rollout", "--worker", str(w), env=rollout_env)
            for sink in self.config.metrics.sinks:
                self._start(f"sink-{sink}", "sink", "--sink", sink)
            if self.config.eval.every > 0:
                self._start("eval", "eval", threads=self.config.engine.threads)
            if self.config.mismatch.every > 0:  # the trainer's thread count: the same bits as its π_old
                self._start("mismatch", "mismatch", threads=trainer_threads)
            with self.progress:
                failed = self._watch()
            if failed == BUS_GONE:
                return self._bus_gone()
            if failed is not None:
                return self._fail(failed)
            return self._finish()
        except KeyboardInterrupt as interrupt:
            self.progress.refresh()  # the steps committed since the last refresh: they happened
            print(f"reel: stopping every role (up to {2 * STOP_TIMEOUT_S:.0f} s: the others, then the archiver; "
                  f"a warm-start in progress is discarded)...", file=sys.stderr, flush=True)
            signame = interrupt.name if isinstance(interrupt, StopRequested) else "SIGINT"
            self._record_end(f"{STOPPED}: {signame}")
            self._stop_all()
            why = f"stopped by {interrupt.name}" if isinstance(interrupt, StopRequested) else "interrupted"
            print(f"reel: {why}; every role stopped; `{self.resume_command}` continues this run", file=sys.stderr)
            return exit_code(interrupt)
        finally:
            self._stop_all()

    def _rollout_env(self) -> dict[str, str] | None:
        return {"REEL_VLLM_URL": f"http://127.0.0.1:{self.vllm_port}",  # and its key, by environment
                KEY_ENV: run_api_key(self.run_dir)} if self.vllm_port else None

    def _restart(self, names: list[str]) -> None:
        """Kill (SIGKILL, frozen or not) and start again the roles Liveness.decide names: a rollout
        worker's in-flight groups are lost as after kill -9 (a group is published whole or not at all),
        and the new process takes its seq and draws from the bus and the log. A vLLM server goes with
        every rollout worker (their requests to it are lost); it starts again on the version-0 weights,
        and worker 0 pushes the newest version to it, as at the start of a run."""
        # A worker of a restarted server goes with it: that is the cause to name, even where the worker
        # also stalled in the same check (its requests hang on the frozen server).
        with_server = [n for n in self.roles if n.startswith("rollout-")] if "vllm" in names else []
        if with_server:
            names = ["vllm", *with_server]
        for name in names:
            if name not in self.roles:
                continue
            if name == "vllm" and self.probe is not None:
                self.probe.stop()
            self.roles.pop(name).wait(timeout=0.0)
            self.liveness.forget(name)
            why = "whose vLLM server was restarted" if name in with_server else "which had stalled"
            print(f"reel: killed {name}, {why}, and started it again", file=sys.stderr, flush=True)
            if name.startswith("rollout-"):
                self._start(name, "rollout", "--worker", name.removeprefix("rollout-"), env=self._rollout_env())
        self._start_vllm_when_ready()

    def _watch(self) -> str | None:
        """Until the trainer exits; returns the name of a failed (or hung) role, else None."""
        while True:
            self.progress.refresh()
            verdict = self.liveness.decide()
            for line in verdict.lines:
                print(line, file=sys.stderr, flush=True)
            self._restart(verdict.restart)
            if verdict.stop is not None:
                return verdict.stop  # stopped like a role that died: the resume is exact
            if not self.config.bus.url and refuses(self.url):  # exited, not paused: no ride-out brings it back
                return BUS_GONE
            self._start_vllm_when_ready()
            for name, role in list(self.roles.items()):
                code = role.poll()
                if code is None:
                    continue
                if name.startswith("sink-"):  # a tracker never stops training: say so, train on
                    print(f"reel: role {name} stopped with exit code {code} (see {role.log_path}); training goes on; "
                          f"`reel metrics {name[5:]} --run {self.run_dir} --follow` resumes it", file=sys.stderr)
                    del self.roles[name]
                    continue
                if name == "trainer" and code == 0:
                    return None
                if name == "eval" and code == 0:
                    continue  # it scored the last version
                if name == "mismatch":  # done (0), or failed: an analysis role never stops training
                    if code != 0:
                        print(f"reel: role mismatch stopped with exit code {code} (see {role.log_path}); training "
                              f"goes on; `reel replay step N` computes any step's split", file=sys.stderr)
                        del self.roles[name]
                    continue
                return name
            time.sleep(0.5)

    def _finish(self) -> int:
        """The trainer committed its last step: announce the end, let the archiver drain, stop workers."""
        self.progress.finish(self.run_dir)
        if "eval" in self.roles and self.roles["eval"].poll() is None:
            print(f"reel: waiting up to {EVAL_FINISH_TIMEOUT_S:.0f} s for the eval role to score the last version",
                  flush=True)
            code = self.roles["eval"].wait(timeout=EVAL_FINISH_TIMEOUT_S)
            if code != 0:  # training is complete; only the last EvalResult is missing
                print(f"reel: the eval role stopped with exit code {code} before scoring the last version; "
                      f"see {self.roles['eval'].log_path}", file=sys.stderr, flush=True)
        if "mismatch" in self.roles and self.roles["mismatch"].poll() is None:
            print(f"reel: waiting up to {MISMATCH_FINISH_TIMEOUT_S:.0f} s for the mismatch role to split the last "
                  f"steps", flush=True)
            if self.roles["mismatch"].wait(timeout=MISMATCH_FINISH_TIMEOUT_S) != 0:
                print(f"reel: the mismatch role did not split every step (see {self.roles['mismatch'].log_path}); "
                      f"`reel replay step N` computes any step's split", file=sys.stderr, flush=True)
        # The workers publish until stopped (WorkerStats): stopped first, so that the archiver finds the
        # bus drained after RunFinished. The sinks stop at RunFinished, having read the last step.
        self._stop_all([role for name, role in self.roles.items()
                        if name != "archiver" and not name.startswith("sink-")])
        announce_finished(self.url, self.config.run.name, "completed", self.config.bus.partitions, self.run_dir)
        code = self.roles["archiver"].wait(timeout=120.0)
        for name in [n for n in self.roles if n.startswith("sink-")]:  # they stop at RunFinished
            self.roles[name].wait(timeout=SINK_DRAIN_S)
        self._stop_all()
        if code != 0:
            return self._fail("archiver")
        return 0

    def _fail(self, name: str) -> int:
        role = self.roles[name]
        code = role.poll()  # None: it hung (the liveness check), and is stopped with the others
        self._record_end(f"{FAILED}: {name} exited {code}" if code is not None else f"{FAILED}: {name} stalled")
        self._stop_all()
        what = f"stopped with exit code {code}" if code is not None else "stalled"
        print(f"reel: role {name} {what}, so the run was stopped; last lines of {role.log_path}:", file=sys.stderr)
        print(role.log_tail(), file=sys.stderr)
        print(f"reel: fix the cause, then `{self.resume_command}` continues this run (a resume may change only "
              f"{resume_mod.safe_keys()}; another fix needs a new run: another --out)", file=sys.stderr)
        return 1

    def _bus_gone(self) -> int:
        """The embedded Redis has exited: every role stops now (none can record the end, the log just
        ends), rather than after each has ridden out bus.ride_out_s."""
        print(f"reel: the run's Redis refuses connections: it has exited (see {self.run_dir / 'redis' / 'redis.log'}); "
              f"stopping every role", file=sys.stderr, flush=True)
        self._stop_all()
        print(f"reel: `{self.resume_command}` restarts Redis from its append-only file and continues this run",
              file=sys.stderr)
        return 1

    def _record_end(self, reason: str) -> None:
        """How a run that did not complete ended, in its log (RunFinished(reason), so `reel top` can say
        failed or stopped): every role but the archiver stops, then the archiver logs the end and drains.
        Best effort: with the archiver or the bus gone the log just ends (top: "stopped, no end recorded")."""
        archiver = self.roles.get("archiver")
        self._stop_all([role for name, role in self.roles.items() if name != "archiver"])
        if archiver is None or archiver.poll() is not None:
            print("reel: the archiver is not running, so the log does not record how the run ended",
                  file=sys.stderr, flush=True)
            return
        try:
            announce_finished(self.url, self.config.run.name, reason, self.config.bus.partitions, self.run_dir)
        except (ReelError, OSError) as exc:
            print(f"reel: could not record the run's end ({reason}) on the bus: {exc}", file=sys.stderr, flush=True)
            return
        if archiver.wait(timeout=STOP_TIMEOUT_S) != 0:
            print(f"reel: the archiver did not log the run's end ({reason}); see {archiver.log_path}",
                  file=sys.stderr, flush=True)

    def _stop_all(self, roles: list[RoleProcess] | None = None) -> None:
        roles = list(self.roles.values()) if roles is None else roles
        if self.probe is not None and self.roles.get("vllm") in roles:
            self.probe.stop()
        for role in roles:
            role.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for role in roles:
            role.wait(timeout=max(0.1, deadline - time.monotonic()))
