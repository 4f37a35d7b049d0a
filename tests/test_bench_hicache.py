"""CPU check of benchmarks/hicache.py's client against an in-process stand-in server (standard
library, well under a second): each turn streams `/generate` through `serving_client`, the reply is
the last chunk's ``output_ids``, the next turn's prompt is prompt + reply + new user ids, and the
summary counts ``cached_tokens`` per turn. The real servers: `scripts/gpu/hicache_l3_bench.sh` and
docs/hicache.md "Benchmark"."""
from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmark_loader import load_benchmark


class _Stand(BaseHTTPRequestHandler):
    """Streams `max_new_tokens` chunks with cumulative output ids; reports all but the last 8
    prompt ids as cached (a hit on every turn after the first, as a warm radix cache would)."""

    seen: list[list[int]] = []

    def log_message(self, *_):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        type(self).seen.append(ids)
        cached = max(0, len(ids) - 8) if len(type(self).seen) > 2 else 0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(1, n + 1):
            meta = {"completion_tokens": k, "cached_tokens": cached, "cached_tokens_details": {"device": cached}}
            chunk = {"meta_info": meta, "output_ids": [len(ids) % 50 + j for j in range(k)]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


def test_sessions_extend_the_prompt_by_the_reply_and_count_hits() -> None:
    hicache = load_benchmark("hicache.py")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stand)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = argparse.Namespace(seed=0, sessions=2, turns=3, first=10, reply=4, user=3, vocab=90,
                                  request_timeout=30)
        rows = hicache.run_sessions(f"http://127.0.0.1:{server.server_address[1]}", args)
    finally:
        server.shutdown()
    assert [(r["session"], r["turn"]) for r in rows] == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    seen = _Stand.seen
    for r, prev, nxt in zip(rows, seen, seen[2:]):       # turn t + 1 = turn t's prompt + reply + 3 user ids
        assert nxt[:len(prev)] == prev and nxt[len(prev):len(prev) + 4] == r["output_ids"] and len(nxt) == len(prev) + 7
    assert [r["prompt_tokens"] for r in rows] == [len(x) for x in seen] == [11, 11, 18, 18, 25, 25]
    assert all(r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"] for r in rows)
    s = hicache.summarize(rows)
    assert s["requests"] == 6 and s["by_turn"][1]["hit_rate"] == 0
    assert s["hit_rate_turns_2_plus"] == (10 + 10 + 17 + 17) / (18 + 18 + 25 + 25)
