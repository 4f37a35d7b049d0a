"""$OUT/prefill8.json from the files scripts/gpu/prefill8.sh wrote (gpu_tests.xml, decode_step.json,
prefill_profile.json, mhc_mix.json): `speed5_summary`'s tests and per-variant rows, plus per variant the mHC and
routed-expert kernels by name (device µs, launches: from the profile's first pass) and the checks of a
pass (`checks`: name → true / false). A missing or malformed file is recorded as an error entry, never
raised. Printed too; exit status 0.

    python scripts/gpu/prefill8_summary.py OUT_DIR [TESTS_RC]    # TESTS_RC: pytest's exit status
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed5_summary as s5  # noqa: E402

#: after the GEMM1 attribution fix the routing plan proper (sort, scatters, tile schedule) is small
MAX_ROUTING_PLAN_MS = 0.5
#: `auto` (mhc_ops.mix_for_tokens) against the faster kernel at each swept T: no slower than this factor (timing noise)
AUTO_SLACK = 1.05
#: kernels.mhc.COEFFICIENT_BOUND (not imported: the summary runs without Triton)
COEFFICIENT_BOUND = 2.0 ** -14
#: labels whose kernels are listed by name
KERNEL_LABELS = ("mhc", "part:moe_routed")


def kernels(out: Path) -> dict:
    """{variant: {label: [(kernel, µs, launches)]}} for KERNEL_LABELS."""
    return s5.top_kernels(out, KERNEL_LABELS)


def mhc_checks(mix: dict | None) -> dict:
    """benchmarks/mhc_mix.py's sweep judged: `auto` within AUTO_SLACK of the faster kernel at every
    swept T, and the two kernels' coefficients within 2 × COEFFICIENT_BOUND of each other."""
    rows = (mix or {}).get("rows", []) if isinstance(mix, dict) else []
    return dict(
        mhc_auto_within_slack_of_best=bool(rows) and all(r.get("auto_over_best", 1e9) <= AUTO_SLACK for r in rows),
        mhc_dot_close_to_rows=bool(rows) and all(r.get("dot_vs_rows_max_abs", 1.0) <= 2 * COEFFICIENT_BOUND
                                                 for r in rows))


def checks(result: dict) -> dict:
    """The pass conditions (scripts/gpu/prefill8.sh header)."""
    out, rows = s5.base_checks(result)
    comp = {v: r.get("components_ms", {}) for v, r in rows.items()}
    out["routing_plan_small"] = comp.get("new", {}).get("moe_routing", 1e9) <= MAX_ROUTING_PLAN_MS
    out["mhc_dot_faster_than_rows"] = comp.get("new", {}).get("mhc", 1e9) < comp.get("new_mhc_rows", {}).get("mhc", 0)
    out.update(mhc_checks(result.get("mhc_mix")))
    for v in ("new_mhc_rows", "new_moe_block_m64", "new_moe_block_m64_s3"):
        att = (rows.get(v, {}).get("agreement") or {}).get("attention", {})
        out[f"{v}_same_attention"] = att.get("max_scale_ulps", 1e9) == 0.0 if att else False
    return out


def main(argv: list[str]) -> int:
    out, rc = Path(argv[0]), (argv[1] if len(argv) > 1 else None)
    result = s5.collect(out, (("tests", lambda o: s5.tests(o, rc)), ("prefill", s5.prefill), ("kernels", kernels),
                              ("mhc_mix", lambda o: json.loads((o / "mhc_mix.json").read_text()))))
    result["checks"] = checks(result)
    (out / "prefill8.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(dict(tests=result["tests"], checks=result["checks"]), indent=1))
    for r in (result.get("mhc_mix") or {}).get("rows", []):
        print("mhc " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    s5.print_variants(result, 22)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
