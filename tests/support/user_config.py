"""A user's config loaded as `reel run` loads it: the schema's checks, then the envs' (env.name, env.options)."""

from reel.producers.envs.registry import check_config
from reel.runtime.config.run import loads
from reel.runtime.config.sections import Config


def load_as_reel_run(text: str, source: str = "config") -> Config:
    config = loads(text, source)
    check_config(config, source)
    return config
