"""verifiers: an environment of the `verifiers` 0.4 package (`verifiers.v1`), loaded from an installed package.

    [env]
    name = "verifiers:vf-reverse"      # or name = "verifiers" with env.options.id
    [env.options]
    args = {num_examples = 2000}       # the taskset's config fields (--env.taskset.* of vf-eval)
    eval_args = {split = "eval"}       # merged over args for the eval role's env (held out), if given
    harness = {id = "vf-reverse"}      # the agent's harness config (default: the taskset's own)
    timeout_s = 120                    # one group's episodes, at most (then the group is dropped)

The env drives its own episodes, as verifiers means trainers to: for a group, Reel asks
`env.slots(task, n)` and awaits `env.run_slot(slot, ModelContext(...))` for each, inside
`env.serving()`. The context's `TrainClientConfig` points the client at Reel's engine behind the
token-in/token-out route (producers/generate_route.py, on 127.0.0.1 with the run's key), and the
client renders with Reel's tokenizer (producers/envs/verifiers_renderer.py). Each episode's trace
branch (token_ids, sampled_mask) is joined to the completions the engine sampled, so every sampled
token keeps its logprob, policy version span and routing, and every other token is an env token
(masked from the loss) - as in a native multi-turn env (producers/envs/verifiers_episode.py).
The reward is the trace's weighted sum; each `@vf.reward` function's score goes to the sample's
`scores` (Trajectory) and the metrics.

Refused at config load, in one line: verifiers other than 0.4.x, a taskset that cannot be loaded or
has no tasks, and the built-in `bash` harness (the default for a taskset that ships none), which
fetches its program at start and fails offline. A group whose episode failed (`errors` set, a
harness that exited or timed out, a reward that is not a finite number) is dropped with the reason:
the rollout worker dead-letters it, the eval role leaves the prompt out.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import random
from typing import Any

from reel.producers.engine import Engine, SamplingParams
from reel.producers.envs.base import Env, Prompt
from reel.producers.envs.rewards import RewardError
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.sections import EnvSection
from reel.runtime.tokenizer import Tokenizer

KEY = "env.options"
OPTIONS = {"id", "args", "eval_args", "harness", "timeout_s"}
PREFIX = "verifiers:"
NEEDS_NETWORK = ("bash",)  # built-in harnesses that install their program at start


class Verifiers(Env):
    name = "verifiers"

    tokenizer: Tokenizer
    env_id: str
    args: dict[str, Any]
    eval_args: dict[str, Any] | None
    harness: dict[str, Any] | None
    timeout_s: float
    vf_env: Any  # a verifiers.v1 Env
    tasks: list[Any]  # its taskset's tasks, in load order
    _runs: Any  # verifiers_episode.Runs: the route and the env's serving, per event loop

    def __init__(self, tokenizer: Tokenizer, *, id: str, args: dict[str, Any] | None = None,
                 eval_args: dict[str, Any] | None = None, harness: dict[str, Any] | None = None,
                 timeout_s: float = 120.0, max_tokens: int = 16) -> None:
        from reel.producers.envs.verifiers_episode import Runs

        self.tokenizer, self.env_id = tokenizer, id
        self.args, self.eval_args, self.harness = dict(args or {}), eval_args, harness
        self.timeout_s = float(timeout_s)
        self.vf_env = load(id, self.args, harness)
        self.tasks = tasks_of(id, self.vf_env)
        self._runs = Runs(self, max_tokens)

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> Verifiers:
        return cls(tokenizer, max_tokens=max_tokens, **options_of(section))

    def held_out(self) -> Verifiers:
        if self.eval_args is None:
            return self
        return Verifiers(self.tokenizer, id=self.env_id, args={**self.args, **self.eval_args}, harness=self.harness,
                         timeout_s=self.timeout_s, max_tokens=self._runs.max_tokens)

    def sample(self, rng: random.Random) -> Prompt:
        index = rng.randrange(len(self.tasks))
        data = self.tasks[index].data
        ids = self._runs.renderer.prompt_ids(first_messages(data))
        answer = str(getattr(data, "answer", "") or "")
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=answer,
                      meta={"env": self.name, "id": self.env_id, "index": index, "answer": answer})

    async def drive_group(self, engine: Engine, prompt: Prompt, params: SamplingParams) -> list:
        """params.n episodes of the prompt's task, run by the verifiers env (producers/episode.py calls this)."""
        return await self._runs.group(engine, self.tasks[prompt.meta["index"]], prompt, params)

    def reference(self, prompt: Prompt) -> list[int]:
        if not prompt.answer:
            raise ConfigError(f"init.warmup_steps trains on reference answers, and verifiers env {self.env_id!r} "
                              "has none (its TaskData has no `answer` field); add one or set init.warmup_steps = 0")
        return super().reference(prompt)

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        raise RewardError(f"verifiers env {self.env_id!r} scores whole episodes (run by its harness), "
                          "not a completion on its own")


def options_of(section: EnvSection) -> dict[str, Any]:
    """env.options, with the id taken from env.name = "verifiers:<id>" when it is given there."""
    options = dict(section.options)
    if section.name.startswith(PREFIX):
        if options.get("id") not in (None, section.name[len(PREFIX):]):
            raise ConfigError(f"{KEY}.id = {options['id']!r} differs from env.name = {section.name!r}; set one of them")
        options["id"] = section.name[len(PREFIX):]
    return options


def load(env_id: str, args: dict[str, Any], harness: dict[str, Any] | None) -> Any:
    """vf.load_environment over the taskset `env_id` with `args`, refusing what Reel cannot run (docstring)."""
    check_version()
    import verifiers.v1 as vf

    # verifiers, its HTTP clients and its interception server log a line per episode and request at INFO:
    # thousands a minute in a role's log. Their warnings and errors still show.
    for name in ("verifiers", "httpx", "aiohttp.access"):
        logging.getLogger(name).setLevel(logging.WARNING)

    module = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{KEY}.id = {env_id!r}: no installed package provides module {module!r}; "
                          "pip install the environment's package (e.g. pip install -e examples/vf_reverse)")
    # The agent runs on this host (the subprocess runtime): a remote runtime would need a tunnel and an account.
    config: dict[str, Any] = {"taskset": {**args, "id": env_id}, "agent": {"runtime": {"type": "subprocess"}}}
    if harness is not None:
        config["agent"]["harness"] = dict(harness)
    try:
        env = vf.load_environment(vf.resolve_env_config(config))
    except Exception as exc:  # the package's taskset may raise anything for bad args
        raise ConfigError(f"{KEY}.id = {env_id!r}: loading the verifiers env with args {args} failed: "
                          f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    harness_id = next(iter(env.config.agent_harnesses().values())).id
    if harness_id in NEEDS_NETWORK and harness is None:
        raise ConfigError(f"{KEY}.id = {env_id!r}: its taskset ships no harness, and verifiers' default "
                          f"{harness_id!r} harness installs its program at start (needs network); set "
                          f"{KEY}.harness = {{id = \"...\"}} to a harness that runs in process")
    return env


def tasks_of(env_id: str, env: Any) -> list[Any]:
    try:
        tasks = list(env.taskset)
    except Exception as exc:  # a taskset's load() is the user's code
        raise ConfigError(f"{KEY}.id = {env_id!r}: its taskset's load() raised "
                          f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if not tasks:
        raise ConfigError(f"{KEY}.id = {env_id!r}: its taskset has no tasks; check {KEY}.args")
    return tasks


def first_messages(data: Any) -> list[dict[str, Any]]:
    """A task's opening messages (system prompt, then its prompt) as the harness sends them."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        return [*system, {"role": "user", "content": prompt}]
    return [*system, *({"role": m.role, "content": m.content} for m in prompt or [])]


def check_version() -> None:
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("env.name = \"verifiers\" needs the verifiers package; pip install 'reel-rl[tasks]'") from None
    if not version.startswith("0.4."):
        raise ConfigError(f"verifiers {version} is installed; Reel runs verifiers 0.4.x environments (verifiers.v1); "
                          "pip install 'reel-rl[tasks]' and port 0.3 environments (docs/tasks.md)")


def check(section: EnvSection) -> None:
    """Config-load check: option keys, the installed verifiers version, the env loads and has tasks."""
    options = options_of(section)
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]} is not an option of env verifiers; use {', '.join(sorted(OPTIONS))}")
    if not options.get("id"):
        raise ConfigError(f"{KEY}.id is not set; write env.name = \"verifiers:<id>\" with an installed "
                          "verifiers environment's id")
    env_id, args = str(options["id"]), dict(options.get("args") or {})
    tasks_of(env_id, load(env_id, args, options.get("harness")))
    if options.get("eval_args") is not None:
        tasks_of(env_id, load(env_id, {**args, **dict(options["eval_args"])}, options.get("harness")))
