"""Deployment: hardware configs (`configs/*.yaml`), `sglang-dsv41 launch`, `plan`, `doctor`.

Modules: `schema` (the config and its illegal combinations), `hardware` (GPU catalog),
`memory` + `kv` (the planner's arithmetic, from the checkpoint inventory), `plan` (report and
CLI), `capabilities` (what the plugin provides to the launcher), `command` (config → SGLang
0.5.17 command lines, checked against the runtime's declaration `runtime/requirements.py`),
`launch` (CLI, exec), `doctor` (environment checks), `registration` (does the plugin really
register through SGLang's loader), `cookbook` (scripts generated from the configs). See
docs/deploy.md.
"""
