"""Dead letters: what a reader or a producer refused, kept with why, beside the lane it was meant for.

The dead-letter stream of a lane is slot_key(<the lane's key>, DEAD): one per slot, so writing it and
acking the refused entry fit in one MULTI on a cluster. Every entry has the same fields:

    stream    the lane the entry was read from (or the event was meant for)
    entry_id  its id there; "" for an event a producer refused before it reached the stream
    raw       the encoded event (or the bytes that did not decode)
    reason    one sentence: why it was refused
    group     the consumer group that refused it; "" for a plain reader (nothing to ack) or a producer
    consumer  who refused it

Every writer (Publisher, GroupConsumer, the archiver, a Tail's reader) queues its entry here, on its
own pipeline, so a consumer group's XACK goes in the same transaction.
"""

from __future__ import annotations

import logging
from typing import Any

from reel.bus.partitions import slot_key

__all__ = ["DEAD", "dead_letter_key", "queue_dead_letter"]

log = logging.getLogger("reel.bus")

DEAD = "dead"  # dead-letter stream name, one per slot


def dead_letter_key(key: str) -> str:
    """The dead-letter stream beside the stream at `key`."""
    return slot_key(key, DEAD)


def queue_dead_letter(pipe: Any, key: str, *, run: str, stream: str, entry_id: str, raw: bytes, reason: str,
                      group: str, consumer: str) -> None:
    """Queue on `pipe` (a pipeline or a client) the XADD of one dead letter beside `key`, and log it."""
    pipe.xadd(dead_letter_key(key), {"stream": stream, "entry_id": entry_id, "raw": raw, "reason": reason,
                                     "group": group, "consumer": consumer})
    what = f"{stream} {entry_id}" if entry_id else f"{stream} event from {consumer}"
    log.warning("dead letter: %s of run %s: %s", what, run, reason)
