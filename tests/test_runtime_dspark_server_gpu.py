"""DSpark speculative decoding served on one CUDA GPU (issue 16; docs/dspark.md): the tiny
checkpoint with `--speculative-algorithm DSPARK` (bundled draft, γ = 5) gives the same greedy
tokens as the plain server for 64 new tokens at batch 1 and 8, reports its acceptance per request
(`spec_accept_length` / `spec_accept_rate`) and in SGLang's metrics (`sglang:spec_accept_length`).

Adaptive verification (SGLang's compact ragged verify, a synthetic SPS table that trims drafts):
greedy output still equals the plain server's.

Skipped without CUDA (conftest). `SGLANG_DSV41_DSPARK_TEST_EXTRA` adds server flags to both
servers (e.g. `--disable-cuda-graph`, the eager fallback). scripts/gpu/dspark.sh is the same check
as one self-contained device call (`adaptive` mode for the second test).
"""
from __future__ import annotations

import os
import re
import urllib.request

import pytest
import torch

from server_helpers import Server

pytestmark = pytest.mark.gpu
NEW_TOKENS = 64
EXTRA = os.environ.get("SGLANG_DSV41_DSPARK_TEST_EXTRA", "").split()
COMMON = ["--max-running-requests", "8", "--cuda-graph-max-bs", "8", "--enable-metrics", "--decode-log-interval", "1",
          *EXTRA]
SPEC = ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "5"]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(16)
    return [[0] + torch.randint(3, 990, (int(n),), generator=g).tolist() for n in torch.randint(12, 60, (8,), generator=g)]


def _serve(checkpoint, log, args, env: dict[str, str] | None = None) -> tuple[list[dict], list[dict], str]:
    """(batch-1 outputs, batch-8 outputs, /metrics text) of one server."""
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    srv = Server(checkpoint, log, args, env=env)
    try:
        srv.wait_ready()
        b1 = srv.post("/generate", {"input_ids": _prompts()[0], "sampling_params": sp})
        b8 = srv.post("/generate", {"input_ids": _prompts(), "sampling_params": sp})
        with urllib.request.urlopen(srv.url("/metrics"), timeout=30) as r:
            metrics = r.read().decode()
    finally:
        srv.stop()
    return [b1], b8, metrics


def test_dspark_greedy_equals_plain_greedy_and_reports_acceptance(tiny_checkpoint, tmp_path) -> None:
    plain = _serve(tiny_checkpoint, tmp_path / "plain.log", COMMON)
    spec = _serve(tiny_checkpoint, tmp_path / "dspark.log", COMMON + SPEC)
    for want, got in zip(plain[:2], spec[:2]):
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for o in got:
            meta = o["meta_info"]
            assert len(o["output_ids"]) == NEW_TOKENS
            assert 1.0 <= meta["spec_accept_length"] <= 6.0 and 0.0 <= meta["spec_accept_rate"] <= 1.0
            assert meta["spec_verify_ct"] < NEW_TOKENS
    lengths = [o["meta_info"]["spec_accept_length"] for o in spec[1]]
    print(f"DSpark tiny checkpoint, batch 8: accept length per request {[round(x, 2) for x in lengths]}")
    gauge = re.search(r"^sglang:spec_accept_length\{[^}]*\} ([0-9.eE+-]+)$", spec[2], re.M)
    assert gauge is not None and float(gauge.group(1)) >= 1.0, spec[2][-2000:]


def test_dspark_adaptive_verification_greedy_equals_plain_greedy(tiny_checkpoint, tmp_path) -> None:
    """Adaptive verification (`SGLANG_RAGGED_VERIFY_MODE=compact`) with a cost table where every
    verify token costs as much as the tokens before it (steps/s ∝ 1/tokens), so SGLang's planner
    trims low-confidence drafts and verify batches are ragged (in CUDA graphs unless EXTRA turns
    them off): greedy output still equals the plain server's; the log names the compact scheduler."""
    import json

    tokens = [1, 2, 4, 8, 16, 32, 48, 64]
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"sample_batch_tokens": tokens, "sample_steps_per_sec": [1000.0 / t for t in tokens],
                                 "max_batch_tokens": 64}))
    plain = _serve(tiny_checkpoint, tmp_path / "plain.log", COMMON)
    spec = _serve(tiny_checkpoint, tmp_path / "adaptive.log",
                  COMMON + SPEC + ["--speculative-dspark-sps-table-path", str(table)],
                  env={"SGLANG_RAGGED_VERIFY_MODE": "compact"})
    for want, got in zip(plain[:2], spec[:2]):
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    log = (tmp_path / "adaptive.log").read_text()
    assert "ragged-verify scheduler enabled (mode=compact" in log
    lengths = [o["meta_info"]["spec_accept_length"] for o in spec[1]]
    cap = re.search(r"^sglang:spec_cap_length\{[^}]*\} ([0-9.eE+-]+)$", spec[2], re.M)   # mean verify window
    assert cap is not None and 0.0 < float(cap.group(1)) <= 6.0, spec[2][-2000:]
    print(f"DSpark adaptive verification, batch 8: accept length per request {[round(x, 2) for x in lengths]}, "
          f"mean verify window {float(cap.group(1)):.2f} of 6")
