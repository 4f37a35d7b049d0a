"""The cookbook's launch scripts, generated from `configs/*.yaml` so they cannot drift.

Each script is a thin wrapper: `exec sglang-dsv41 launch --config ../configs/<name>.yaml "$@"`
(PD configs get one script per role: prefill, decode, router). `expected_scripts()` is the
single definition; `python -m sglang_dsv41.deploy.cookbook [--check]` rewrites (or checks)
`cookbook/`, and the tests fail when a script differs from it or a config has none.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from .schema import DeploymentConfig, load_config

REPO = Path(__file__).resolve().parents[2]
PD_ROLES = ("prefill", "decode", "router")


def script_text(dc: DeploymentConfig, role: str | None) -> str:
    title = f"{dc.name} ({role})" if role else dc.name
    desc = textwrap.wrap(" ".join(dc.description.split()), 94)
    role_arg = f" --role {role}" if role else ""
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# {title}",
        *(f"# {line}" for line in desc),
        f"# Generated from configs/{dc.name}.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,",
        "# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,",
        "# --set KEY=VALUE, -- extra SGLang flags).",
        "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f'exec sglang-dsv41 launch --config "$here/../configs/{dc.name}.yaml"{role_arg} "$@"',
        "",
    ])


def expected_scripts(configs_dir: Path = REPO / "configs") -> dict[str, str]:
    """cookbook file name → content, for every config."""
    out: dict[str, str] = {}
    for path in sorted(configs_dir.glob("*.yaml")):
        dc = load_config(path)
        if path.stem != dc.name:
            raise ValueError(f"{path}: file name must be the config name {dc.name!r}.yaml")
        if dc.pd is None:
            out[f"{dc.name}.sh"] = script_text(dc, None)
        else:
            for role in PD_ROLES:
                out[f"{dc.name}-{role}.sh"] = script_text(dc, role)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write or check cookbook/*.sh from configs/*.yaml")
    ap.add_argument("--check", action="store_true", help="report drift instead of writing")
    a = ap.parse_args(argv)
    book = REPO / "cookbook"
    want = expected_scripts()
    have = {p.name for p in book.glob("*.sh")}
    drift = sorted(n for n, text in want.items() if not (book / n).is_file() or (book / n).read_text() != text)
    extra = sorted(have - want.keys())
    if a.check:
        for n in drift:
            print(f"drift: cookbook/{n}")
        for n in extra:
            print(f"orphan: cookbook/{n} (no config)")
        return 1 if drift or extra else 0
    for n in drift:
        (book / n).write_text(want[n])
        (book / n).chmod(0o755)
        print(f"wrote cookbook/{n}")
    for n in extra:
        print(f"orphan (not removed): cookbook/{n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
