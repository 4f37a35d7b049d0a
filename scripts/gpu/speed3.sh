#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch speed3): the dense FP8 linears' candidate default
# (`w8a8_f16` = kernels/fp8_w8a8.py at every row count with exact-product f16 MMAs, the decode tier split
# over ≈ 8 programs per SM; opt-in until this run) against session 7's paths (`tiered`, the serving
# default), and the end-to-end contract with it.
#   1. tests: `pytest -m gpu` of tests/test_kernels_fp8_w8a8.py (every tier at the 9 Flash shapes within
#      the bound, grouped wo_a, split-K == one program) and of tests/test_runtime_triton_backend.py (no
#      float64 on the CUDA forward; teacher-forced contract on the tiny checkpoint for every mode:
#      `tiered`, `w8a16`, `w8a8_f16` (the candidate) and `fp8_mma`; the measured top-1 / |Δlogit| lines are printed);
#   2. fp8: benchmarks/fp8_w8a8.py at M = 1/8/64/256: `w8a8` (the new row tiers) against `fp8_linear`
#      (session 7's decode default, W8A16 kernel), `w8a8_s7_decode` / `w8a8_s7_mid_fp8` (session 7's
#      W8A8 tiers), cuBLAS BF16 and the decode levers of benchmarks/fp8_w8a8.py SPEED3_VARIANTS;
#   3. decode: benchmarks/decode_step.py --quick N = 1/8/64 (0.5 s caps, no prefill): the layer step on `w8a8_f16`
#      (SGLANG_DSV41_FP8_GEMM), against `torch_w8a16` (session 7's decode arithmetic) on the same weights in the same run;
#   4. $OUT/speed3.json: test counts + failures, the contract lines, per M the pass µs and share of
#      copy bandwidth, per N the torch part old → new and the graphed step.
# Run from the checkout root with `.gpu` carried. Every step is capped; the script ends within BUDGET
# (s, default 300). Knobs: STEPS (default "tests fp8 decode"), TEST_CAP (110), FP8_CAP (85), FP8_ARGS
# (extra fp8_w8a8.py arguments), DECODE_ARGS (extra decode_step.py arguments).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-300}
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
VARIANTS=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import fp8_w8a8 as b; print(' '.join(b.SPEED3_VARIANTS))")
for step in ${STEPS:-tests fp8 decode}; do
  case $step in
    tests) t=$(cap "${TEST_CAP:-110}")
           timeout -s INT -k 15 "$t" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" \
             tests/test_kernels_fp8_w8a8.py tests/test_runtime_triton_backend.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -20 ;;
    fp8) timeout "$(cap "${FP8_CAP:-85}")" python3 benchmarks/fp8_w8a8.py --out "$OUT" --rows 1 8 64 256 \
           --variants $VARIANTS --per-weight-rows 1 --cap-s 0.05 ${FP8_ARGS:-} 2>&1 | tee "$OUT/fp8_w8a8.log" | tail -8 ;;
    decode) b=$(( $(left) - 25 )); [ "$b" -lt 40 ] && { echo "decode: only $b s left, skipped"; continue; }
           SGLANG_DSV41_FP8_GEMM=w8a8_f16 timeout $((b + 20)) python3 benchmarks/decode_step.py --out "$OUT" --quick --batches 1 8 64 \
             --budget-s "$b" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode_step.log" | tail -8 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  r=${PIPESTATUS[0]}
  if [ "$step" = tests ]; then TESTS_RC=$r; tests_result tests "$OUT/gpu_tests.xml" "$r"; else result "$step" rc="$r"; fi
done
timeout 20 python3 - "$OUT" "${TESTS_RC:-}" <<'PY'
import json, re, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1]); summary = {}
sys.path.insert(0, "scripts/gpu")
import junit_verdict                            # rc 0 + every collected test reported, none failed
summary["tests"] = junit_verdict.verdict(out / "gpu_tests.xml", sys.argv[2])
log = out / "gpu_tests.log"
if log.exists():
    summary["contract_lines"] = [l.strip() for l in log.read_text(errors="replace").splitlines()
                                 if re.search(r"vs reference, teacher-forced|float64 on the CUDA forward", l)]
try:
    d = json.loads((out / "fp8_w8a8.json").read_text())
    summary["fp8_pass_us"] = {p["rows"]: {k: [round(v.get("graph_us", v["eager_us"]), 1), round(100 * v["fraction_of_copy"], 1)]
                                          for k, v in p.items() if isinstance(v, dict)} for p in d["rows"]}
    summary["fp8_per_weight_m1"] = {k: {l: round(t.get("graph_us", t["eager_us"]), 1) for l, t in v.items()}
                                    for k, v in (d.get("per_weight") or [{}])[0].items() if isinstance(v, dict)}
    summary["fp8_errors"], summary["fp8_accuracy_over_bound"] = d.get("errors"), d.get("accuracy_over_bound")
except Exception as e:
    summary["fp8"] = dict(error=f"no fp8_w8a8 result: {e}")
try:
    d = json.loads((out / "decode_step.json").read_text())
    us = lambda part: (part or {}).get("median_us")
    summary["decode"] = [dict(N=r["tokens"], torch_new_us=us(r.get("torch")), torch_w8a16_us=us(r.get("torch_w8a16")),
                              step_graph_us=r.get("layer_us_graph"), step_eager_us=r.get("layer_us_eager"),
                              attention_us=us(r.get("attention")), indexer_us=us(r.get("indexer")),
                              moe_routed_us=us(r.get("moe_routed"))) for r in d.get("decode", [])]
    summary["decode_fp8_gemm"], summary["decode_errors"] = d.get("fp8_gemm"), d.get("errors")
except Exception as e:
    summary["decode"] = dict(error=f"no decode_step result: {e}")
(out / "speed3.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
result "done"
