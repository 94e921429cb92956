"""A resume finds what Redis lost of the log before it logs itself: its ConfigChanged goes on the
control stream, newer than any entry Redis lost there, and found afterwards would hide that loss."""

from __future__ import annotations

import uuid
from pathlib import Path

import redis

from reel.bus.events import ConfigChanged, decode, encode, stream_key
from reel.bus.run_log import RunLog
from reel.runtime.launch.bus_loss import LossWindow
from reel.runtime.launch.resume import record_resume
from runbuilder import make_config


def test_a_resume_reports_a_lost_control_entry_though_it_then_writes_that_stream(tmp_path: Path,
                                                                              redis_url: str) -> None:
    config = make_config({"run": {"name": f"loss-{uuid.uuid4().hex[:8]}"}})
    key = stream_key(config.run.name, "control")
    client = redis.Redis.from_url(redis_url)
    events = [ConfigChanged(run=config.run.name, producer="launcher:0", seq=seq, config_toml="", changed={},
                            after_step=seq) for seq in range(3)]
    ids = [client.xadd(key, {"e": encode(event)}).decode() for event in events]
    with RunLog(tmp_path) as log:  # the archiver logged all three ...
        log.stream("control").append_batch([(i, encode(e)) for i, e in zip(ids, events)])
    client.xdel(key, ids[-1])  # ... and Redis came back without the last

    lost_ms = int(ids[-1].split("-")[0])
    assert record_resume(tmp_path, redis_url, config, "", {}, 2) == LossWindow(1, ["control"], lost_ms, lost_ms)
    (_, fields), = client.xrevrange(key, count=1)
    resumed = decode(fields[b"e"])
    assert isinstance(resumed, ConfigChanged) and resumed.seq == 3  # the resume, after what the log holds
    # Nothing lost the next time: the bus now ends past the log.
    assert record_resume(tmp_path, redis_url, config, "", {}, 2) is None
    client.close()
