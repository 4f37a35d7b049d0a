#!/usr/bin/env bash
# H200 (one GPU), one device call, BUDGET 300 s: issue 17's image benchmark (benchmarks/vision.py).
# 1. The ViT alone, in process on cuda: the card's 32-layer ViT (Flash dims, random BF16-valued
#    weights) encodes 4 images at 1024x768 and 4 at the 1024-token cap: images/s, and the peak
#    activation of one cap image next to the planner's figure (deploy/vision_config.py); once with
#    the served backend (auto: SGLang's Triton vision attention, BF16 operands) and once with the fp32
#    torch path (sdpa), runtime/vision_attention.py.
# 2. `sglang-dsv41 serve --device cuda` on the tiny checkpoint (vision on): streamed chat TTFT for
#    text, 1 image, the same image again (prefix hit), and 1 / 4 / 16 images per request.
# Run from the checkout root with `.gpu` carried. Every wait is capped; the benchmark stops its
# server (also on SIGTERM from `timeout`). JSON + PNG + server log under $OUT: vision_vit_h200.{json,png}
# and vision_h200.{json,png} go to benchmarks/results/.
set -uo pipefail
: "${OUT:=/tmp/out}"; mkdir -p "$OUT"
T0=$SECONDS; BUDGET=300
source .gpu/bin/setup.sh || exit 3
export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
CK=/tmp/tiny
timeout 60 python3 -m sglang_dsv41.cli make-checkpoint --preset tiny --out $CK --quiet || exit 4
echo "checkpoint at $((SECONDS - T0)) s"
timeout -k 15 100 python3 benchmarks/vision.py --model-path $CK --device cuda --vit --vit-dims flash --vit-images 4 --vit-attention auto,sdpa \
    --no-server --sizes 1024x768 --out "$OUT/vision_vit_h200.json"
echo "RESULT vision_vit rc=$? at $((SECONDS - T0)) s"
left=$((BUDGET - 10 - (SECONDS - T0)))
timeout -k 15 $left python3 benchmarks/vision.py --model-path $CK --device cuda --sizes 448x448 \
    --images-per-request 1,4,16 --reps 3 --max-tokens 8 --startup-timeout 150 --request-timeout 30 \
    --server-flags "--max-total-tokens 8192" --log-dir "$OUT" --out "$OUT/vision_h200.json"
echo "RESULT vision_served rc=$? at $((SECONDS - T0)) s"
grep -m1 "vision tower loaded" "$OUT/vision_h200.log" || { echo "no 'vision tower loaded' line"; tail -40 "$OUT/vision_h200.log"; }
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("vision_vit_h200.json", "vision_h200.json"):
    f = out / name
    if not f.exists():
        print(f"SUMMARY {name}: missing"); continue
    r = json.loads(f.read_text())
    for backend, row in ((r.get("vit") or {}).get("by_backend") or {}).items():
        print("SUMMARY vit", backend, {k: round(v["images_per_s"], 2) for k, v in row["cases"].items()},
              "cap peak MiB", round((row.get("cap_peak_activation") or {}).get("measured_bytes", 0) / 2**20))
    for case, row in (r.get("cases") or {}).items():
        print("SUMMARY served", case, "TTFT median ms", round(row["ttft_ms_median"], 1), "prompt", row["prompt_tokens"])
PY
ls "$OUT"
