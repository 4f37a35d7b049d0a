"""$OUT/speed4.json from the files scripts/gpu/speed4.sh wrote (gpu_tests.xml, decode_step.json,
decode_step_variants.json, decode_step_profile_graph.json); a missing or malformed file is recorded
as an error entry, never raised. Printed too.

    python scripts/gpu/speed4_summary.py OUT_DIR [TESTS_RC]    # TESTS_RC: pytest's exit status
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import junit_verdict  # noqa: E402


def _r(v, nd=1):
    return round(v, nd) if isinstance(v, (int, float)) else v


def tests(out: Path, rc: int | str | None = None) -> dict:
    """junit_verdict's verdict of gpu_tests.xml with pytest's exit status `rc` (None: unknown, never a pass)."""
    return junit_verdict.verdict(out / "gpu_tests.xml", rc)


def decode(out: Path) -> dict:
    d = json.loads((out / "decode_step.json").read_text())
    us = lambda part: _r((part or {}).get("median_us"))    # noqa: E731
    rows = [dict(N=r["tokens"], step_graph_us=_r(r.get("layer_us_graph")), torch_us=us(r.get("torch")),
                 indexer_us=us(r.get("indexer")), attention_us=us(r.get("attention")),
                 moe_routed_us=us(r.get("moe_routed"))) for r in d.get("decode", [])]
    return dict(fp8_gemm=d.get("fp8_gemm"), copy_gbs=_r(d.get("copy_bandwidth_gbs"), 0), rows=rows,
                errors=d.get("errors"), skipped=d.get("skipped"))


def variants(out: Path) -> dict:
    d = json.loads((out / "decode_step_variants.json").read_text())
    table = {}
    for N, row in d.get("rows", {}).items():
        table[N] = {comp: {name: ({k: _r(v, 3) for k, v in res.items()} if "error" not in res
                                  else dict(error=res["error"][:300]))
                           for name, res in vs.items()}
                    for comp, vs in row.items() if isinstance(vs, dict)}
    return table


def profile(out: Path) -> list[dict]:
    d = json.loads((out / "decode_step_profile_graph.json").read_text())
    rows = []
    for r in d.get("rows", []):
        row = dict(fp8_gemm=r.get("fp8_gemm"), N=r.get("tokens"))
        for key in ("error", "skipped"):
            if key in r:
                row[key] = str(r[key])[:300]
        if "by_component" in r:
            row |= dict(span_us=_r(r["span_us"]), wall_us=_r(r.get("graph_wall_us")), gaps_us=_r(r["gaps_us"]),
                        matched=_r(r.get("matched_fraction"), 3), kernels=r.get("kernels_per_replay", [None])[0],
                        components={k: _r(v) for k, v in r["by_component"].items()},
                        linears={k: _r(v) for k, v in r.get("by_linear", {}).items()})
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    out, rc = Path(argv[0]), (argv[1] if len(argv) > 1 else None)
    summary = {}
    for key, fn in (("tests", lambda o: tests(o, rc)), ("decode", decode), ("variants", variants), ("profile", profile)):
        try:
            summary[key] = fn(out)
        except Exception as exc:
            summary[key] = dict(error=f"{type(exc).__name__}: {exc}")
    (out / "speed4.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
