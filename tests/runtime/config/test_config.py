"""Config: every shipped example parses; broken configs give one line naming the key, exit 2,
and no run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from reel.runtime.config import run as config
from reel.runtime.launch.cli import main
from paths import REPO

EXAMPLES = sorted(REPO.joinpath("examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses(path: Path) -> None:
    c = config.load(path)
    assert config.loads(config.to_toml(c)) == c  # the resolved form round-trips


# Strings a hand-written TOML writer gets wrong: newlines, quotes, backslashes, tabs, non-ASCII.
AWKWARD = ["two\nlines", 'say "hi"', "C:\\weights\\", "tab\there", "üñí ✓", "'''\n\"\"\"", "\r\n\x7f"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_config_show_round_trips(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text in AWKWARD:
        source = config.load(path)
        source.init.from_dir = text
        written = tmp_path / "c.toml"
        written.write_text(config.to_toml(source))
        assert main(["config", "show", str(written)]) == 0
        assert config.loads(capsys.readouterr().out) == source, text


BROKEN = [
    ("[trainer]\nlr = \"fast\"\n", "trainer.lr"),
    ("[trainer]\nlearning_rate = 0.1\n", "trainer.learning_rate"),
    ("[rollout]\nasync_level = -1\n", "rollout.async_level"),
    ("[trainer]\nbatch_groups = 1000\n", "trainer.batch_groups"),
    ("[model]\nnum_experts = 4\nnum_experts_per_tok = 8\n", "model.num_experts_per_tok"),
    ("[env]\nname = \"chess\"\n", "env.name"),
    ("[bus]\nurl = \"http://x\"\n", "bus.url"),
    ("[run\nname = 1\n", "not valid TOML"),
    ("[log]\nlevel = \"LOUD\"\n", "log.level"),
    ("[mismatch]\nevery = -1\n", "mismatch.every"),
    ("[mismatch]\nmax_lag_steps = -2\n", "mismatch.max_lag_steps"),
    ("[mismatch]\nnice = 20\n", "mismatch.nice"),
]


@pytest.mark.parametrize("text,key", BROKEN, ids=[k for _, k in BROKEN])
def test_broken_config_names_key_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out_dir = tmp_path / "runs" / "bad"
    code = main(["run", str(path), "--out", str(out_dir), "--no-live"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert key in err and len(err.splitlines()) == 1, err
    assert not out_dir.exists() and not (tmp_path / "runs").exists()


def test_config_show_prints_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[trainer]\nlr = 0.01\n")
    assert main(["config", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.01" in out and "router_replay = true" in out and "[rollout]" in out


def test_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err


MISTAKES = [
    ("[trainer]\nlrr = 0.1\n", "unknown key trainer.lrr; did you mean trainer.lr?"),
    ("[rollout]\nlr = 0.1\n", "unknown key rollout.lr; did you mean trainer.lr?"),
    ("[trainr]\nlr = 0.1\n", "unknown key trainr; did you mean trainer?"),
    ("[trainer]\nxyzzy = 1\n", "unknown key trainer.xyzzy; remove it or check its spelling"),
    ("[trainer]\nprecision = \"bf17\"\n",
     "trainer.precision: invalid enum value 'bf17'; use one of 'fp32', 'bf16', 'fp8'"),
    ("[engine]\nkind = 3\n", "engine.kind: expected `str`, got `int`; use one of 'builtin', 'vllm'"),
    ("[log]\nlevel = \"info\"\n", "log.level: invalid enum value 'info'; use one of 'DEBUG', 'INFO', 'WARNING'"),
    ("[trainer]\nbatch_groups = 1000\n", "trainer.batch_groups = 1000 exceeds"),  # cross-key: the file is named too
]


@pytest.mark.parametrize("text,expected", MISTAKES, ids=[e.split(";")[0] for _, e in MISTAKES])
def test_mistakes_get_a_suggestion(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        config.load(path)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value)
