"""The documentation: the mkdocs site builds with --strict, the generated references cover every
config key and command, the README stays short, and every shell block in docs/ either runs here
or is marked `<!-- illustrative -->` on the line before its fence."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from reel.runtime.config.sections import Config
from reel.runtime.config.help import HELP
from reel.runtime.config.schema import field_comments, keys
from reel.runtime.launch.cli_commands import build_parser
from reel.runtime.launch.cli_reference import commands
from reel.runtime.launch.module_map import entries as module_entries

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"bash", "sh", "shell", "console"}
ILLUSTRATIVE = "<!-- illustrative -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w-]*)")


def shell_blocks(page: Path) -> list[tuple[int, str, bool]]:
    """(line, commands, illustrative) of each fenced shell block of a Markdown page."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i].strip())
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(opening.group(1))), len(lines))
        if opening.group(2) in SHELL:
            illustrative = i > 0 and lines[i - 1].strip() == ILLUSTRATIVE
            blocks.append((i + 1, "\n".join(lines[i + 1:end]), illustrative))
        i = end + 1
    return blocks


def _pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def test_the_block_finder_sees_marks_and_languages(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(f"x\n{ILLUSTRATIVE}\n```bash\nreel run a.toml\n```\n\n```toml\n[run]\n```\n"
                    "```console\nreel --help\n```\n")
    assert shell_blocks(page) == [(3, "reel run a.toml", True), (10, "reel --help", False)]


_RUN = [(page, line, text) for page in _pages() for line, text, illustrative in shell_blocks(page) if not illustrative]


@pytest.mark.parametrize("page,line,text", _RUN, ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in _RUN])
def test_every_command_block_in_the_docs_runs(page: Path, line: int, text: str) -> None:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert result.returncode == 0, (f"{page.relative_to(ROOT)}:{line} exited {result.returncode} (mark it "
                                    f"{ILLUSTRATIVE} if no test can run it):\n{result.stderr[-2000:]}")


def test_some_blocks_run_so_the_check_is_live() -> None:
    assert _RUN, "no command block in docs/ is run; the check above would pass on anything"


def test_every_config_key_has_a_type_a_default_and_help() -> None:
    docs = keys()
    assert len(docs) == len({d.key for d in docs}) > 50
    missing = [d.key for d in docs if not (d.type and d.default and d.help)]
    assert not missing, f"config keys without help: {missing}; add a comment on the field in runtime/config/run.py"
    known = {d.key for d in docs}
    assert set(HELP) <= known, f"runtime/config/help.py names keys the schema lacks: {set(HELP) - known}"
    commented = {f"{s.encode_name}.{f.encode_name}" for s in msgspec.structs.fields(Config)
                 for name in field_comments(s.type) for f in msgspec.structs.fields(s.type) if f.name == name}
    assert not set(HELP) & commented, (f"{sorted(set(HELP) & commented)} have a comment on their field now; "
                                       "remove them from runtime/config/help.py")


def test_the_schema_reads_types_defaults_and_comments_from_the_source() -> None:
    by_key = {d.key: d for d in keys()}
    assert by_key["trainer.objective"].type == '"tis" | "icepop" | "mis" | "none"'
    assert by_key["init.from"].default == '""'  # the TOML name, not the Python one
    assert by_key["metrics.sinks"].type == 'list["wandb" | "tensorboard" | "mlflow"]'
    assert by_key["metrics.sinks"].default == "[]"
    assert by_key["run.steps"].help == "trainer steps; the run ends after the last commit"  # trailing comment
    assert by_key["init.warmup_steps"].help.startswith("Supervised steps on the task before RL")  # comment above
    out = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "config", "schema", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and {d["key"] for d in json.loads(out.stdout)} == set(by_key)


@pytest.mark.slow
def test_mkdocs_builds_strict_with_the_generated_references(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    config_page = (site / "reference" / "config" / "index.html").read_text()
    assert all(f"<code>{d.key}</code>" in config_page for d in keys())
    commands_page = (site / "reference" / "commands" / "index.html").read_text()
    progs = [p.prog for p in commands(build_parser())]
    assert "reel metrics tensorboard" in progs and "reel report" in progs and "reel config schema" in progs
    assert all(f">{prog}<" in commands_page for prog in progs)
    modules_page = (site / "reference" / "modules" / "index.html").read_text()
    assert all(f"<code>{folder}</code>" in modules_page for folder, _, _ in module_entries())


def test_the_module_map_names_every_module_with_its_docstring() -> None:
    """Every package says what lives there, every module what it is: the map has no empty row."""
    found = {folder + module: line for folder, _, modules in module_entries() for module, line in modules}
    on_disk = {str(p.relative_to(ROOT)) for top in ("bus", "producers", "consumers", "runtime", "replay")
               for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py"}
    assert set(found) == on_disk
    assert [f for f, line in found.items() if not line] == []
    assert [folder for folder, summary, _ in module_entries() if not summary] == []


def test_the_readme_is_short_and_links_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"
