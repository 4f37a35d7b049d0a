#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch speed6): the GPU tests of the session-12 default flip
# (split-KV decode attention + fused top-k on CUDA; one key split under --enable-deterministic-inference):
#   tests/test_runtime_forward_gpu.py — identical-input attention in both modes, selections, deterministic
#     batch invariance bit for bit, the serving default within the contract, 64-step greedy == reference;
#   tests/test_runtime_cuda_graph_gpu.py — both modes captured: replay == eager bit for bit, live rows ==
#     unpadded eager (deterministic: bits; serving: contract + greedy);
#   tests/test_runtime_triton_backend.py — the teacher-forced contract of the serving default (`w8a8_f16`,
#     now with split-KV attention and the fused top-k) and of `w8a16`, no float64 on the CUDA forward
#     (the opt-in `tiered` / `fp8_mma` / prefill opt-in cases are left out: K_EXPR).
# One pytest process (the tiny checkpoint and the compiled kernels shared), capped to the BUDGET (s,
# default 150). Log: $OUT/speed6.log (+ junit $OUT/speed6.xml). A pass: "RESULT rc=0" and no FAILED line.
# Run from the checkout root with `.gpu` carried.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=150}" "${K_EXPR:=not tiered and not fp8_mma and not prefill_opt_ins}"
gpu_setup
unset SGLANG_DSV41_ATTN_SPLITS SGLANG_DSV41_INDEXER_TOPK SGLANG_DSV41_INDEXER_HEAD_SUM SGLANG_DSV41_FP8_GEMM
timeout -s INT -k 5 "$(left 5)" python3 -m pytest -m gpu -q -s -p no:cacheprovider -rf --tb=short --durations=12 \
  --junitxml "$OUT/speed6.xml" -k "$K_EXPR" \
  tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py tests/test_runtime_triton_backend.py \
  >"$OUT/speed6.log" 2>&1
rc=$?
tests_result speed6_tests "$OUT/speed6.xml" "$rc" || { [ "$rc" != 0 ] || rc=1; }
grep -oE "(serving default|kernel attend|kernel path on|prompt [0-9]+ tokens|\[cuda-graph\]|CUDA w8|float64 on).*" "$OUT/speed6.log" | head -30
grep -E "^(FAILED|ERROR)" "$OUT/speed6.log" | head -20
tail -18 "$OUT/speed6.log"
result rc=$rc
exit $rc
