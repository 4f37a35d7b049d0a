"""End to end: prefill/decode disaggregation of the tiny checkpoint over Mooncake (TCP on CPU) with
SGLang's router (issue 15; docs/pd.md; spec cpu.md §5, integration.md §2).

The session's 1P1D set-up (`pd_cluster.PDCluster`, shared with `test_pd_faults.py`), started as a
user would: a prefill and a decode `sglang-dsv41 serve --disaggregation-mode ...` (which sets the
CPU PD environment, `runtime/cpu_env.py`) and `python -m sglang_router.launch_router
--pd-disaggregation`, all on 127.0.0.1, every wait bounded, every process group killed at the end.
The prefill chunks its prompts (`pd_cluster.CHUNK` = 64: the 67-, 81- and 82-token oracle prompts
take 2 chunks each, so a pending ratio-2 pair crosses chunks before it crosses servers; the
tool-call prompt's ~600 tokens take 10). Decode output is held to the same oracle as the colocated server's
(tests/test_runtime_server.py: the reference teacher-forced on the tokens, within the numerics
contract; logprobs within its bound), which avoids a third server. The fault test runs last: it
kills the decode server.

Needs the `[pd]` extra and libibverbs (`.ci/run` installs both); without them the module is
skipped, unless `SGLANG_DSV41_PD_REQUIRED=1` (set by `.ci/run`), where it fails.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from server_helpers import REQUEST_TIMEOUT_S, Server, concurrently, free_port
from test_runtime_server import LOGPROB_ATOL, _prompt, _reference_logprobs, within_contract
from test_runtime_server import reference as reference  # noqa: F401  (the module's oracle fixture)

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 600
NEW_TOKENS = 12
COMMON = ["--max-total-tokens", "4096", "--max-running-requests", "8", "--disaggregation-transfer-backend", "mooncake"]


def _pd_missing() -> str | None:
    for module in ("mooncake.engine", "sglang_router"):
        try:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                return f"{module} is not installed (pip install -e '.[pd]')"
            if module == "mooncake.engine":
                subprocess.run([sys.executable, "-c", "import mooncake.engine"], check=True, capture_output=True,
                               timeout=120)
        except subprocess.CalledProcessError as e:
            return f"mooncake does not import: {e.stderr.decode()[-300:]} (apt-get install libibverbs1)"
    return None


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode(errors="replace")


def _up(url: str) -> bool:
    try:
        return _http(url, timeout=30)[0] == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _prefilled(srv: Server) -> int:
    """Prompt tokens the server has computed since it started: `/v1/loads`' cumulative counter.
    The scheduler publishes its snapshot as it processes the next batch (and when fully idle), so
    the value lags the computation by one batch (one chunk on the prefill)."""
    status, loads = _http(srv.url("/v1/loads"), timeout=30)
    assert status == 200, loads
    ranks = loads.get("loads", loads) if isinstance(loads, dict) else loads
    return sum(int(r.get("total_prefill_uncached_tokens") or 0) for r in ranks)


class Router:
    def __init__(self, prefill: Server, bootstrap_port: int, decode: Server, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "w")
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
             "--port", str(self.port), "--prefill", prefill.url(""), str(bootstrap_port), "--decode", decode.url(""),
             "--policy", "round_robin", "--health-check-interval-secs", "5", "--health-failure-threshold", "3",
             "--health-check-timeout-secs", "30", "--disable-circuit-breaker", "--disable-retries",
             # its metrics listener defaults to port 29000: a second router on the host would panic
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return "router log:\n" + self.log_path.read_text(errors="replace")[-n:]

    # sglang-router 0.3.2's worker API (docs/pd.md "Replacing a worker"): POST /workers and
    # DELETE /workers/{id} queue a job and answer 202; GET /workers/{id} has the job's outcome.
    def workers(self) -> list[dict[str, Any]]:
        status, out = _http(self.url("/workers"), timeout=30)
        assert status == 200, (status, out)
        return out["workers"]

    def add_worker(self, url: str, worker_type: str, bootstrap_port: int | None = None) -> str:
        body: dict[str, Any] = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        status, out = _http(self.url("/workers"), body, timeout=30)
        assert status == 202, (status, out)
        return out["worker_id"]

    def remove_worker(self, worker_id: str) -> None:
        req = urllib.request.Request(self.url(f"/workers/{worker_id}"), method="DELETE")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 202, r.read()

    def job_failure(self, worker_id: str) -> str | None:
        """The failure message of the last job queued for `worker_id` (None while none failed)."""
        status, out = _http(self.url(f"/workers/{worker_id}"), timeout=30)
        job = out.get("job_status") if status == 200 and isinstance(out, dict) else None
        return job.get("message") or "failed" if job and job.get("status") == "failed" else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


def _wait(what: str, ok, procs, logs, timeout_s: float = STARTUP_TIMEOUT_S, poll_s: float = 3) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: a process exited:\n" + "\n".join(log() for log in logs))
        if ok():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not ready after {timeout_s} s:\n" + "\n".join(log() for log in logs))


@pytest.fixture(scope="module")
def pd(shared_servers) -> tuple[Server, Server, Router]:
    missing = _pd_missing()
    if missing:
        if os.environ.get("SGLANG_DSV41_PD_REQUIRED") == "1":
            pytest.fail(f"SGLANG_DSV41_PD_REQUIRED=1 but {missing}")
        pytest.skip(missing)
    cluster = shared_servers.pd()          # (re)started if a process of it is gone; the router is ready
    return cluster.prefill, cluster.decode, cluster.router


def _generate(router: Router, ids: list[int], n: int = NEW_TOKENS, logprob: bool = False) -> dict[str, Any]:
    status, out = _http(router.url("/generate"), {"input_ids": ids, "return_logprob": logprob, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert status == 200, f"{status}: {out}"
    return out


def test_both_servers_registered_the_v41_layout(pd) -> None:
    prefill, decode, _ = pd
    for srv in (prefill, decode):
        log = srv.log_tail(10**7)
        assert "sglang-dsv41 PD layout: {" in log and "'state_types': ['swa', 'c128_state']" in log, log[-3000:]


@pytest.mark.parametrize("seed,n", [(11, 81), (12, 82), (13, 67)], ids=["odd-81", "even-82", "odd-67"])
def test_decode_output_is_the_colocated_servers(pd, reference, seed: int, n: int) -> None:
    """Greedy tokens within the contract of the reference (odd lengths: the pending pair crossed
    servers as the boundary row) and logprobs within the colocated server's bound."""
    prefill, decode, router = pd
    prompt = _prompt(seed, n)
    out = _generate(router, prompt, logprob=True)
    tokens = out["output_ids"]
    assert len(tokens) == NEW_TOKENS
    assert within_contract(reference, prompt, tokens), (tokens, decode.log_tail())
    got = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
    want = _reference_logprobs(reference, prompt, tokens)
    assert max(abs(a - b) for a, b in zip(got, want)) <= LOGPROB_ATOL


def test_prefill_prefix_hit_gives_the_same_tokens(pd) -> None:
    _, _, router = pd
    prompt = _prompt(21, 37)
    cold = _generate(router, prompt)
    warm = _generate(router, prompt)
    assert warm["meta_info"]["cached_tokens"] >= 32, warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]
    longer = _generate(router, prompt + _prompt(22, 9)[1:])        # a hit on a prefix, then new tokens
    assert longer["meta_info"]["cached_tokens"] >= 32


def test_concurrent_requests(pd, reference) -> None:
    """Four requests at once answer as each did alone. How they batch depends on when they arrive,
    and the fp32 CPU path is not batch invariant (a row's GEMM rounding depends on the batch's rows),
    so where a reply differs from its solo run both must be greedy within the numerics contract of
    the reference for their own prompt: a near tie, never another request's tokens."""
    _, _, router = pd
    prompts = [_prompt(30 + i, 20 + 3 * i) for i in range(4)]
    alone = [_generate(router, p)["output_ids"] for p in prompts]
    results = concurrently([lambda p=p: _generate(router, p)["output_ids"] for p in prompts])
    for prompt, got, solo in zip(prompts, results, alone):
        assert isinstance(got, list) and len(got) == NEW_TOKENS, got
        assert got == solo or (within_contract(reference, prompt, got) and within_contract(reference, prompt, solo)), \
            (prompt, got, solo)


def test_chat_splits_reasoning(pd, tiny_checkpoint: Path) -> None:
    """Thinking on (the card default): the reply's trace is in reasoning_content, content empty
    (the model cannot close the trace: </think> is biased away)."""
    from tokenizers import Tokenizer

    _, _, router = pd
    think_end = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).token_to_id("</think>")
    assert think_end is not None
    status, out = _http(router.url("/v1/chat/completions"), {
        "model": "tiny", "messages": [{"role": "user", "content": "What is 17*19?"}], "max_tokens": 8,
        "temperature": 0, "logit_bias": {str(think_end): -100}})
    assert status == 200, out
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"], message
    assert out["choices"][0]["finish_reason"] == "length"


def _router_stream(router: Router, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(router.url("/v1/chat/completions"), data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        payloads = [line.decode().strip()[len("data:"):].strip() for line in r if line.startswith(b"data:")]
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]


def test_tool_call_through_pd(pd) -> None:
    """`tools` + a named tool_choice through the router (thinking off): the DSML grammar runs on
    both sides (prefill samples the first token, decode the rest), and the reply is a parsed call of
    the named tool with schema-valid arguments and no markup in content, streamed the same as
    non-streamed — the checks tests/test_api_server.py makes on the colocated server (equality with
    a colocated reply: benchmarks/pd.py, docs/pd.md). A named choice shows the model one tool: the
    prompt (~600 tokens with the DSML tool instructions, 64-token chunks here) is the cost of this
    test on a loaded CPU."""
    from test_api_server import CLOCK, TOOL_MAX_TOKENS, WEATHER, _assemble, _assert_valid_call, _calls

    _, decode, router = pd
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather or time?"}], "temperature": 0,
            "max_tokens": TOOL_MAX_TOKENS, "tools": [WEATHER, CLOCK], "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "chat_template_kwargs": {"thinking": False}}
    status, out = _http(router.url("/v1/chat/completions"), body)
    assert status == 200, (status, out, decode.log_tail())
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = _calls(choice)
    assert len(calls) == 1 and not (choice["message"].get("content") or "").strip(), choice
    _assert_valid_call(calls[0], {"get_time"})
    streamed = _assemble(_router_stream(router, body))
    assert streamed["tool_calls"] == calls and streamed["finish_reason"] == "tool_calls", streamed


def test_decode_killed_then_prefill_serves_on_and_router_answers_503(pd) -> None:
    """Runs last (kills the decode server): a request in flight when decode dies gets an error, not
    a hang; the prefill stays up; the router answers 503 with a message once decode is gone."""
    prefill, decode, router = pd
    result: dict[str, Any] = {}
    plen = 600

    def long_request() -> None:
        try:
            result["out"] = _http(router.url("/generate"), {"input_ids": _prompt(40, plen), "sampling_params": {
                "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}, timeout=120)
        except Exception as e:        # reported below: a client-side timeout is a hang, not an answer
            result["out"] = (None, repr(e))

    prefilled0 = _prefilled(prefill)
    t = threading.Thread(target=long_request)
    t.start()
    # in flight, seen, not slept for: the prefill is part way through the prompt (10 chunks), so the
    # decode still waits for its KV and none of the 400 tokens can have been answered
    deadline, done = time.monotonic() + 120, 0
    while not 0 < done < plen and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
        done = _prefilled(prefill) - prefilled0
    assert 0 < done < plen, (f"the prompt not seen part computed: {done} of {plen} tokens", result)
    os.killpg(decode.proc.pid, signal.SIGKILL)
    decode.proc.wait(timeout=30)
    t.join(timeout=300)
    assert not t.is_alive(), "the client hangs after the decode server died"
    assert result["out"][0] is not None and result["out"][0] >= 400, result      # an HTTP error, not a timeout
    time.sleep(5)
    assert prefill.proc.poll() is None and _up(prefill.url("/health")), prefill.log_tail()
    # The router notices a dead worker by its health checks (3 failures, 5 s apart): a request it
    # forwards before that waits on the prefill's bootstrap timeout (docs/pd.md "Faults"), so wait
    # for the router's own view of the decode (GET /workers) first.
    deadline = time.monotonic() + 120
    while any(w["worker_type"] == "decode" and w["is_healthy"] for w in router.workers()):
        assert time.monotonic() < deadline, (router.workers(), router.log_tail())
        time.sleep(2)
    deadline, status, body = time.monotonic() + 90, None, None
    while time.monotonic() < deadline:
        try:
            status, body = _http(router.url("/generate"), {"input_ids": _prompt(41, 12), "sampling_params": {
                "max_new_tokens": 2, "temperature": 0}}, timeout=20)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            status, body = None, repr(e)
        if status == 503:
            break
        time.sleep(3)
    assert status == 503 and "decode" in str(body).lower(), (status, body)
