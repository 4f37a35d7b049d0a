#!/usr/bin/env bash
# H200 (one GPU), one device call, BUDGET 300 s: issue 17's image benchmark (benchmarks/vision.py).
# 1. The ViT alone, in process on cuda, the card's 32-layer ViT (Flash dims, random BF16-valued
#    weights), backends triton (served: SGLang's Triton vision attention) and sdpa (fp32 torch
#    path): images/s of 3 images at 1024x768 and 3 at the 1024-token cap, packed into varlen calls
#    as the server runs them (and one image per call where that differs); peak allocated bytes of
#    one cap image and of one packed call, each next to the planner's figure for that backend
#    (deploy/vision_config.vit_activation_bytes).
# 2. `sglang-dsv41 serve --device cuda` on the tiny checkpoint (vision on): streamed chat TTFT for
#    text, 1 image, the same image again (prefix hit), and 1 / 4 / 16 images per request.
# 3. fa3 in processes of its own (faulthandler, CUDA_LAUNCH_BLOCKING=1), so a failure leaves its
#    full traceback in $OUT/vit_fa3.log: first `import sgl_kernel.flash_ops` (session 12: the `.gpu`
#    layer leaves it out, "Can not import FA3 in sgl_kernel"; then nothing else runs), and where it
#    imports, a kernel probe (SGLang's VisionFlash3Attention against per-image SDPA, one and three
#    images), the same ViT benchmark as 1, and, budget permitting, the fa3 tower test.
# Run from the checkout root with `.gpu` carried. Every wait is capped; the benchmark stops its
# server (also on SIGTERM from `timeout`). JSON + PNG + logs under $OUT, all of it in $OUT/all.tgz;
# `SUMMARY` lines at the end.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}"
gpu_setup
CK=/tmp/tiny
tiny_checkpoint $CK 60 || exit 4
echo "checkpoint at $((SECONDS - T0)) s"
VIT=(--model-path $CK --device cuda --vit --vit-dims flash --vit-images 3 --no-server --sizes 1024x768)

timeout -k 10 80 python3 benchmarks/vision.py "${VIT[@]}" --vit-attention triton,sdpa \
    --out "$OUT/vision_vit_h200.json" >"$OUT/vit.log" 2>&1
result "vit triton,sdpa" rc=$?; grep "^vit " "$OUT/vit.log"

l=$(left 38); [ "$l" -gt 170 ] && l=170   # 8 s kept for the summary and the archive
timeout -k 15 $l python3 benchmarks/vision.py --model-path $CK --device cuda --sizes 448x448 \
    --images-per-request 1,4,16 --reps 3 --max-tokens 8 --startup-timeout 100 --request-timeout 30 \
    --server-flags "--max-total-tokens 8192" --log-dir "$OUT" --out "$OUT/vision_h200.json" >"$OUT/served.log" 2>&1
result vision_served rc=$?
grep -m1 "vision tower loaded" "$OUT/vision_h200.log" || { echo "no 'vision tower loaded' line"; tail -30 "$OUT/vision_h200.log"; }

export CUDA_LAUNCH_BLOCKING=1
{ echo "== fa3: import sgl_kernel.flash_ops"
  timeout -k 5 40 python3 -X faulthandler -c "from sgl_kernel import flash_ops; print('flash_ops imported')"
  echo "import rc=$?"; } >"$OUT/vit_fa3.log" 2>&1
if grep -q "^import rc=0" "$OUT/vit_fa3.log"; then
{ echo "== fa3 kernel probe"; timeout -k 5 30 python3 -X faulthandler - <<'PY'
import torch, torch.nn.functional as F
from sglang.srt.layers.attention.vision import VisionFlash3Attention
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
core = VisionFlash3Attention(use_data_parallel=True)
for cu in ([0, 9216], [0, 300, 4370, 5000]):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(cu[-1], 16, 64, generator=g, device="cuda").bfloat16() for _ in range(3))
    cut = torch.tensor(cu, dtype=torch.int32, device="cuda")
    n = max(b - a for a, b in zip(cu, cu[1:]))
    out = core.forward(q, k, v, cu_seqlens=cut, bsz=len(cu) - 1, seq_len=n, softmax_scale=64 ** -0.5, max_seqlen=n)
    print("cu", cu, "returned", type(out).__name__, getattr(out, "shape", None), getattr(out, "dtype", None))
    ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].float().transpose(0, 1) for t in (q, k, v)))
                     .transpose(0, 1) for a, b in zip(cu, cu[1:])])
    print("cu", cu, "max |fa3 - sdpa fp32|", (out.float() - ref).abs().max().item())
PY
  echo "probe rc=$?"; } >>"$OUT/vit_fa3.log" 2>&1
l=$(left 13); [ "$l" -gt 45 ] && l=45
if [ $l -gt 20 ]; then
  echo "== fa3 ViT benchmark" >>"$OUT/vit_fa3.log"
  timeout -k 5 $l python3 -X faulthandler benchmarks/vision.py "${VIT[@]}" --vit-images 2 --vit-attention fa3 \
      --out "$OUT/vision_vit_fa3_h200.json" >>"$OUT/vit_fa3.log" 2>&1
  echo "benchmark rc=$?" >>"$OUT/vit_fa3.log"
fi
l=$(left 13)
if [ "$l" -gt 30 ]; then
  echo "== fa3 tower tests" >>"$OUT/vit_fa3.log"
  timeout -k 5 $l python3 -X faulthandler -m pytest -m gpu -q -p no:cacheprovider --tb=long \
      tests/test_vision_gpu.py -k "fa3" >>"$OUT/vit_fa3.log" 2>&1
  echo "pytest rc=$?" >>"$OUT/vit_fa3.log"
fi
fi
result fa3; grep -E "rc=|max \||Error|error|imported" "$OUT/vit_fa3.log" | head -20

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("vision_vit_h200.json", "vision_vit_fa3_h200.json", "vision_h200.json"):
    f = out / name
    if not f.exists():
        print(f"SUMMARY {name}: missing"); continue
    r = json.loads(f.read_text())
    for backend, row in ((r.get("vit") or {}).get("by_backend") or {}).items():
        for case, c in row["cases"].items():
            one = c.get("images_per_s_one_per_call")
            print(f"SUMMARY vit {backend} {case}: {c['images_per_s']:.2f} images/s packed ({c['vit_calls']} calls)"
                  + (f", {one:.2f} one per call" if one else ""))
        for label, p in (row.get("peak_activation") or {}).items():
            print(f"SUMMARY peak {backend} {label} ({p['patches']} patches): measured {p['measured_bytes'] / 2**20:.0f} MiB, "
                  f"planned {p['planned_bytes'] / 2**20:.0f} MiB (x{p['planned_over_measured']:.3f}); "
                  f"plan's per-call figure {p['plan_bytes'] / 2**20:.0f} MiB")
    for case, row in (r.get("cases") or {}).items():
        print("SUMMARY served", case, "TTFT median ms", round(row["ttft_ms_median"], 1), "prompt", row["prompt_tokens"])
PY
tar -czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
ls "$OUT"; echo "done at $((SECONDS - T0)) s"
