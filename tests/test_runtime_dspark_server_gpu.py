"""DSpark speculative decoding served on one CUDA GPU (issue 16; docs/dspark.md), the tiny
checkpoint with its bundled draft (γ = 5). Three servers start at once and are shared by the file
(module fixture; the whole file in about one server start-up, ~60–120 s on an H200):

* `plain` — no speculation, the greedy baseline;
* `dspark` — `--speculative-algorithm DSPARK`, uniform verify (SGLang's `static` ragged mode);
* `adaptive` — the deployment config `configs/tiny-h200-tp1-dspark.yaml` started by
  `sglang-dsv41 launch` (DSPARK, adaptive verification: `SGLANG_RAGGED_VERIFY_MODE=compact`) with a
  synthetic SPS table (`speculative.sps_table`) where a verify token costs as much as the tokens
  before it, so SGLang's planner trims low-confidence drafts (ragged verify batches, in CUDA
  graphs); `serving.mem_fraction_static` 0.5 instead of 0.15 because three servers share the GPU.

All three are text-only with context 2048 (as the config) and prefill in chunks of 32 tokens (the
prompts are 12–60 tokens), so every comparison also covers chunked prefill with DSpark on. Checked: greedy output == plain greedy for 64 new tokens at
batch 1 and 8 on both DSpark servers; a prefix hit on the DSpark server gives the plain server's
output; sampled decoding (block rejection) runs and reports its acceptance; per-request acceptance
(`meta_info`: length, rate, correct-draft histogram) is consistent with the request, and SGLang's
counter `sglang:spec_verify_calls_total` adds up the requests' verify counts (`--enable-metrics`).

Greedy equality and the attention plan (docs/dspark.md "Greedy equality and the serving default"):
every server runs with `SGLANG_DSV41_ATTN_SPLITS=one` (`SERVER_ENV`), the batch-invariant attention
plan, because the serving default's split-KV plan depends on the query count and a verify step
(batch × (γ + 1) queries) would otherwise use another plan than the plain server's decode step
(batch queries); likewise `SGLANG_DSV41_BF16_GEMM=blocked` and `SGLANG_DSV41_ATTN_PREFILL=packed`
(the serving default's whole-batch BF16 GEMMs and prefill workspace depend on how the two servers
happen to batch the prompts). The rest is the serving default.

Skipped without CUDA (conftest). `SGLANG_DSV41_DSPARK_TEST_EXTRA` adds server flags to every server
(e.g. `--disable-cuda-graph`, the eager fallback). scripts/gpu/dspark7.sh runs this file.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from server_helpers import Server, free_port

pytestmark = pytest.mark.gpu
NEW_TOKENS = 64
GAMMA = 5
STARTUP_S = 200
EXTRA = os.environ.get("SGLANG_DSV41_DSPARK_TEST_EXTRA", "").split()
COMMON = ["--max-running-requests", "8", "--cuda-graph-max-bs", "8", "--context-length", "2048", "--enable-metrics",
          "--decode-log-interval", "1", "--language-model-only",
          "--chunked-prefill-size", "32", *EXTRA]
SPEC = ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", str(GAMMA)]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
#: a cost table where every verify token costs as much as the tokens before it (steps/s ∝ 1/tokens)
SPS_TOKENS = [1, 2, 4, 8, 16, 32, 48, 64]
SPS_TABLE = {"sample_batch_tokens": SPS_TOKENS, "sample_steps_per_sec": [1000.0 / t for t in SPS_TOKENS],
             "max_batch_tokens": 64}


CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-h200-tp1-dspark.yaml"
#: the batch-invariant attention plan, BF16 GEMM rows and prefill rows for every server (module doc)
SERVER_ENV = {"SGLANG_DSV41_ATTN_SPLITS": "one", "SGLANG_DSV41_BF16_GEMM": "blocked",
              "SGLANG_DSV41_ATTN_PREFILL": "packed"}


class LaunchedServer(Server):
    """A deployment config run by `sglang-dsv41 launch --config` (which execs SGLang), as a `Server`."""

    def __init__(self, config: Path, checkpoint: Path, log: Path, sets: list[str], extra: list[str]) -> None:
        self.port, self.log_path, self.device = free_port(), log, "cuda"
        argv = [sys.executable, "-m", "sglang_dsv41.cli", "launch", "--config", str(config), "--model-path",
                str(checkpoint), "--port", str(self.port), *[a for kv in sets for a in ("--set", kv)], "--", *extra]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **SERVER_ENV})


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(16)
    return [[0] + torch.randint(3, 990, (int(n),), generator=g).tolist() for n in torch.randint(12, 60, (8,), generator=g)]


class Shared:
    """The file's servers (started together) and each one's greedy batch-1 / batch-8 outputs,
    computed once on first use."""

    def __init__(self, checkpoint, log_dir) -> None:
        table = log_dir / "sps.json"
        table.write_text(json.dumps(SPS_TABLE))
        self.servers: dict[str, Server] = {}
        self.errors: dict[str, str] = {}
        self._greedy: dict[str, tuple[list[dict], list[dict], dict[str, float]]] = {}
        try:
            for name, args in (("plain", COMMON), ("dspark", COMMON + SPEC)):
                self.servers[name] = Server(checkpoint, log_dir / f"{name}.log", args, env=SERVER_ENV)
            self.servers["adaptive"] = LaunchedServer(
                CONFIG, checkpoint, log_dir / "adaptive.log",
                [f"speculative.sps_table={table}", "serving.mem_fraction_static=0.5"],
                [a for a in COMMON if a != "--language-model-only"])  # the config's features.text_only emits it
        except BaseException:
            self.stop()
            raise
        deadline = time.monotonic() + STARTUP_S
        for name, srv in self.servers.items():          # they start concurrently; wait for each in turn
            try:
                srv.wait_ready(max(deadline - time.monotonic(), 1.0))
            except (RuntimeError, TimeoutError) as e:
                self.errors[name] = f"{name} server did not come up: {e}"

    def get(self, name: str) -> Server:
        if name in self.errors:
            raise AssertionError(self.errors[name])
        return self.servers[name]

    def greedy(self, name: str) -> tuple[list[dict], list[dict], dict[str, float]]:
        """(batch-1 outputs, batch-8 outputs, the spec counters' increase over those requests)."""
        if name not in self._greedy:
            srv, prompts = self.get(name), _prompts()
            before = counters(srv)
            b1 = [srv.post("/generate", {"input_ids": prompts[0], "sampling_params": GREEDY})]
            b8 = srv.post("/generate", {"input_ids": prompts, "sampling_params": GREEDY})
            want = sum(o["meta_info"].get("spec_verify_ct", 0) for o in b1 + b8)
            after = counters(srv, expect_verify=before.get("verify", 0.0) + want)
            self._greedy[name] = (b1, b8, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
        return self._greedy[name]

    def stop(self) -> None:
        for srv in self.servers.values():
            srv.stop()


def metrics_text(srv: Server) -> str:
    with urllib.request.urlopen(srv.url("/metrics"), timeout=30) as r:
        return r.read().decode()


def _sum(text: str, name: str) -> float | None:
    """Sum of a metric over its label sets (None when absent)."""
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
    return sum(float(x) for x in found) if found else None


def counters(srv: Server, expect_verify: float | None = None) -> dict[str, float]:
    """SGLang's request counters (verify calls, generated tokens); with `expect_verify`, polled up
    to 10 s until the verify counter reaches it (the tokenizer manager counts a finished request
    when it hands out the answer)."""
    deadline = time.monotonic() + 10
    while True:
        text = metrics_text(srv)
        out = {k: v for k, v in (("verify", _sum(text, "sglang:spec_verify_calls_total")),
                                 ("generated", _sum(text, "sglang:generation_tokens_total"))) if v is not None}
        if expect_verify is None or out.get("verify", 0.0) >= expect_verify or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
    return None if m is None else float(m.group(1))


@pytest.fixture(scope="module")
def shared(tiny_checkpoint, tmp_path_factory):
    s = Shared(tiny_checkpoint, tmp_path_factory.mktemp("dspark_servers"))
    try:
        yield s
    finally:
        s.stop()


def check_acceptance(outputs: list[dict]) -> None:
    """Per-request acceptance as SGLang reports it (meta_info), consistent with the request: the
    correct-draft histogram has one entry per verify step and sums to the correct drafts, the
    accept length is completion tokens / verify steps, the rate correct / (steps · γ), and the
    prefill token plus the accepted runs cover the 64 tokens (the last run may overshoot)."""
    for o in outputs:
        m = o["meta_info"]
        steps, correct = m["spec_verify_ct"], m["spec_num_correct_drafts"]
        hist = m.get("spec_correct_drafts_histogram") or []
        assert len(o["output_ids"]) == m["completion_tokens"] == NEW_TOKENS
        assert 0 < steps < NEW_TOKENS and sum(hist) == steps and len(hist) <= GAMMA + 1, m
        assert sum(i * n for i, n in enumerate(hist)) == correct, m
        assert m["spec_accept_length"] == pytest.approx(NEW_TOKENS / steps), m
        assert m["spec_accept_rate"] == pytest.approx(correct / (steps * GAMMA)), m
        assert NEW_TOKENS - 1 <= steps + correct <= NEW_TOKENS + GAMMA, m


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def _lengths(outputs: list[dict]) -> list[float]:
    return [round(o["meta_info"]["spec_accept_length"], 2) for o in outputs]


def test_dspark_greedy_equals_plain_greedy_and_reports_acceptance(shared) -> None:
    plain, spec = shared.greedy("plain"), shared.greedy("dspark")
    assert _ids(spec[0]) == _ids(plain[0]) and _ids(spec[1]) == _ids(plain[1])
    check_acceptance(spec[0] + spec[1])
    delta = spec[2]
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in spec[0] + spec[1])
    assert delta.get("verify") == steps, delta                      # the counter adds up the requests
    assert delta.get("generated") == 9 * NEW_TOKENS, delta
    text = metrics_text(shared.get("dspark"))
    length = gauge(text, "sglang:spec_accept_length")
    assert length is not None and 1.0 <= length <= GAMMA + 1, text[-2000:]
    mean = 9 * NEW_TOKENS / steps
    print(f"DSpark tiny checkpoint (uniform verify), batch 8: accept length per request {_lengths(spec[1])}, "
          f"mean over 9 requests {mean:.2f} (counter: {9 * NEW_TOKENS} tokens / {steps:.0f} verify steps), "
          f"gauge {length:.2f}")


def test_dspark_adaptive_verification_greedy_equals_plain_greedy(shared) -> None:
    """Adaptive verification: greedy output still equals the plain server's; the log names the
    compact scheduler and SGLang's mean verify window (`sglang:spec_cap_length`) is below 6 only
    if drafts were trimmed — it is reported, and must lie in (0, 6]."""
    plain, spec = shared.greedy("plain"), shared.greedy("adaptive")
    assert _ids(spec[0]) == _ids(plain[0]) and _ids(spec[1]) == _ids(plain[1])
    check_acceptance(spec[0] + spec[1])
    log = shared.get("adaptive").log_path.read_text(errors="replace")
    assert "ragged-verify scheduler enabled (mode=compact" in log
    cap = gauge(metrics_text(shared.get("adaptive")), "sglang:spec_cap_length")
    assert cap is not None and 0.0 < cap <= GAMMA + 1
    windows = [round(o["meta_info"].get("spec_cap_length", 0.0), 2) for o in spec[1]]
    print(f"DSpark adaptive verification, batch 8: accept length per request {_lengths(spec[1])}, "
          f"verify window per request {windows}, gauge {cap:.2f} of {GAMMA + 1}")


def test_dspark_prefix_hit_equals_plain(shared) -> None:
    """The longest batch-8 prompt plus new tokens (a prefix of it is in the radix cache of both
    servers after the batch-8 requests) is served from the cache on the DSpark server and gives the
    plain server's greedy output; a repeat of it hits at least as much and gives it again."""
    plain_b8, spec_b8 = shared.greedy("plain")[1], shared.greedy("dspark")[1]
    prompts = _prompts()
    i = max(range(len(prompts)), key=lambda k: len(prompts[k]))
    assert spec_b8[i]["output_ids"] == plain_b8[i]["output_ids"]
    ids = prompts[i] + [7, 11, 13, 17, 19, 23, 29]
    body = {"input_ids": ids, "sampling_params": GREEDY}
    want = shared.get("plain").post("/generate", body)
    first, again = (shared.get("dspark").post("/generate", body) for _ in range(2))
    hits = (first["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"])
    assert 16 <= hits[0] <= hits[1], (len(prompts[i]), len(ids), hits)     # page-aligned prefix hits
    assert first["output_ids"] == again["output_ids"] == want["output_ids"]
    check_acceptance([first, again])
    print(f"DSpark prefix hit: {hits[0]} then {hits[1]} of {len(ids)} prompt tokens cached, greedy == plain")


def test_dspark_sampled_decoding_reports_acceptance(shared, tiny_checkpoint) -> None:
    """Sampled decoding (temperature 1: SGLang's sampled accept, i.e. block / chain rejection,
    equal in distribution to the reference: tests/test_runtime_dspark_accept_gpu.py) runs end to
    end at batch 8: 64 in-vocabulary tokens per request and consistent acceptance figures."""
    from sglang_dsv41.config import DeepseekV41Config

    vocab = DeepseekV41Config.from_file(tiny_checkpoint).text.vocab_size
    outs = shared.get("dspark").post("/generate", {"input_ids": _prompts(), "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}})
    check_acceptance(outs)
    assert all(0 <= t < vocab for o in outs for t in o["output_ids"])
    print(f"DSpark sampled (temperature 1), batch 8: accept length per request {_lengths(outs)}")
