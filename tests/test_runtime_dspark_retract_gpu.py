"""Preemption with DSpark on (issue 16, Deliver 2; docs/dspark.md): SGLang retracts decoding
requests of a DSPARK server (`ScheduleBatch.retract_decode`: row and slots freed without a cache
insert, later re-prefilled from prompt + outputs) and each output still equals the plain server's
greedy output. One CUDA GPU, the tiny checkpoint with its bundled draft, two servers started at once:

* `plain` — no speculation, the greedy baseline;
* `retract` — `--speculative-algorithm DSPARK` with SGLang's own test switch `SGLANG_TEST_RETRACT=1`
  (every third scheduler step retracts at least one decoding request, as when the KV pool is full).

The test fails when no retraction happened: SGLang's counter `sglang:num_retracted_requests_total`
(`--enable-metrics`) must be positive after the batch. The runtime-level part (request state,
Engram history, pair ring and the draft rows' captures after a retract and re-prefill) is checked
on CPU in tests/test_runtime_dspark_verify.py. scripts/gpu/dspark8.sh runs this file.
"""
from __future__ import annotations

import re
import time

import pytest

from server_helpers import Server
from test_runtime_dspark_server_gpu import (COMMON, GREEDY, NEW_TOKENS, SPEC, STARTUP_S, _ids, _prompts, _sum,
                                            metrics_text)

pytestmark = pytest.mark.gpu
#: two small servers share the GPU
MEM = ["--mem-fraction-static", "0.3"]
RETRACT_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"}


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dspark_retract")
    started: dict[str, Server] = {}
    try:
        started["plain"] = Server(tiny_checkpoint, logs / "plain.log", COMMON + MEM)
        started["retract"] = Server(tiny_checkpoint, logs / "retract.log", COMMON + SPEC + MEM, env=RETRACT_ENV)
        deadline = time.monotonic() + STARTUP_S
        for srv in started.values():
            srv.wait_ready(max(deadline - time.monotonic(), 1.0))
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def test_dspark_greedy_after_retraction_equals_plain_greedy(servers) -> None:
    prompts = _prompts()
    srv = servers["retract"]
    before = _sum(metrics_text(srv), "sglang:num_retracted_requests_total") or 0.0
    spec = srv.post("/generate", {"input_ids": prompts, "sampling_params": GREEDY})
    plain = servers["plain"].post("/generate", {"input_ids": prompts, "sampling_params": GREEDY})
    retracted = (_sum(metrics_text(srv), "sglang:num_retracted_requests_total") or 0.0) - before
    log = srv.log_path.read_text(errors="replace")
    assert retracted > 0 and re.search(r"#retracted_reqs: [1-9]", log), (retracted, log[-2000:])
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in spec)
    assert _ids(spec) == _ids(plain)
    print(f"DSpark retract: {retracted:.0f} retractions over the batch of {len(prompts)}, greedy == plain; "
          f"accept length per request {[round(o['meta_info'].get('spec_accept_length', 0.0), 2) for o in spec]}")
