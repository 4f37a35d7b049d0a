"""CPU checks of benchmarks/serving_e2e.py's launch path against a stand-in server (standard library, a
few seconds): the client starts the command it is given with ``--port/--host`` appended, waits for
``/health_generate``, runs the closed-loop levels over streamed ``/generate`` (several tokens per chunk
count each), skips levels past ``--budget-s``, stops the process group, and `report` pairs labels.
The same client against a real plugin server: test_runtime_weights_server.py::test_dummy_load_format_serves.
"""
from __future__ import annotations

import json
import sys

import pytest

from benchmark_loader import load_benchmark

FAKE_SERVER = r'''
import argparse, json, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
ap = argparse.ArgumentParser(); ap.add_argument("--port", type=int); ap.add_argument("--host"); ap.add_argument("--tokens-per-chunk", type=int)
a = ap.parse_args()
class H(BaseHTTPRequestHandler):
    def log_message(self, *x): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        done = 0
        while done < n:
            time.sleep(0.002); done = min(n, done + a.tokens_per_chunk)
            self.wfile.write(b"data: " + json.dumps({"meta_info": {"completion_tokens": done}}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
print("dummy weights: stand-in", flush=True)
print("[x] Decode batch, #running-req: 4, #full token: 8, gen throughput (token/s): 100.0, #queue-req: 0", flush=True)
print("[x] Decode batch, #running-req: 4, #full token: 8, gen throughput (token/s): 300.0, #queue-req: 0", flush=True)
ThreadingHTTPServer((a.host, a.port), H).serve_forever()
'''


def test_launch_levels_budget_and_report(tmp_path) -> None:
    e2e = load_benchmark("serving_e2e.py")
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    common = ["--out-dir", str(tmp_path), "--input-len", "8", "--output-len", "9", "--rounds", "1", "--min-requests", "3",
              "--startup-s", "60"]
    for label, per_chunk in (("ours", 1), ("ours_dspark", 3)):
        assert e2e.main(["client", "--label", label, *common, "--concurrency", "1", "4", "--", sys.executable,
                         str(script), "--tokens-per-chunk", str(per_chunk)]) == 0
        rec = json.loads((tmp_path / f"{label}.json").read_text())
        assert [(lv["concurrency"], lv["requests"], lv["n_errors"]) for lv in rec["levels"]] == [(1, 3, 0), (4, 4, 0)]
        assert all(lv["output_tokens_per_s"] > 0 and lv["itl_s"]["p50"] > 0 for lv in rec["levels"])
        assert rec["dummy_log"] == ["dummy weights: stand-in"]
        assert [(w["concurrency"], w["requests"], w["n_errors"]) for w in rec["warmup"]] == [(1, 1, 0), (4, 4, 0)]
        assert [[lv["concurrency"] for lv in p] for p in rec["earlier_passes"]] == [[1, 4]]     # --passes 2
        assert rec["server_decode_tok_s"] == {"4": {"median": 200.0, "windows": 2}}   # C = 1 logged nothing
    assert e2e.main(["client", "--label", "late", *common, "--budget-s", "5", "--concurrency", "1", "--",
                     sys.executable, str(script), "--tokens-per-chunk", "1"]) == 0
    assert "skipped" in json.loads((tmp_path / "late.json").read_text())["levels"][0]
    for variant in ("ours_engram_host", "ours_c2k", "ours_overlap"):        # the variants of our server pair with "ours"
        (tmp_path / f"{variant}.json").write_text((tmp_path / "ours.json").read_text())
    assert e2e.main(["report", str(tmp_path), "--out", str(tmp_path / "e2e_report.json")]) == 0
    ratios = json.loads((tmp_path / "e2e_report.json").read_text())["ratios"]
    assert [r["concurrency"] for r in ratios["ours_dspark/ours"]["per_concurrency"]] == [1, 4]
    assert "ours/sglang_v4" not in ratios
    for variant in ("ours_engram_host", "ours_c2k", "ours_overlap"):
        assert [r["output_tokens_per_s"] for r in ratios[f"{variant}/ours"]["per_concurrency"]] == [1.0, 1.0]


def test_passes_below_one_is_refused(tmp_path) -> None:
    e2e = load_benchmark("serving_e2e.py")
    with pytest.raises(SystemExit) as exc:
        e2e.main(["client", "--label", "x", "--out-dir", str(tmp_path), "--passes", "0", "--url", "http://127.0.0.1:9"])
    assert exc.value.code == 2


def test_server_decode_rates_and_the_report_reading_server_logs(tmp_path) -> None:
    """The scheduler's decode lines by running requests (median per level); `report` reads `<label>_server.log`
    for a record written before the client kept the rates, and gives their ratio."""
    e2e = load_benchmark("serving_e2e.py")
    line = "[t] Decode batch, #running-req: {n}, #full token: 20480, cuda graph: True, gen throughput (token/s): {r}, x\n"
    ours = "".join(line.format(n=n, r=r) for n, r in ((16, 3900.0), (16, 3910.0), (16, 100.0), (64, 7000.0), (15, 1.0)))
    assert e2e.server_decode_rates(ours, [1, 16, 64]) == {"16": {"median": 3900.0, "windows": 3},
                                                          "64": {"median": 7000.0, "windows": 1}}
    level = {"requests": 2, "n_errors": 0, "output_tokens_per_s": 10.0, "ttft_s": {"p50": 0.1}, "itl_s": {"p50": 0.01}}
    for label, log in (("ours", ours), ("sglang_v4", line.format(n=16, r=5200.0) + line.format(n=64, r=11200.0))):
        (tmp_path / f"{label}.json").write_text(json.dumps({"concurrency": [16, 64], "levels": [
            {"concurrency": c, **level} for c in (16, 64)]}))
        (tmp_path / f"{label}_server.log").write_text(log)
    assert e2e.main(["report", str(tmp_path), "--out", str(tmp_path / "e2e_report.json")]) == 0
    rows = json.loads((tmp_path / "e2e_report.json").read_text())["ratios"]["ours/sglang_v4"]["per_concurrency"]
    assert [round(r["server_decode_tok_s"], 4) for r in rows] == [0.75, 0.625]
