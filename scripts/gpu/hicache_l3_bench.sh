#!/usr/bin/env bash
# H200 (one GPU), one device call: HiCache L3 + the multi-turn benchmark (docs/hicache.md, issue 14).
#   1. the L3 `file` server tests on the GPU (tests/test_runtime_hicache_storage_server.py: restart
#      reload from storage, reload after host eviction, both equal to the cold run; the servers pick
#      CUDA when torch sees it) and the L2 server tests with concurrent reloads
#      (tests/test_runtime_hicache_server.py);
#   2. benchmarks/hicache.py on the tiny checkpoint: 16 sessions x 6 turns, HiCache on vs off over a
#      1,024-token device pool, io kernel + --hicache-ratio 4 -> $OUT/hicache_h200.json/.png.
# Run from the checkout root with `.gpu` carried. Every step is capped; servers are killed by the tools.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
gpu_setup
CK=/tmp/tiny
tiny_checkpoint $CK || exit 4
fails=0
timeout -s INT -k 20 ${TEST_CAP:-330} python3 -m pytest -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
    tests/test_runtime_hicache_storage_server.py tests/test_runtime_hicache_server.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
tests_result hicache_server_tests "$OUT/tests.xml" "${PIPESTATUS[0]}" || fails=$((fails + 1))
timeout ${BENCH_CAP:-220} python3 benchmarks/hicache.py --model-path $CK --device cuda --device-tokens 1024 \
    --sessions 16 --turns 6 --first 128 --user 32 --reply 16 \
    --on-flags "--hicache-write-policy write_through --hicache-io-backend kernel --hicache-ratio 4" \
    --out "$OUT/hicache_h200.json" 2>&1 | tail -5 || fails=$((fails + 1))
result hicache_bench
exit $fails
