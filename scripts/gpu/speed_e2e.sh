#!/usr/bin/env bash
# H200 (one GPU), one device call (issues 21 and 13 item 5, branch speed): the W8A8 FP8 linears wired
# into the CUDA backend and the float64-free CUDA path.
#   1. benchmarks/decode_step.py at Flash widths (one layer, random weights in the stored formats — the
#      plugin has no `--load-format dummy` server yet): decode N = 1/8/64/256 and 8K prefill, the step on
#      the serving backend (W8A8) and `torch_w8a16` (the old W8A16 path) timed in the same run, within
#      BENCH_BUDGET s (default 200; parts past it are listed as skipped in the JSON);
#   2. `pytest -m gpu` on the files this change touched (the W8A8/W8A16 backend under the numerics
#      contract, float64 watch of the CUDA forward, fp32 Engram gate and mHC kernels, CUDA graphs of
#      both FP8 arithmetics, forward batch invariance, fused elementwise, dense ops, MoE), with what is
#      left of BUDGET; at the cap pytest gets SIGINT, so it still reports and writes its junit file;
#   3. $OUT/speed_e2e.json: test counts + failures, per N the torch part W8A16 → W8A8 and the step
#      (eager / graph), prefill tokens/s, the printed contract measurements.
# Run from the checkout root with `.gpu` carried. Every step is capped; the script ends within BUDGET
# (s, default 440). Knobs: STEPS (default "bench tests"), BENCH_BUDGET (s, 200), BENCH_ARGS (extra
# decode_step.py arguments, e.g. "--quick"), TESTS (override the test file list).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-440}
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
: "${TESTS:=tests/test_runtime_triton_backend.py tests/test_kernels_engram_gate.py tests/test_runtime_cuda_graph_gpu.py
  tests/test_kernels_mhc.py tests/test_runtime_forward_gpu.py tests/test_kernels_fused_elementwise.py
  tests/test_runtime_dense_ops_gpu.py tests/test_runtime_moe_ops.py}"
for step in ${STEPS:-bench tests}; do
  case $step in
    bench) b=$(cap "${BENCH_BUDGET:-200}"); [ "$b" -lt 60 ] && { echo "bench: only $b s left, skipped"; continue; }
           timeout $((b + 30)) python3 benchmarks/decode_step.py --out "$OUT" --budget-s "$b" ${BENCH_ARGS:-} 2>&1 \
             | tee "$OUT/decode_step.log" | tail -12 ;;
    tests) t=$(( $(left) - 35 )); [ $t -lt 30 ] && { echo "tests: only $t s left, skipped"; continue; }
           timeout -s INT -k 20 $t python3 -m pytest -m gpu -q -s -p no:cacheprovider \
             --junitxml "$OUT/gpu_tests.xml" $TESTS 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  r=${PIPESTATUS[0]}
  if [ "$step" = tests ]; then TESTS_RC=$r; tests_result tests "$OUT/gpu_tests.xml" "$r"; else result "$step" rc="$r"; fi
done
timeout 30 python3 - "$OUT" "${TESTS_RC:-}" <<'PY'
import json, re, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1]); summary = {}
sys.path.insert(0, "scripts/gpu")
import junit_verdict                            # rc 0 + every collected test reported, none failed
summary["tests"] = junit_verdict.verdict(out / "gpu_tests.xml", sys.argv[2])
log = out / "gpu_tests.log"
if log.exists():
    summary["contract_lines"] = [l.strip() for l in log.read_text(errors="replace").splitlines()
                                 if re.search(r"vs reference, teacher-forced|float64 on the CUDA forward|engram_gate Flash|cuda-graph\]", l)]
try:
    d = json.loads((out / "decode_step.json").read_text())
    us = lambda part: (part or {}).get("median_us")
    rows = []
    for r in d.get("decode", []):
        w16, w8 = us(r.get("torch_w8a16")), us(r.get("torch"))
        rows.append(dict(N=r["tokens"], torch_w8a16_us=w16, torch_w8a8_us=w8,
                         speedup=(w16 / w8) if w16 and w8 else None, step_eager_us=r.get("layer_us_eager"),
                         step_graph_us=r.get("layer_us_graph"), attention_us=us(r.get("attention")),
                         indexer_us=us(r.get("indexer")), moe_routed_us=us(r.get("moe_routed"))))
    p = d.get("prefill") or {}
    summary["bench"] = dict(fp8_gemm=d.get("fp8_gemm"), decode=rows, errors=d.get("errors"), skipped=d.get("skipped"),
                            prefill_tokens_per_s=p.get("tokens_per_s"),
                            prefill_torch_w8a16_us=us(p.get("torch_w8a16")), prefill_torch_us=us(p.get("torch")))
except Exception as e:
    summary["bench"] = dict(error=f"no decode_step result: {e}")
(out / "speed_e2e.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
result "done"
