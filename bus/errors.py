"""The root of Reel's exception tree.

    ReelError                 an error a user can cause or fix; str() is one sentence naming what
     ├── MalformedEvent       bytes that are not a valid event        (bus/events.py)
     ├── ConfigError          a config key to fix                     (runtime/config/run.py)
     └── ...                  one subclass per external boundary (Redis, log, blob store)

`reel` prints str(error) on one line and exits non-zero; anything else is a bug and keeps its
traceback.
"""


def printable(text: str) -> str:
    """`text` with control characters escaped (\\x1b...), so a crafted path or entry cannot drive the
    terminal it is printed on."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class ReelError(Exception):
    """An error the user can fix; the message names the thing to fix."""
