#!/usr/bin/env bash
# H200 (one GPU), one device call for branch runtime14 (every linear of the model computes through
# its quantisation method: `quant_methods.apply_linear` → `Fp8TileParallelMethod` /
# `Bf16ReplicatedMethod.apply` → the backend's FP8 tiers; `wo_a` one grouped launch):
#   1. decode: benchmarks/decode_step.py --quick --batches 1 8 64 (serving default `w8a8_f16`, no
#      prefill): the graphed layer step, to compare with session 11's 852 / 1,115 / 1,941 µs at
#      N = 1 / 8 / 64 (docs/validation.md; same benchmark, speed3.sh);
#   2. tests: `pytest -m gpu` of tests/test_runtime_triton_backend.py (contract for every FP8 mode, no
#      float64 on the CUDA forward), tests/test_runtime_forward_gpu.py and
#      tests/test_runtime_cuda_graph_gpu.py, one process per file, each capped by what is left.
# Run from the checkout root with `.gpu` carried. BUDGET caps the whole call (s, default 295); knobs:
# DECODE_CAP (95), TESTS (the test files). Logs, junit and decode_step.json go into $OUT/all.tgz; a
# short summary (RESULT lines + JSON) is printed.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=295}"
gpu_setup
W=$(mktemp -d)
rc=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
b=$(( ${DECODE_CAP:-95} < $(left) - 30 ? ${DECODE_CAP:-95} : $(left) - 30 ))
if [ "$b" -ge 40 ]; then
  SGLANG_DSV41_FP8_GEMM=w8a8_f16 timeout -k 10 $((b + 10)) python3 benchmarks/decode_step.py --out "$W" --quick \
    --batches 1 8 64 --no-prefill --budget-s "$b" >"$W/decode_step.log" 2>&1
  r=$?; [ $r = 0 ] || rc=1
  result decode_step rc=$r
  [ $r = 0 ] || tail -15 "$W/decode_step.log"
else
  echo "RESULT decode_step not run: only $b s left"; rc=1
fi
for f in ${TESTS:-tests/test_runtime_triton_backend.py tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py}; do
  l=$(left 12); [ "$l" -gt 20 ] || { echo "RESULT $f not run: budget spent"; rc=1; continue; }
  name=$(basename "$f" .py)
  timeout -s INT -k 10 $l python3 -m pytest -m gpu -q -s -p no:cacheprovider -rf --tb=short \
    --junitxml "$W/$name.xml" "$f" >"$W/$name.log" 2>&1
  r=$?; echo "$r" >"$W/$name.rc"
  tests_result "$f" "$W/$name.xml" "$r" || rc=1
  echo "  $(tail -1 "$W/$name.log" | cut -c1-160)"
  [ $r = 0 ] || grep -E "^(FAILED|ERROR|E )" "$W/$name.log" | head -12
done
timeout 20 python3 - "$W" <<'PY'
import json, re, sys
from pathlib import Path
sys.path.insert(0, "scripts/gpu")
import junit_verdict                            # rc 0 + every collected test reported, none failed
w = Path(sys.argv[1]); summary = {}
for r in sorted(w.glob("test_*.rc")):
    summary[r.stem] = junit_verdict.verdict(w / f"{r.stem}.xml", r.read_text().strip())
lines = [l.strip() for log in w.glob("test_*.log") for l in log.read_text(errors="replace").splitlines()
         if re.search(r"teacher-forced|float64 on the CUDA forward", l)]
summary["contract_lines"] = lines[:8]
session11 = {1: 852, 8: 1115, 64: 1941}
try:
    d = json.loads((w / "decode_step.json").read_text())
    summary["decode_fp8_gemm"], summary["decode_errors"] = d.get("fp8_gemm"), d.get("errors")
    summary["decode"] = [dict(N=r["tokens"], step_graph_us=r.get("layer_us_graph"), step_eager_us=r.get("layer_us_eager"),
                              session11_graph_us=session11.get(r["tokens"]),
                              ratio=round(r["layer_us_graph"] / session11[r["tokens"]], 3)
                              if r.get("layer_us_graph") and r["tokens"] in session11 else None)
                         for r in d.get("decode", [])]
except Exception as e:
    summary["decode"] = dict(error=f"no decode_step result: {e}")
(w / "runtime14.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
tar czf "$OUT/all.tgz" -C "$W" . && rm -rf "$W"
result "done" rc=$rc
exit $rc
