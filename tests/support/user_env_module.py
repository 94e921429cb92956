"""Source of a user's environment module; the tests write it outside the package and load it by name."""

SOURCE = '''
"""A user's env: it answers the first max_turns - 1 model turns with a tool turn, then scores."""

from reel.producers.envs import Continue, Env, Finish, Prompt


class Echo(Env):
    name = "echo"

    def __init__(self, tokenizer, *, turns=3):
        self.tokenizer = tokenizer
        self.max_turns = turns

    def sample(self, rng):
        question = "".join(rng.choices("abc", k=3))
        ids = self.tokenizer.prompt_ids("say:" + question + "=")
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=question, meta={"env": self.name})

    def respond(self, prompt, turns):
        if len(turns) // 2 + 1 < self.max_turns:
            return Continue(self.tokenizer.turn_ids("tool", "=ok;"), tool_call=True)
        return Finish(self.reward(prompt, turns[-1]))

    def reward(self, prompt, completion_ids):
        text, finished = self.completion_text(completion_ids)
        return 1.0 if finished and text == prompt.answer else 0.5 * finished


def make(section, tokenizer, max_tokens):
    return Echo(tokenizer, **section.options)
'''


def install(directory, monkeypatch, name: str = "user_echo_env") -> str:
    """Write the module as `directory/<name>.py`, put `directory` on sys.path; returns env.name."""
    (directory / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(directory))
    return f"{name}:make"
