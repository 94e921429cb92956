"""verifiers: an environment of the `verifiers` package (classic API, 0.3.x), loaded from an installed package.

    [env]
    name = "verifiers"
    [env.options]
    id = "my-env"          # verifiers.load_environment(id, **args): imports module my_env, calls its load_environment
    split = "train"        # rows of env.get_dataset(); the eval role reads get_eval_dataset() when the env has one
    args = {num_examples = 100}   # keyword arguments of load_environment

Works with SingleTurnEnv, MultiTurnEnv and ToolEnv (and their subclasses that need no sandbox or
network). Reel samples every model turn itself; each turn's text (up to its stop token) becomes
an assistant message and the env's own machinery runs as in `env.rollout`: its stop conditions
(`@vf.stop`, max_turns), `env_response` for multi-turn and tool envs, whose messages come back as
`Continue` tokens (prompt tokens, masked from the loss), then `cleanup` and the rubric. Tool calls
are read from the turn's text in the Hermes format most chat templates use,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The rubric's weighted score is the
reward and its per-function scores go to the sample's `scores` (Trajectory) and the metrics.

Refused at config load, in one line: verifiers 0.4's `verifiers.v1` Tasksets (install the classic
0.3 series, the `tasks` extra), envs whose class needs a sandbox or a remote service
(SandboxEnv, PythonEnv, CliAgentEnv, MCPEnv, BrowserEnv, ...), rubrics with group-level reward
functions, and an env without a dataset.

verifiers is asyncio code; its coroutines run on one private event loop thread per env, and
`respond` waits for them (the rubric and env_response are quick next to a model turn).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import random
import re
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from reel.producers.envs.base import Continue, Env, Finish, Prompt, Reply
from reel.producers.envs.rewards import as_reward
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.tokenizer import Tokenizer

KEY = "env.options"
OPTIONS = {"id", "split", "args"}
SUPPORTED = ("SingleTurnEnv", "MultiTurnEnv", "ToolEnv", "StatefulToolEnv")
REFUSED = ("SandboxEnv", "PythonEnv", "CliAgentEnv", "HarborEnv", "MCPEnv", "BrowserEnv", "OpenEnvEnv", "EnvGroup")
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
T = TypeVar("T")


class Verifiers(Env):
    name = "verifiers"

    tokenizer: Tokenizer
    env_id: str
    split: str
    args: dict[str, Any]
    vf_env: Any  # a verifiers Environment
    rows: list[dict[str, Any]]
    max_turns: int
    _loop: asyncio.AbstractEventLoop  # runs verifiers' coroutines (its own thread)
    _states: dict[int, Any]  # id(turns) of an episode in progress -> its verifiers State

    def __init__(self, tokenizer: Tokenizer, *, id: str, split: str = "train", args: dict[str, Any] | None = None,
                 max_tokens: int = 16) -> None:
        self.tokenizer, self.env_id, self.split, self.args = tokenizer, id, split, dict(args or {})
        self.vf_env = load(id, self.args)
        self.rows = rows_of(self.vf_env, split)
        # verifiers' max_turns <= 0 means "until a stop condition": Reel needs a bound for its Continue check.
        vf_turns = getattr(self.vf_env, "max_turns", 1)
        self.max_turns = vf_turns if vf_turns > 0 else 10
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name=f"verifiers-{id}", daemon=True).start()
        self._states = {}

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> Verifiers:
        return cls(tokenizer, max_tokens=max_tokens, **section.options)

    def held_out(self) -> Verifiers:
        if self.split == "eval" or _dataset(self.vf_env, "eval") is None:
            return self
        return Verifiers(self.tokenizer, id=self.env_id, split="eval", args=self.args)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def sample(self, rng: random.Random) -> Prompt:
        index = rng.randrange(len(self.rows))
        row = self.rows[index]
        ids = self.tokenizer.prompt_ids(_messages_text(row["prompt"]))
        info = row.get("info") or {}
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=str(row.get("answer", "")),
                      meta={"env": self.name, "id": self.env_id, "index": index, "answer": str(row.get("answer", "")),
                            "info": json.loads(info) if isinstance(info, str) else dict(info)})

    def respond(self, prompt: Prompt, turns: list[list[int]]) -> Reply:
        key = id(turns)  # the episode's own list: one verifiers State per episode in progress
        if len(turns) == 1:
            self._states[key] = self._run(self._start(prompt))
        state = self._states[key]
        text, finished = self.completion_text(turns[-1])
        try:
            reply = self._run(self._step(state, text, finished, last_turn=len(turns) // 2 + 1 >= self.max_turns))
        except Exception:
            self._states.pop(key, None)
            raise
        if isinstance(reply, Finish):
            self._states.pop(key, None)
        return reply

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """A one-turn episode scored as it stands (a multi-turn env's rubric sees one model turn)."""
        state = self._run(self._start(prompt))
        text, finished = self.completion_text(completion_ids)
        return self._run(self._finish(state, text, finished)).reward

    async def _start(self, prompt: Prompt) -> Any:
        return await self.vf_env.init_state(dict(self.rows[prompt.meta["index"]]), _no_client(), "reel")

    async def _step(self, state: Any, text: str, finished: bool, *, last_turn: bool) -> Reply:
        """After one model turn: its assistant message, the env's stop conditions, then env_response or the rubric."""
        await self._add_turn(state, text, finished)
        if last_turn or await self.vf_env.is_completed(state):
            return await self._score(state)
        before = len(state["trajectory"][-1]["prompt"]) + len(state["trajectory"][-1]["completion"])
        state["next_prompt"] = await self.vf_env.get_prompt_messages(state)
        if await self.vf_env.is_completed(state):  # env_response set final_env_response
            return await self._score(state)
        added = state["next_prompt"][before:]
        tool_call = any(m.role == "tool" for m in added)
        text = "\n".join(_content(m) for m in added)
        return Continue(self.tokenizer.turn_ids("tool" if tool_call else added[0].role, text), tool_call=tool_call)

    async def _finish(self, state: Any, text: str, finished: bool) -> Finish:
        await self._add_turn(state, text, finished)
        return await self._score(state)

    async def _add_turn(self, state: Any, text: str, finished: bool) -> None:
        from verifiers.legacy.types import AssistantMessage, TrajectoryStep

        prompt = state.get("next_prompt") or state["prompt"]
        message = AssistantMessage(role="assistant", content=text, tool_calls=_tool_calls(text) or None)
        await self.vf_env.add_trajectory_step(state, TrajectoryStep(
            prompt=prompt, completion=[message], response=None, tokens=None, reward=None, advantage=None,
            is_truncated=not finished, trajectory_id=state["trajectory_id"], extras={}))

    async def _score(self, state: Any) -> Finish:
        await self.vf_env.cleanup(state)  # renders state["completion"] as env.rollout does
        await self.vf_env.rubric.score_rollout(state)
        what = f"verifiers env {self.env_id!r} rubric"
        scores = {name: as_reward(value, f"{what} function {name!r}") for name, value in (state["metrics"] or {}).items()}
        return Finish(as_reward(state["reward"], what), scores=scores)


@functools.cache
def _no_client() -> Any:
    """Stands where verifiers expects a model client (init_state checks its type): Reel samples the
    model turns itself, so nothing here is ever called."""
    from verifiers.legacy.clients.client import Client

    class NoClient(Client):
        def setup_client(self, config):
            return None

        async def close(self) -> None:
            return None

    for method in ("to_native_tool", "to_native_prompt", "get_native_response", "raise_from_native_response",
                   "from_native_response"):
        setattr(NoClient, method, _unreachable)
    NoClient.__abstractmethods__ = frozenset()
    return NoClient(None)


async def _unreachable(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Reel samples model turns itself; the verifiers client is never asked")


def load(env_id: str, args: dict[str, Any]) -> Any:
    """verifiers.load_environment(env_id, **args), refusing what Reel cannot run (module docstring)."""
    check_version()
    import importlib.util

    import verifiers as vf

    module = env_id.replace("-", "_").split("/")[-1]  # the module load_environment imports
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{KEY}.id = {env_id!r}: no installed package provides module {module!r}; "
                          "pip install the environment's package (e.g. pip install -e examples/vf_reverse)")
    import datasets

    datasets.disable_progress_bars()  # a bar per Dataset.map on every config load, on the user's terminal
    _keep_role_signal_handlers()
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as exc:  # the package's own load_environment may raise anything for bad args
        raise ConfigError(f"{KEY}.id = {env_id!r}: load_environment({args}) failed: "
                          f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    check_class(env_id, env)
    return env


def _keep_role_signal_handlers() -> None:
    """verifiers' Environment installs SIGINT/SIGTERM handlers when built (teardown, then exit), which
    fails off the main thread (the trainer's warm-start builds the env in one) and would replace a
    role's own graceful stop. Its module gets a `signal` whose `signal()` leaves handlers as they are;
    its atexit teardown stays."""
    import signal
    import types

    from verifiers.legacy.envs import environment

    environment.signal = types.SimpleNamespace(
        SIGINT=signal.SIGINT, SIGTERM=signal.SIGTERM, default_int_handler=signal.default_int_handler,
        signal=lambda signum, handler: signal.getsignal(signum))


def check_version() -> None:
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("env.name = \"verifiers\" needs the verifiers package; pip install 'reel-rl[tasks]'") from None
    if not version.startswith("0.3."):
        raise ConfigError(f"verifiers {version} is installed; Reel runs the classic API of verifiers 0.3.x "
                          "(verifiers.v1 Tasksets are not supported); pip install 'reel-rl[tasks]'")


def check_class(env_id: str, env: Any) -> None:
    classes = [c.__name__ for c in type(env).__mro__]
    refused = next((c for c in classes if c in REFUSED), None)
    if refused is not None or not any(c in SUPPORTED for c in classes):
        raise ConfigError(f"{KEY}.id = {env_id!r} is a {type(env).__name__}"
                          + (f" ({refused} needs a sandbox, a remote service or several envs)" if refused else "")
                          + f"; Reel runs {', '.join(SUPPORTED)} and their subclasses")
    group = [f.__name__ for f in env.rubric.funcs if env.rubric._is_group_func(f)]
    if group:
        raise ConfigError(f"{KEY}.id = {env_id!r}: its rubric has group-level reward functions ({', '.join(group)}); "
                          "Reel scores each sample on its own")


def rows_of(env: Any, split: str) -> list[dict[str, Any]]:
    if split not in ("train", "eval"):
        raise ConfigError(f"{KEY}.split = {split!r} must be \"train\" or \"eval\"")
    dataset = _dataset(env, split)
    if dataset is None or len(dataset) == 0:
        raise ConfigError(f"{KEY}.split = {split!r}: the env has no {split} dataset rows")
    return [dict(row) for row in dataset]


def _dataset(env: Any, split: str) -> Any:
    try:
        return env.get_dataset() if split == "train" else env.get_eval_dataset()
    except ValueError:  # verifiers raises ValueError when the split is not set
        return None


def _messages_text(prompt: Any) -> str:
    """A row's prompt (messages or text) as one user message: system content, blank line, last user content."""
    if isinstance(prompt, str):
        return prompt
    system = [_content(m) for m in prompt if _role(m) == "system"]
    user = [_content(m) for m in prompt if _role(m) == "user"]
    return "\n\n".join([*system[:1], *user[-1:]])


def _role(message: Any) -> str:
    return message["role"] if isinstance(message, dict) else message.role


def _content(message: Any) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else json.dumps(content)


def _tool_calls(text: str) -> list[Any]:
    from verifiers.legacy.types import ToolCall

    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:8]}", name=str(call["name"]),
                                  arguments=json.dumps(call.get("arguments", {}))))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # not a call: the turn stays a plain answer
    return calls


def check(section: EnvSection) -> None:
    """Config-load check: option keys, the installed verifiers version, the env loads and is supported."""
    unknown = sorted(set(section.options) - OPTIONS)
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]} is not an option of env verifiers; use {', '.join(sorted(OPTIONS))}")
    if not section.options.get("id"):
        raise ConfigError(f"{KEY}.id is not set; name an installed verifiers environment (its package's module)")
    rows_of(load(str(section.options["id"]), dict(section.options.get("args") or {})), section.options.get("split", "train"))

