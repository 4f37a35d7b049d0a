#!/usr/bin/env bash
# H200 (one GPU), one device call (the card's image check; the benchmark is scripts/gpu/vision.sh):
# `sglang-dsv41 serve` on the tiny checkpoint, the card's two
# verification requests (text 17*19 and an image, as a PNG data URL) plus the image request again
# (prefix hit, same greedy tokens), then `pytest tests/test_vision_gpu.py`. Run from the checkout
# root with `.gpu` carried (as scripts/gpu/plain_launch_and_gpu_tests.sh). Every wait is capped;
# logs and responses in $OUT.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=560   # the whole call (not a knob)
gpu_setup
CK=/tmp/tiny; U=http://127.0.0.1:30000; J='Content-Type: application/json'
tiny_checkpoint $CK || exit 4
start_server "$OUT/vision_server.log" python3 -m sglang_dsv41.cli serve --device cuda --model-path $CK --port 30000
up=0; S0=$SECONDS
wait_up $U/health_generate 240 "$SERVER_PID" && up=1
echo "vision server up=$up after $((SECONDS - S0)) s"
python3 - >"$OUT/image_request.json" <<'PY'
import base64, io, json
import numpy as np
from PIL import Image
arr = np.random.default_rng(5).integers(0, 256, (90, 200, 3), dtype=np.uint8)
buf = io.BytesIO(); Image.fromarray(arr).save(buf, format="PNG")
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
print(json.dumps({"model": "x", "max_tokens": 32, "temperature": 0, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe this image."}]}]}))
PY
ok=0
if [ $up = 1 ]; then
  curl -sf -m 120 $U/v1/chat/completions -H "$J" -d '{"model":"x","messages":[{"role":"user","content":"What is 17*19? Return only the integer."}],"max_tokens":48}' >"$OUT/text.json" &&
  curl -sf -m 120 $U/v1/chat/completions -H "$J" -d @"$OUT/image_request.json" >"$OUT/image1.json" &&
  curl -sf -m 120 $U/v1/chat/completions -H "$J" -d @"$OUT/image_request.json" >"$OUT/image2.json" && ok=1
fi
stop_servers
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
try:
    t, a, b = (json.load(open(f"{o}/{n}.json")) for n in ("text", "image1", "image2"))
    print("text usage:", t["usage"], "image usage:", a["usage"], "repeat usage:", b["usage"])
    print("image answer equal on repeat:", a["choices"][0]["message"] == b["choices"][0]["message"])
except Exception as e:  # report, do not hide: the RESULT line says ok=0
    print("result parse failed:", e)
PY
grep -m1 "vision tower loaded" "$OUT/vision_server.log" || echo "vision tower log line: none"
[ $ok = 1 ] || tail -60 "$OUT/vision_server.log"
result vision_launch up=$up ok=$ok
timeout "$(left)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_vision_gpu.py 2>&1 | tee "$OUT/vision_gpu_tests.log" | tail -30
result vision_gpu_tests rc="${PIPESTATUS[0]}"
