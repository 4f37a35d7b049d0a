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
    """{variant: {label: [(kernel, µs, launches)]}} from prefill_profile.json's top kernels."""
    d = json.loads((out / "prefill_profile.json").read_text())
    return {r["variant"]: {lab: [(k["kernel"][:90], round(k["us"]), k["count"]) for k in r.get("top_kernels", [])
                                 if k["label"] == lab] for lab in KERNEL_LABELS}
            for r in d.get("rows", []) if "top_kernels" in r}


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
    for r in result.get("prefill", {}).get("rows", []):
        if "components_ms" in r:
            top = ", ".join(f"{c} {ms}" for c, ms in list(r["components_ms"].items())[:9])
            att = (r.get("agreement") or {}).get("attention")
            print(f"{r['variant']:>10}: {r['tokens_per_s']:>9,} tok/s  wall {r['wall_ms']} ms | device "
                  f"{r['device_ms']} ms: {top} | gaps {r['gaps_ms']} | attention vs first {att}")
            for lab, ks in (result.get("kernels") or {}).get(r["variant"], {}).items():
                print(f"{'':>12}{lab}: " + "; ".join(f"{n} {us} µs ×{c}" for n, us, c in ks))
        else:
            print(f"{r.get('variant')}: {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
