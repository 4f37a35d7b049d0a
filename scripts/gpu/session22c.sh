#!/usr/bin/env bash
# H200 (one GPU), one device call (session 22; issue 21, prefill):
#   1. pytest -m gpu tests/test_kernels_mhc.py -k "tc or mix_kernels": the `tc` mHC partial dots (BF16
#      tensor cores, split-BF16x3 F) within the bound and batch invariant at Flash width;
#   1b. pytest -m gpu tests/test_runtime_triton_backend.py -k flashmla: the end-to-end contract with the
#      FlashMLA prefill and with the FlashMLA decode opt-in (tiny checkpoint, teacher forced);
#   2. benchmarks/mhc_mix.py: every partial-dot kernel (`tc` among them) by token count, 1 ... 8,192;
#   3. ONE process of benchmarks/decode_step.py --quick --no-decode --profile-prefill: one 8,192-token
#      prefill of Flash layer 2 by component for `default`, `flashmla` (the FlashMLA prefill opt-in, whose
#      speed was never measured), `mhc_tc` and `flashmla_mhc_tc` (benchmarks/prefill_profile.py VARIANTS).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session22c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=540}" "${PREFILL_VARIANTS:=default flashmla mhc_tc flashmla_mhc_tc}"
mkdir -p "$OUT/logs"
gpu_setup
timeout "$(cap 120)" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernels_mhc.py \
  -k "tc or mix_kernels" >"$OUT/logs/mhc_tests.log" 2>&1
result mhc_tests rc=$? "$(tail -1 "$OUT/logs/mhc_tests.log")"
timeout "$(cap 150)" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short -s \
  tests/test_runtime_triton_backend.py -k flashmla >"$OUT/logs/flashmla_contract.log" 2>&1
result flashmla_contract rc=$? "$(tail -1 "$OUT/logs/flashmla_contract.log")"
grep -E "top-1|FlashMLA" "$OUT/logs/flashmla_contract.log" | head -6
timeout "$(cap 90)" python3 benchmarks/mhc_mix.py --out "$OUT" >"$OUT/logs/mhc_mix.log" 2>&1
result mhc_mix rc=$?
tail -16 "$OUT/logs/mhc_mix.log"
b=$(( $(left) - 25 ))
if [ "$b" -gt 60 ]; then
  # shellcheck disable=SC2086
  timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
    --profile-prefill --prefill-variants $PREFILL_VARIANTS --budget-s "$b" >"$OUT/logs/decode_step.log" 2>&1
  result prefill rc=$?
  grep -v "^ " "$OUT/logs/decode_step.log" | grep -v -i warn | tail -24
else
  result prefill "skipped: $b s left"
fi
(cd "$OUT" && tar czf logs.tar.gz logs ./*.png 2>/dev/null; rm -rf logs ./*.png)
ls "$OUT"
