"""$OUT/flashmla.json from the files scripts/gpu/flashmla.sh wrote (gpu_tests.xml, decode_step.json,
prefill_profile.json): `speed5_summary`'s tests and per-variant rows, the attention kernels of each
variant by name (device µs, launches: from the profile's first pass), the flashmla GPU test's printed
comparison lines (gpu_tests.log), and the checks of a pass (`checks`: name → true / false). A missing
or malformed file is recorded as an error entry, never raised. Printed too; exit status 0.

    python scripts/gpu/flashmla_summary.py OUT_DIR [TESTS_RC]    # TESTS_RC: pytest's exit status
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed5_summary as s5  # noqa: E402

KERNEL_LABELS = ("part:attention",)


def kernels(out: Path) -> dict:
    """{variant: {label: [(kernel, µs, launches)]}} for KERNEL_LABELS."""
    return s5.top_kernels(out, KERNEL_LABELS)


def comparison(out: Path) -> list[str]:
    """The GPU test's `flashmla vs triton` lines."""
    return [line.strip() for line in (out / "gpu_tests.log").read_text().splitlines() if "flashmla vs triton" in line]


def checks(result: dict) -> dict:
    """The pass conditions (scripts/gpu/flashmla.sh header)."""
    out, rows = s5.base_checks(result)
    comp = {v: r.get("components_ms", {}) for v, r in rows.items()}
    out["flashmla_attention_faster"] = (comp.get("flashmla", {}).get("attention", 1e9)
                                        < comp.get("default", {}).get("attention", 0))
    idx = (rows.get("flashmla", {}).get("agreement") or {}).get("indexer", {})
    out["flashmla_same_selection"] = bool(idx.get("equal"))
    return out


def main(argv: list[str]) -> int:
    out, rc = Path(argv[0]), (argv[1] if len(argv) > 1 else None)
    result = s5.collect(out, (("tests", lambda o: s5.tests(o, rc)), ("prefill", s5.prefill), ("kernels", kernels),
                              ("comparison", comparison)))
    result["checks"] = checks(result)
    (out / "flashmla.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(dict(tests=result["tests"], checks=result["checks"], comparison=result["comparison"]), indent=1))
    s5.print_variants(result, 10, lambda r: f" | attention vs first {(r.get('agreement') or {}).get('attention')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
