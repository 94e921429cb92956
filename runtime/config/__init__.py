"""A run's config: one TOML schema decoded strictly (run.py), its checks across keys, its bounds.

    run.py         the schema (one Struct per section) and load/loads/to_toml/config_hash
    checks.py      cross-key checks at load; bounds.py: sizes, counts, memory; engine.py: [engine]
    keys.py        ConfigError and messages that start with the key
    overrides.py   `--set section.key=value`;  schema.py + help.py: `reel config schema`
    data_files.py  a local dataset's files and digest, recorded in RunStarted

Imports bus/ only (and model/config.py, torch-free, for model.path).
"""
