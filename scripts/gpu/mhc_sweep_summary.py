"""$OUT/mhc_sweep.json from the files scripts/gpu/mhc_sweep.sh wrote (gpu_tests.xml, mhc_mix.json): the
test verdict (junit_verdict), the sweep's rows and fit, and the checks of a pass (`checks`: name → true /
false; prefill8_summary.mhc_checks). A missing or malformed file is recorded as an error entry, never
raised. Printed too; exit status 0.

    python scripts/gpu/mhc_sweep_summary.py OUT_DIR [TESTS_RC]    # TESTS_RC: pytest's exit status
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import junit_verdict  # noqa: E402
import prefill8_summary as p8  # noqa: E402


def summarize(out: Path, tests_rc: str | None) -> dict:
    result: dict = dict(tests=junit_verdict.verdict(out / "gpu_tests.xml", tests_rc))
    try:
        result["mhc_mix"] = json.loads((out / "mhc_mix.json").read_text())
        result["mhc_mix"].pop("method", None)
    except Exception as exc:
        result["mhc_mix"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    result["checks"] = dict(gpu_tests_pass=result["tests"].get("pass") is True, **p8.mhc_checks(result["mhc_mix"]))
    return result


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    result = summarize(out, argv[1] if len(argv) > 1 else None)
    (out / "mhc_sweep.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(dict(tests=result["tests"], fit=result["mhc_mix"].get("fit"), checks=result["checks"]), indent=1))
    for r in result["mhc_mix"].get("rows", []):
        print(f"T {r['tokens']:>5}: dot {r['coefficients_dot_us']:8.1f} µs  rows {r['coefficients_rows_us']:8.1f} µs  "
              f"auto={r.get('auto_kernel')} ×{r.get('auto_over_best', 0):.3f} of best  bit-equal {r.get('dot_rows_bit_equal')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
