#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 34): what the wide prefill attention's split P costs —
# benchmarks/attention_prefill.py at the 8K Flash shape with `--alt-wide` = kernels/sparse_attention_prefill.py
# with P·V on the BF16 high part only (FlashMLA's rounding of P; made here with sed, not a candidate default:
# timing only, its max difference from the BF16 kernel in output-scale ulps is in the JSON).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34d.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=200}"
gpu_setup
alt=/tmp/sparse_attention_prefill_p_hi.py
sed -e 's/_dot(tl.trans(k_a), p_lo, _dot(tl.trans(k_a), p_hi, acc_a \* alpha\[None, :\], DOT_FP32), DOT_FP32)/_dot(tl.trans(k_a), p_hi, acc_a * alpha[None, :], DOT_FP32)/' \
    -e 's/_dot(tl.trans(k_b), p_lo, _dot(tl.trans(k_b), p_hi, acc_b \* alpha\[None, :\], DOT_FP32), DOT_FP32)/_dot(tl.trans(k_b), p_hi, acc_b * alpha[None, :], DOT_FP32)/' \
    kernels/sparse_attention_prefill.py >"$alt"
[ "$(diff kernels/sparse_attention_prefill.py "$alt" | grep -c '^>')" = 2 ] || { echo "sed did not make the variant"; exit 4; }
timeout -k 5 "$(cap 150)" python3 benchmarks/attention_prefill.py --alt-wide "$alt" --out "$OUT"
result attention_prefill rc=$?
