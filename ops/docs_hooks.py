"""mkdocs hook: the generated reference pages, written at build time so they cannot drift.

reference/config.md comes from the config schema (`reel config schema`), reference/commands.md
from `reel`'s argparse parser (runtime/launch/cli_reference.py) and reference/modules.md from the
tree's docstrings (runtime/launch/module_map.py).
"""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from reel.runtime.config.schema import markdown as config_reference
    from reel.runtime.launch.cli_reference import markdown as command_reference
    from reel.runtime.launch.module_map import markdown as module_map

    for src_uri, content in (("reference/config.md", config_reference()), ("reference/commands.md", command_reference()),
                              ("reference/modules.md", module_map())):
        files.append(File.generated(config, src_uri, content=content))
    return files
