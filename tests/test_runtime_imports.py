"""Layering of the package, by a static import scan (no module is imported):

* no `sglang_dsv41/runtime/*.py` imports `sglang_dsv41.reference` (the oracle stays apart from
  the serving path: issue 13, docs/runtime.md "Layering");
* the reference keeps no backend switches (no contextvars) and imports nothing of the runtime;
* the kernels import no model types (`config`, `reference`, `runtime`), only torch / triton and
  each other (`packed_rows`).
The scan itself is shown to catch a violation.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sglang_dsv41"


def imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved against `package`,
    the dotted package the file lives in), including imports inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _offenders(folder: Path, package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in sorted(folder.glob("*.py")):
        hits = sorted(n for n in imported_modules(path, package) if n.startswith(forbidden))
        if hits:
            bad[path.name] = hits
    return bad


def test_runtime_imports_nothing_from_the_reference() -> None:
    assert _offenders(ROOT / PACKAGE / "runtime", f"{PACKAGE}.runtime", (f"{PACKAGE}.reference",)) == {}


def test_reference_has_no_backends_and_no_runtime() -> None:
    folder = ROOT / PACKAGE / "reference"
    assert _offenders(folder, f"{PACKAGE}.reference", (f"{PACKAGE}.runtime", f"{PACKAGE}.kernels", "contextvars")) == {}


def test_kernels_import_no_model_types() -> None:
    forbidden = (f"{PACKAGE}.config", f"{PACKAGE}.reference", f"{PACKAGE}.runtime", f"{PACKAGE}.checkpoint")
    bad = _offenders(ROOT / "kernels", f"{PACKAGE}.kernels", forbidden)
    # the MXFP4 weight re-layout decodes checkpoint codecs at load (weights, not model types)
    assert set(bad) <= {"moe_mxfp4_weights.py"} and all(
        all(n.startswith(f"{PACKAGE}.checkpoint.codecs") for n in hits) for hits in bad.values()), bad


def test_the_scan_catches_a_violation(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("def f():\n    from ..reference.ops import bf16\n")
    (tmp_path / "good.py").write_text("from ..numerics.rounding import bf16\nimport torch\n")
    assert _offenders(tmp_path, f"{PACKAGE}.runtime", (f"{PACKAGE}.reference",)) == {
        "bad.py": [f"{PACKAGE}.reference.ops", f"{PACKAGE}.reference.ops.bf16"]}
