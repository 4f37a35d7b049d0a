"""$OUT/speed5.json from the files scripts/gpu/speed5.sh wrote (gpu_tests.xml, decode_step.json,
prefill_profile.json): test counts and failures, per prefill variant its tokens/s, wall per part,
device ms per component, FP8 linears (GEMM / operand passes) and agreement with the first variant,
and the checks of a pass (`checks`: name → true / false). A missing or malformed file is recorded
as an error entry, never raised. Printed too; exit status 0.

    python scripts/gpu/speed5_summary.py OUT_DIR [TESTS_RC]    # TESTS_RC: pytest's exit status
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import junit_verdict  # noqa: E402

#: attention on the BF16 workspace against the packed rows: the kernels' stated agreement (BF16 ulps
#: of the output scale, tests/test_kernels_sparse_attention.py)
MAX_ATTENTION_SCALE_ULPS = 2.0
#: fp32 head sum: selections may differ near BF16 ties only
MIN_FP32_SELECTION_OVERLAP = 0.99


def _ms(us):
    return round(us / 1e3, 3) if isinstance(us, (int, float)) else us


def tests(out: Path, rc: int | str | None = None) -> dict:
    """junit_verdict's verdict of gpu_tests.xml with pytest's exit status `rc` (None: unknown, never a pass)."""
    return junit_verdict.verdict(out / "gpu_tests.xml", rc)


def prefill(out: Path) -> dict:
    d = json.loads((out / "prefill_profile.json").read_text())
    rows = []
    for r in d.get("rows", []):
        if "by_component" not in r:
            rows.append({k: (str(v)[:300] if k == "error" else v) for k, v in r.items()})
            continue
        rows.append(dict(
            variant=r["variant"], tokens_per_s=round(r["tokens_per_s"] or 0), wall_ms=_ms(r["wall_us_total"]),
            wall_ms_by_part={p: _ms(v) for p, v in r["wall_us"].items()},
            device_ms=_ms(r["device_us"]), gaps_ms=_ms(r["gaps_us"]),
            components_ms={c: _ms(v) for c, v in sorted(r["by_component"].items(), key=lambda kv: -kv[1])},
            linears_ms={k: {p: _ms(v) for p, v in parts.items()} for k, parts in r.get("by_linear", {}).items()},
            top_kernels=[dict(k, us=round(k["us"])) for k in r.get("top_kernels", [])[:12]],
            agreement=r.get("agreement"), agreement_with=r.get("agreement_with")))
    sweep = {name: (dict(us=round(v["us"]), agreement_with_plan=v.get("agreement_with_plan"),
                         config={k: v["config"][k] for k in ("block_h", "block_n", "num_warps", "num_stages")})
                    if isinstance(v, dict) and "us" in v else v)
             for name, v in (d.get("attention_sweep") or {}).items()}
    return dict(tokens=d.get("tokens"), layer=d.get("layer"), engram=d.get("engram"), rows=rows,
                attention_sweep=sweep)


def base_checks(result: dict) -> tuple[dict[str, bool], dict[str, dict]]:
    """The checks every prefill run shares (GPU tests pass, every variant profiled) and the
    profile's rows by variant."""
    out: dict[str, bool] = {}
    t = result.get("tests", {})
    out["gpu_tests_pass"] = t.get("pass") is True
    rows = {r.get("variant"): r for r in result.get("prefill", {}).get("rows", [])}
    out["every_variant_profiled"] = bool(rows) and all("components_ms" in r for r in rows.values())
    return out, rows


def checks(result: dict) -> dict:
    """The pass conditions (scripts/gpu/speed5.sh header)."""
    out, rows = base_checks(result)
    att = (rows.get("attn_bf16_workspace", {}).get("agreement") or {}).get("attention", {})
    out["workspace_attention_within_bound"] = att.get("max_scale_ulps", 1e9) <= MAX_ATTENTION_SCALE_ULPS
    topk = (rows.get("indexer_fused_topk", {}).get("agreement") or {}).get("indexer", {})
    out["fused_topk_same_selection"] = bool(topk.get("equal"))
    fp32 = (rows.get("indexer_fp32_head_sum", {}).get("agreement") or {}).get("indexer", {})
    out["fp32_head_sum_overlap"] = fp32.get("selection_overlap", 0.0) >= MIN_FP32_SELECTION_OVERLAP
    return out


def collect(out: Path, parts) -> dict:
    """Each (name, reader) of `parts` applied to `out`, plus the decode_step.json record; a reader's
    exception is recorded as that part's `error`, never raised (the summary must always be written)."""
    result: dict = {}
    for name, fn in parts:
        try:
            result[name] = fn(out)
        except Exception as exc:
            result[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    try:
        d = json.loads((out / "decode_step.json").read_text())
        result["decode_step"] = dict(errors=d.get("errors"), skipped=d.get("skipped"), wall_s=d.get("wall_s"))
    except Exception as exc:
        result["decode_step"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    return result


def top_kernels(out: Path, labels) -> dict:
    """{variant: {label: [(kernel, µs, launches)]}} from prefill_profile.json's top kernels."""
    d = json.loads((out / "prefill_profile.json").read_text())
    return {r["variant"]: {lab: [(k["kernel"][:90], round(k["us"]), k["count"]) for k in r.get("top_kernels", [])
                                 if k["label"] == lab] for lab in labels}
            for r in d.get("rows", []) if "top_kernels" in r}


def print_variants(result: dict, width: int, extra=lambda r: "") -> None:
    """One line per profiled prefill variant (top nine components, `extra(row)` appended), then the named
    kernels of `result["kernels"]` under it."""
    for r in result.get("prefill", {}).get("rows", []):
        if "components_ms" not in r:
            print(f"{r.get('variant')}: {r}")
            continue
        top = ", ".join(f"{c} {ms}" for c, ms in list(r["components_ms"].items())[:9])
        print(f"{r['variant']:>{width}}: {r['tokens_per_s']:>9,} tok/s  wall {r['wall_ms']} ms | device "
              f"{r['device_ms']} ms: {top} | gaps {r['gaps_ms']}{extra(r)}")
        for lab, ks in (result.get("kernels") or {}).get(r["variant"], {}).items():
            print(f"{'':>{width + 2}}{lab}: " + "; ".join(f"{n} {us} µs ×{c}" for n, us, c in ks))


def main(argv: list[str]) -> int:
    out, rc = Path(argv[0]), (argv[1] if len(argv) > 1 else None)
    result = collect(out, (("tests", lambda o: tests(o, rc)), ("prefill", prefill)))
    result["checks"] = checks(result)
    (out / "speed5.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(dict(tests=result["tests"], checks=result["checks"]), indent=1))
    for r in result.get("prefill", {}).get("rows", []):
        if "components_ms" in r:
            top = ", ".join(f"{c} {ms}" for c, ms in list(r["components_ms"].items())[:8])
            print(f"{r['variant']:>22}: {r['tokens_per_s']:>9,} tok/s  wall {r['wall_ms']} ms "
                  f"{r['wall_ms_by_part']} | device {r['device_ms']} ms: {top} | agreement {r['agreement']}")
        else:
            print(f"{r.get('variant')}: {r}")
    print(f"attention sweep (BF16 workspace): {result.get('prefill', {}).get('attention_sweep')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
