"""Messages never echo a secret or drive the terminal (issue 26, item 7)."""

from __future__ import annotations

from pathlib import Path

from reel.runtime.launch.cli import main


def test_an_unsupported_bus_url_is_not_echoed_with_its_password(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[run]\nname = "m"\n[bus]\nurl = "http://reel:hunter2-secret@10.0.0.5:6379/0"\n')
    assert main(["config", "show", str(config)]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "must start with redis://" in err and "'http'://" in err


def test_control_characters_in_an_error_are_escaped(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run\x1b]0;pwned\x07\x1b[2J"
    run.mkdir()
    assert main(["log", "verify", "--run", str(run)]) != 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b]0;pwned\\x07" in err
    assert err.count("\n") == 1
