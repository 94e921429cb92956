"""Reel as an installed package: the files it ships resolve through importlib.resources, a missing
C source falls back to torch, `reel example list|copy` hands out the shipped configs (and the env
packages they name), and the tests' Redis is Debian's 7. The wheel itself, installed outside the
clone, is exercised by ops/test_wheel.sh (run from ops/test.sh)."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import pytest
import redis

from reel.bus.server import service_redis_server
from reel.producers import sampling
from reel.runtime import cbuild
from reel.runtime.config import run as config
from reel.runtime.weights import stream_copy
from reel.runtime.launch import examples
from reel.runtime.launch import slurm_script
from reel.runtime.launch.cli import main
from reel.runtime.model import native
from reel.runtime.package_files import examples_dir, ops_file

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_files_resolve_to_the_package_files():
    assert slurm_script.TEMPLATE == ops_file("slurm", "reel.sbatch") and "{{COMPONENTS}}" in slurm_script.TEMPLATE.read_text()
    assert "appendonly yes" in slurm_script.REDIS_CONF.read_text()
    assert sampling._SOURCE.read_bytes() == (ROOT / "producers" / "sampling.c").read_bytes()
    assert native._SOURCE.read_bytes() == (ROOT / "runtime" / "model" / "forward_cached.c").read_bytes()
    assert stream_copy._SOURCE.read_bytes() == (ROOT / "runtime" / "weights" / "stream_copy.c").read_bytes()
    assert set(examples.examples()) == {p.stem for p in (ROOT / "examples").glob("*.toml")}
    for path in examples.examples().values():
        config.loads(path.read_text())  # every shipped example parses


def test_a_missing_c_source_falls_back_to_torch(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="reel.runtime.cbuild"):
        assert cbuild.load(tmp_path / "gone.c") is None
    assert "gone.c did not build" in caplog.text and "torch version" in caplog.text


def test_a_c_source_that_does_not_compile_falls_back_to_torch(tmp_path: Path):
    (tmp_path / "broken.c").write_text("this is not C\n")
    assert cbuild.load(tmp_path / "broken.c") is None


def test_example_list_names_each_example_with_its_summary(capsys: pytest.CaptureFixture[str]):
    assert main(["example", "list"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert set(lines) == set(examples.examples())
    assert lines["reverse_text"].strip() == "Reverse a random letter string with a tiny MoE on a laptop CPU"


def test_example_copy_writes_the_config_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    target = tmp_path / "new" / "dir"
    assert main(["example", "copy", "reverse_text", str(target)]) == 0
    assert (target / "reverse_text.toml").read_bytes() == (examples_dir() / "reverse_text.toml").read_bytes()
    assert f"reel run {target / 'reverse_text.toml'}" in capsys.readouterr().out
    (target / "reverse_text.toml").write_text("# mine\n")
    assert main(["example", "copy", "reverse_text", str(target)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (target / "reverse_text.toml").read_text() == "# mine\n"


def test_example_copy_refuses_an_unknown_name_and_a_file_as_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["example", "copy", "nope", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no example named 'nope'" in err and "reverse_text" in err
    (tmp_path / "f").write_text("")
    assert main(["example", "copy", "reverse_text", str(tmp_path / "f")]) == 1
    assert "is a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def _examples_with_env_packages(root: Path) -> Path:
    """An examples folder: a plugin env package, an installable one named by an option, an unrelated one."""
    for package in ("my_env", "rubric_env", "unrelated"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "rubric_env" / "pyproject.toml").write_text("[project]\nname = \"rubric-env\"\n")
    (root / "my_env" / "__pycache__").mkdir()
    (root / "plugin.toml").write_text('# A plugin env.\n[env]\nname = "my_env.tasks:make"\n'
                                      '[env.options]\nid = "rubric-env"\nsize = 3\n')
    (root / "plain.toml").write_text('# A built-in env.\n[env]\nname = "reverse_text"\n')
    return root


def test_env_packages_are_the_folders_the_env_section_names(tmp_path: Path):
    root = _examples_with_env_packages(tmp_path / "examples")
    assert [p.name for p in examples.env_packages(root / "plugin.toml")] == ["my_env", "rubric_env"]
    assert examples.env_packages(root / "plain.toml") == []


def test_example_copy_brings_the_env_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]):
    root = _examples_with_env_packages(tmp_path / "examples")
    monkeypatch.setattr(examples, "examples_dir", lambda: root)
    out = tmp_path / "out"
    assert main(["example", "copy", "plugin", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["my_env", "plugin.toml", "rubric_env"]
    assert not (out / "my_env" / "__pycache__").exists()
    said = capsys.readouterr().out
    assert f"pip install {out / 'rubric_env'}" in said and f"put {out} on PYTHONPATH" in said


def test_the_tests_and_the_slurm_job_run_debians_redis_7(redis_url: str):
    version = redis.Redis.from_url(redis_url).info("server")["redis_version"]
    assert version.split(".")[0] == "7", (f"the test session's Redis is {version} ({service_redis_server()}), not "
                                          "Debian bookworm's 7.0: install it with `bash ops/install_test.sh`")
    script = slurm_script.render(config.load(str(ROOT / "examples" / "reverse_text.toml")), Path("/shared/r"),
                          slurm_script.JobOptions())
    assert f"export REDIS_SERVER={service_redis_server()}\n" in script
    assert f"export REDIS_CONF={ops_file('redis', 'redis.conf')}\n" in script


def test_torch_as_the_roles_import_it_is_byte_compiled():
    """ops/byte_compile.sh ran (the installs end with it): with PYTHONDONTWRITEBYTECODE set, a module
    without an up-to-date .pyc is compiled from source again in every process that imports it, ~1.3
    CPU s of torch's in each. Reel's own modules are left out: an edit makes them stale until the next
    `ops/test.sh`, and they cost a tenth of that."""
    for name in ("torch.nn.functional", "reel.consumers.trainer", "reel.producers.rollout"):
        importlib.import_module(name)

    def stale(name: str) -> bool:
        spec = getattr(sys.modules[name], "__spec__", None)  # None for torch.ops and other made-up modules
        if spec is None or not spec.cached or not (spec.origin or "").endswith(".py"):
            return False
        cached = Path(spec.cached)
        return not cached.exists() or cached.stat().st_mtime < Path(spec.origin).stat().st_mtime

    wanted = [n for n in list(sys.modules) if n.split(".")[0] == "torch"]
    missing = [n for n in wanted if stale(n)]
    assert len(wanted) > 500 and not missing, (f"{len(missing)} of {len(wanted)} modules have no up-to-date .pyc "
                                               f"(e.g. {missing[:3]}): run `bash ops/byte_compile.sh`")
