"""PD faults: transfer timeouts, aborted requests and a prefill server killed with requests in
flight (issue 15 item 4; docs/pd.md "Faults").

The session's 1P1D (`pd_cluster.PDCluster`, shared with `test_pd_server.py`: two
`sglang-dsv41 serve --disaggregation-mode ...` and `sglang-router`, 127.0.0.1, Mooncake TCP), with
SGLang's transfer timeouts lowered to `TIMEOUT_S`: the prefill drops a request whose
decode never bootstraps (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`), the decode drops one whose KV
never arrives (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`). "Nothing leaks" is checked on the pools
themselves: after every fault both servers go idle (no running, waiting or PD-queued request, per
`/v1/loads`), and once the prefix cache is flushed their used tokens equal the baseline taken
before the first request. The last test kills the prefill server, so it runs last; it then starts
a new prefill, registers it with the same router (sglang-router's worker API) and serves again;
the shared set-up keeps the new prefill.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
from typing import Any

import pytest

from pd_cluster import CHUNK, TIMEOUT_S
from server_helpers import Server
from test_pd_server import Router, _http, _pd_missing, _prefilled, _up, _wait
from test_runtime_server import _prompt

pytestmark = pytest.mark.slow

SETTLE_S = 180          # bound on a server going idle and its pool back to baseline
QUEUES = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
          "decode_transfer_queue_reqs", "decode_retracted_queue_reqs")


def pool(srv: Server) -> dict[str, int]:
    """Running, waiting and PD-queued requests and used pool tokens of one server (`/v1/loads`,
    summed over DP ranks)."""
    status, loads = _http(srv.url("/v1/loads?include=all"), timeout=30)
    assert status == 200, loads
    ranks = loads.get("loads", loads) if isinstance(loads, dict) else loads
    out = {k: sum(int(r.get(k) or 0) for r in ranks) for k in ("num_running_reqs", "num_waiting_reqs",
                                                                   "num_used_tokens")}
    for q in QUEUES:
        out[q] = sum(int((r.get("disaggregation") or {}).get(q) or 0) for r in ranks)
    return out


def settled(srv: Server, baseline: int | None = None, timeout_s: float = SETTLE_S) -> dict[str, int]:
    """Wait until `srv` holds no request, flush its prefix cache, and return its pool state once
    the used tokens equal `baseline` (any value when None); AssertionError with the state at the
    bound otherwise."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, int] = {}
    while time.monotonic() < deadline:
        state = pool(srv)
        if any(v for k, v in state.items() if k != "num_used_tokens"):
            time.sleep(1)
            continue
        _http(srv.url("/flush_cache"), {}, timeout=30)
        time.sleep(1)                     # the scheduler publishes its load snapshot a moment later
        state = pool(srv)
        if baseline is None or state["num_used_tokens"] == baseline:
            return state
    raise AssertionError(f"not settled to {baseline} used tokens in {timeout_s} s: {state}\n{srv.log_tail()}")


@pytest.fixture(scope="module")
def pair(shared_servers) -> dict[str, Any]:
    missing = _pd_missing()
    if missing:
        if os.environ.get("SGLANG_DSV41_PD_REQUIRED") == "1":
            pytest.fail(f"SGLANG_DSV41_PD_REQUIRED=1 but {missing}")
        pytest.skip(missing)
    cluster = shared_servers.pd()
    p, d = cluster.prefill, cluster.decode
    state: dict[str, Any] = {"cluster": cluster, "boot": cluster.boot, "prefill": p, "decode": d,
                             "router": cluster.router}
    # idle and flushed, both pools hold nothing: every later check is "back to 0"
    state["baseline"] = {"prefill": settled(p, 0)["num_used_tokens"], "decode": settled(d, 0)["num_used_tokens"]}
    return state


def _body(seed: int, n: int, new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": _prompt(seed, n), "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                               "ignore_eos": True}, **extra}


def _both_settled(pair: dict[str, Any], prefill: Server | None = None) -> None:
    settled(prefill or pair["prefill"], pair["baseline"]["prefill"])
    settled(pair["decode"], pair["baseline"]["decode"])


def _serves(router: Router, seed: int = 90) -> list[int]:
    status, out = _http(router.url("/generate"), _body(seed, 33, 6), timeout=300)
    assert status == 200, (status, out, router.log_tail())
    assert len(out["output_ids"]) == 6
    return out["output_ids"]


def _prefill_busy(prefill: Server) -> bool:
    """The prefill holds a request it has not handed over yet (running, waiting, bootstrapping or
    transferring)."""
    state = pool(prefill)
    return any(state[k] for k in ("num_running_reqs", "num_waiting_reqs", "prefill_bootstrap_queue_reqs",
                                  "prefill_inflight_queue_reqs"))


def _room() -> int:
    return int(time.time() * 1000) % (1 << 40)


def test_one_sided_requests_time_out_and_free_their_pages(pair) -> None:
    """A request sent to one server only (bootstrap fields as the router adds them), one to each
    side at once (independent rooms: the two waits overlap, one timeout's wall time for both).
    Decode: it reserves pages, bootstraps with the prefill, and the KV never comes; SGLang's waiting
    timeout fails it. Prefill: it waits in the bootstrap queue for a decode that never bootstraps
    and is dropped after the bootstrap timeout. Either way the client gets a message and nothing is
    held."""
    results: dict[str, Any] = {}

    def send(side: str, seed: int, room: int) -> None:
        t0 = time.monotonic()
        try:
            out = _http(pair[side].url("/generate"), _body(seed, 40, 4, bootstrap_host="127.0.0.1",
                                                         bootstrap_port=pair["boot"], bootstrap_room=room),
                        timeout=TIMEOUT_S + 120)
        except Exception as e:            # a client-side timeout: reported below
            out = (None, repr(e))
        results[side] = (*out, time.monotonic() - t0)

    room = _room()
    threads = [threading.Thread(target=send, args=(side, seed, room + i))
               for i, (side, seed) in enumerate((("decode", 50), ("prefill", 51)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT_S + 180)
    assert not any(t.is_alive() for t in threads), "a one-sided request hangs"
    for side, (status, out, waited) in results.items():
        assert status is not None and (status >= 400 or "error" in str(out).lower()), (side, status, out)
        assert "timed out" in str(out).lower(), (side, status, out)
        assert TIMEOUT_S - 1 <= waited < TIMEOUT_S + 60, (side, waited)
    _both_settled(pair)
    _serves(pair["router"])


def _reached(stage: str, prefill: Server, decode: Server, prefilled0: int, plen: int) -> tuple[bool, str]:
    """Whether the pair is seen in `stage` now, and what was seen. The decode publishes nothing while
    its requests only wait for KV (no batch runs), so the transfer stages are read off the prefill,
    whose KV the decode waits for: transfer-early, the first prompt is part computed; transfer-late,
    the first prompt is computed (its KV sent or on its way) and at least two chunks of the second
    are still to come. decoding: the decode runs a request."""
    if stage == "decoding":
        d = pool(decode)
        return d["num_running_reqs"] > 0, f"decode {d}"
    done = _prefilled(prefill) - prefilled0
    window = (0, plen) if stage == "transfer-early" else (plen, 2 * plen - 2 * CHUNK)
    return window[0] < done < window[1], f"prefill computed {done} of 2 x {plen} prompt tokens"


@pytest.mark.parametrize("stage", ["transfer-early", "transfer-late", "decoding"])
def test_aborted_requests_leak_nothing(pair, stage: str) -> None:
    """Two long requests through the router, then `/abort_request` (abort_all) on the decode and the
    prefill once the pair is seen in `stage` (`_reached`: a 600-token prompt is ten prefill steps of
    `CHUNK` tokens while the decode waits for its KV) — never after a fixed sleep, which a faster or
    slower host turns into another stage; and a third whose client disconnects. Both pools return
    to 0 and the pair serves on."""
    router, prefill, decode = pair["router"], pair["prefill"], pair["decode"]
    results: dict[int, Any] = {}

    plen = 40 if stage == "decoding" else 600     # decoding: through prefill and transfer at once

    def send(i: int, timeout: float) -> None:
        try:
            results[i] = _http(router.url("/generate"), _body(60 + i, plen, 200), timeout=timeout)
        except Exception as e:            # the disconnecting client's timeout, or a reset
            results[i] = (None, repr(e))

    disconnect_s = {"transfer-early": 0.8, "transfer-late": 3.5}.get(stage, 1.5)
    prefilled0 = _prefilled(prefill)
    threads = [threading.Thread(target=send, args=(i, 200)) for i in range(2)]
    threads.append(threading.Thread(target=send, args=(2, disconnect_s)))
    for t in threads:
        t.start()
    t0 = time.monotonic()
    deadline, trace = t0 + 120, []
    while time.monotonic() < deadline and any(t.is_alive() for t in threads[:2]):
        ok, seen = _reached(stage, prefill, decode, prefilled0, plen)
        if not trace or trace[-1][1] != seen:
            trace.append((round(time.monotonic() - t0, 2), seen))
        if ok:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"{stage} not observed; seen: {trace}; results {results}")
    for srv in (decode, prefill):
        _http(srv.url("/abort_request"), {"abort_all": True}, timeout=30)
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a client hangs after abort"
    for i in range(2):                    # aborted or (if it was already done) answered: never a hang
        assert results[i][0] is not None, results
    _both_settled(pair)
    _serves(router)


def test_prefill_killed_with_requests_in_flight(pair) -> None:
    """Runs last (kills the prefill). Requests in flight get an error, not a hang; the decode stays
    up and frees what it reserved; a new prefill (new HTTP and bootstrap ports) registered with the
    same router through its worker API, the dead one removed, serves the same tokens."""
    router, prefill, decode = pair["router"], pair["prefill"], pair["decode"]
    before = _serves(router)
    results: dict[int, Any] = {}

    def send(i: int) -> None:
        try:
            results[i] = _http(router.url("/generate"), _body(70 + i, 600, 100), timeout=200)
        except Exception as e:            # a client-side timeout is a hang: reported below
            results[i] = (None, repr(e))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    _wait("the prefill holding a request", lambda: _prefill_busy(prefill), [prefill, decode],
          [prefill.log_tail, decode.log_tail], timeout_s=60, poll_s=0.05)
    os.killpg(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    for t in threads:
        t.join(timeout=260)
    assert not any(t.is_alive() for t in threads), "a client hangs after the prefill server died"
    # A request whose KV reached the decode before the kill needs no prefill: it may finish (checked
    # against a re-run below). The ones the prefill still held must fail, naming the prefill: the
    # decode's heartbeat (2 × 5 s) notices the lost prefill.
    finished = {i: r[1]["output_ids"] for i, r in results.items() if r[0] == 200}
    failed = [i for i in range(3) if i not in finished]
    assert failed, ("every request finished: the kill came too late to test anything", results)
    for i in failed:
        status, body = results[i]
        assert status is not None and status >= 400, (i, results[i], router.log_tail())
        assert "prefill" in str(body).lower(), (i, body)
    assert decode.proc.poll() is None and _up(decode.url("/health")), decode.log_tail()
    settled(decode, pair["baseline"]["decode"])
    dead = [w["id"] for w in router.workers() if w["worker_type"] == "prefill"]
    assert len(dead) == 1, router.workers()

    new, boot = pair["cluster"].new_prefill("prefill_replacement")
    pair["cluster"].adopt_prefill(new, boot)              # the shared set-up's prefill from now on
    _wait("new prefill", lambda: _up(new.url("/health")), [new, decode], [new.log_tail, decode.log_tail])
    new_id = router.add_worker(new.url(""), "prefill", boot)
    router.remove_worker(dead[0])
    want = {("prefill", new.url(""), boot, True), ("decode", decode.url(""), None, True)}

    def registered() -> bool:
        failed = router.job_failure(new_id)
        assert failed is None, f"the router's AddWorker job failed: {failed}\n{router.log_tail()}"
        got = {(w["worker_type"], w["url"], w.get("bootstrap_port"), w["is_healthy"]) for w in router.workers()}
        return got == want and _up(router.url("/readiness"))

    _wait("the router's new prefill", registered, [new, decode, router], [new.log_tail, decode.log_tail,
                                                                           router.log_tail], timeout_s=300)
    try:
        after = _serves(router)
    except (urllib.error.URLError, OSError) as e:
        raise AssertionError(f"{e!r}\n{decode.log_tail()}\n{new.log_tail()}") from e
    assert after == before
    for i, ids in finished.items():       # a request that survived the kill is a correct one
        status, out = _http(router.url("/generate"), _body(70 + i, 600, 100), timeout=300)
        assert status == 200 and out["output_ids"] == ids, (i, status, out)
    _both_settled(pair, prefill=new)
