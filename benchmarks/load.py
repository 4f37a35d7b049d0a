"""Load benchmark of the chat API (issue 20 item 3; docs/performance.md "Load").

N concurrent streaming ``/v1/chat/completions`` requests against a running server (256 on the
H200, 64 on CPU in CI), then checks what a client must be able to trust:

* **0 lost**: every request gets HTTP 200 and a stream within the timeout;
* **0 without ``[DONE]``**: every stream ends with ``data: [DONE]``;
* **0 garbled**: every ``data:`` payload is JSON of one chat completion (one id, index 0), exactly
  one chunk carries a finish reason (``stop`` / ``length``), the usage chunk's
  ``completion_tokens`` is ≥ 1 and ≤ ``max_tokens``, and the deltas are text;
* **greedy identical prompts give identical text**: the ``identical`` group (one prompt, greedy)
  folds to the same reasoning + content in every stream, equal to the same request sent alone
  before the burst;
* **shared prefixes hit the cache**: the ``prefix`` group (one long system prompt, different
  questions) reports ``cached_tokens`` > 0 in every stream (the prefix is warmed by one request
  first; the server needs ``--enable-cache-report``);
* **memory back to baseline**: afterwards no request is running or waiting and, after
  ``/flush_cache``, the pool's used tokens (``/v1/loads``) equal the value before the burst.

The rest of the N requests (``distinct``) are different prompts. Every request is sampled
greedily with small ``max_tokens`` and EOS ignored, so the work is fixed. Writes JSON (and a PNG
of time-to-first-token and latency when matplotlib is present) and exits 1 if a check fails.

    sglang-dsv41 serve --enable-cache-report --max-running-requests 256   # then:
    python benchmarks/load.py --url http://127.0.0.1:30000 --requests 256
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import pyplot, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHARED_SYSTEM = ("You are a careful assistant for a weather service. Answer briefly, name your "
                 "sources, give temperatures in Celsius and wind in km/h, and never guess. ") * 4
IDENTICAL_PROMPT = "Name three prime numbers."


@dataclass
class Outcome:
    """One request as the client saw it."""

    group: str
    status: int | None = None
    done: bool = False
    garbled: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None


def request_plan(n: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(group, messages) for n requests: a quarter identical, a quarter shared-prefix, the rest
    distinct prompts."""
    quarter = max(2, n // 4)
    plan: list[tuple[str, list[dict[str, str]]]] = []
    for i in range(n):
        if i < quarter:
            plan.append(("identical", [{"role": "user", "content": IDENTICAL_PROMPT}]))
        elif i < 2 * quarter:
            plan.append(("prefix", [{"role": "system", "content": SHARED_SYSTEM},
                                    {"role": "user", "content": f"Forecast for city number {i}?"}]))
        else:
            plan.append(("distinct", [{"role": "user", "content": f"Request {i}: write {i % 7 + 2} words "
                                                                  f"about the number {i * 37 % 1000}."}]))
    return plan


def chat_body(messages: list[dict[str, str]], max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "load", "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def check_chunk(chunk: Any, outcome: Outcome, ids: set[str], max_tokens: int) -> None:
    """Fold one SSE payload into `outcome`, recording what is garbled about it."""
    if not isinstance(chunk, dict) or chunk.get("object") != "chat.completion.chunk":
        outcome.garbled.append(f"not a chat.completion.chunk: {str(chunk)[:80]}")
        return
    ids.add(chunk.get("id"))
    usage = chunk.get("usage")
    if usage:
        outcome.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        outcome.cached_tokens = details.get("cached_tokens")
        if not 1 <= (outcome.completion_tokens or 0) <= max_tokens:
            outcome.garbled.append(f"completion_tokens {outcome.completion_tokens} outside 1..{max_tokens}")
    for choice in chunk.get("choices") or []:
        if choice.get("index") != 0:
            outcome.garbled.append(f"choice index {choice.get('index')}")
        delta = choice.get("delta") or {}
        for key in ("reasoning_content", "content"):
            piece = delta.get(key)
            if piece is not None and not isinstance(piece, str):
                outcome.garbled.append(f"{key} delta is {type(piece).__name__}")
            elif piece:
                outcome.text += piece
        if choice.get("finish_reason"):
            if outcome.finish_reason is not None:
                outcome.garbled.append("a second finish_reason")
            outcome.finish_reason = choice["finish_reason"]


async def stream_one(session: aiohttp.ClientSession, url: str, group: str,
                     messages: list[dict[str, str]], max_tokens: int, timeout_s: float) -> Outcome:
    outcome = Outcome(group)
    ids: set[str] = set()
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=chat_body(messages, max_tokens, True),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            outcome.status = resp.status
            if resp.status != 200:
                outcome.error = (await resp.text())[:200]
                return outcome
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    outcome.done = True
                    break
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - t0
                try:
                    check_chunk(json.loads(payload), outcome, ids, max_tokens)
                except json.JSONDecodeError:
                    outcome.garbled.append(f"not JSON: {payload[:80]}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.perf_counter() - t0
    if outcome.done:
        if len(ids) != 1:
            outcome.garbled.append(f"{len(ids)} chunk ids in one stream")
        if outcome.finish_reason not in ("stop", "length"):
            outcome.garbled.append(f"finish_reason {outcome.finish_reason!r}")
        if outcome.completion_tokens is None:
            outcome.garbled.append("no usage chunk")
    return outcome


async def get_json(session: aiohttp.ClientSession, url: str, path: str, method: str = "GET") -> Any:
    async with session.request(method, f"{url}{path}", timeout=aiohttp.ClientTimeout(total=60)) as resp:
        resp.raise_for_status()
        text = await resp.text()
        return json.loads(text) if text.strip().startswith(("{", "[")) else text


async def pool_state(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """Running / waiting requests and used pool tokens, summed over DP ranks (`/v1/loads`)."""
    loads = await get_json(session, url, "/v1/loads")
    ranks = loads.get("loads", loads) if isinstance(loads, dict) else loads
    keys = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")
    return {k: sum(int(r.get(k) or 0) for r in ranks) for k in keys}


async def settle(session: aiohttp.ClientSession, url: str, expect_used: int | None = None,
                 timeout_s: float = 60) -> dict[str, int]:
    """Wait until nothing runs or waits, flush the prefix cache and return the pool state — once
    it shows ``expect_used`` used tokens, or whatever it shows at the timeout. (The scheduler
    publishes `/v1/loads` snapshots on prefill and when idle, so the flush shows up a moment
    later.)"""
    deadline = time.monotonic() + timeout_s
    state = await pool_state(session, url)
    while state["num_running_reqs"] or state["num_waiting_reqs"]:
        if time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)
        state = await pool_state(session, url)
    await get_json(session, url, "/flush_cache", "POST")
    while True:
        await asyncio.sleep(0.5)
        state = await pool_state(session, url)
        if expect_used is None or state["num_used_tokens"] == expect_used or time.monotonic() > deadline:
            return state


async def run(url: str, n: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        baseline = await settle(session, url)
        plan = request_plan(n)
        # alone first: the reference text of the identical group, and the warm shared prefix
        solo = await stream_one(session, url, "identical", plan[0][1], max_tokens, timeout_s)
        warm = await stream_one(session, url, "prefix", [{"role": "system", "content": SHARED_SYSTEM},
                                                         {"role": "user", "content": "Warm-up."}],
                                max_tokens, timeout_s)
        t0 = time.perf_counter()
        burst = asyncio.gather(*(stream_one(session, url, g, m, max_tokens, timeout_s) for g, m in plan))
        peak = await sample_peak(session, url, burst)
        outcomes = await burst
        wall_s = time.perf_counter() - t0
        after = await settle(session, url, expect_used=baseline["num_used_tokens"])
    result = summarize(outcomes, solo, warm, baseline, after, wall_s, n, max_tokens)
    result["pool"]["peak_during_burst"] = peak
    return result


async def sample_peak(session: aiohttp.ClientSession, url: str, burst: asyncio.Future) -> dict[str, int]:
    """Largest running / waiting / used-token values `/v1/loads` showed while `burst` ran (so
    the baseline comparison is known to read a live pool)."""
    peak = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}
    while not burst.done():
        state = await pool_state(session, url)
        peak = {k: max(v, state[k]) for k, v in peak.items()}
        await asyncio.wait([burst], timeout=0.2)
    return peak


def summarize(outcomes: list[Outcome], solo: Outcome, warm: Outcome, baseline: dict[str, int],
              after: dict[str, int], wall_s: float, n: int, max_tokens: int) -> dict[str, Any]:
    lost = [o for o in outcomes if o.status != 200 or o.error is not None]
    no_done = [o for o in outcomes if o.status == 200 and o.error is None and not o.done]
    garbled = [o for o in outcomes if o.garbled]
    identical = [o for o in outcomes if o.group == "identical"]
    prefix = [o for o in outcomes if o.group == "prefix"]
    texts = {o.text for o in identical}
    checks = {
        "lost": len(lost) == 0,
        "streams_without_done": len(no_done) == 0,
        "garbled": len(garbled) == 0,
        "solo_requests_ok": solo.done and not solo.garbled and warm.done and not warm.garbled,
        "identical_prompts_identical_text": texts == {solo.text} and bool(solo.text),
        "shared_prefix_cache_hits": all((o.cached_tokens or 0) > 0 for o in prefix),
        "no_leaked_requests": after["num_running_reqs"] == 0 and after["num_waiting_reqs"] == 0,
        "pool_back_to_baseline": after["num_used_tokens"] == baseline["num_used_tokens"],
    }
    ttft = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    latency = sorted(o.latency_s for o in outcomes if o.latency_s is not None)
    tokens = sum(o.completion_tokens or 0 for o in outcomes)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    return {
        "requests": n, "max_tokens": max_tokens, "wall_s": round(wall_s, 2),
        "checks": checks, "passed": all(checks.values()),
        "counts": {"lost": len(lost), "streams_without_done": len(no_done), "garbled": len(garbled),
                   "identical": len(identical), "distinct_texts_in_identical": len(texts),
                   "prefix": len(prefix),
                   "prefix_with_cache_hit": sum((o.cached_tokens or 0) > 0 for o in prefix)},
        "pool": {"before": baseline, "after": after},
        "completion_tokens": tokens, "tokens_per_s": round(tokens / wall_s, 1) if wall_s else None,
        "ttft_s": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99), "max": ttft[-1] if ttft else None},
        "latency_s": {"p50": pct(latency, 0.5), "p99": pct(latency, 0.99),
                      "max": latency[-1] if latency else None},
        "examples": {"lost": [asdict(o) for o in lost[:3]], "garbled": [asdict(o) for o in garbled[:3]],
                     "identical_texts": sorted(texts)[:3], "solo_text": solo.text},
        "per_request": [{"group": o.group, "ttft_s": o.ttft_s, "latency_s": o.latency_s,
                         "cached_tokens": o.cached_tokens} for o in outcomes],
    }


def plot(result: dict[str, Any], path: Path) -> str:
    """TTFT and latency per request, by group; '' when written, else why not."""
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for group in ("identical", "prefix", "distinct"):
        rows = [r for r in result["per_request"] if r["group"] == group and r["latency_s"] is not None]
        ax.scatter([r["ttft_s"] or 0 for r in rows], [r["latency_s"] for r in rows], s=10, label=group)
    ax.set(xlabel="time to first token (s)", ylabel="stream latency (s)",
           title=f"{result['requests']} concurrent streams, max_tokens {result['max_tokens']}: "
                 f"{'all checks pass' if result['passed'] else 'CHECKS FAIL'}")
    ax.legend()
    save_png(fig, path, dpi=110)
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--requests", type=int, default=64, help="concurrent streams (H200: 256)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=600, help="per request")
    ap.add_argument("--out", type=Path, default=RESULTS / "load.json")
    ap.add_argument("--label", default="", help="where it ran (kept in the JSON)")
    args = ap.parse_args(argv)
    if args.requests < 8:
        ap.error("--requests must be at least 8 (four groups of two)")
    result = asyncio.run(run(args.url.rstrip("/"), args.requests, args.max_tokens, args.timeout_s))
    result["label"] = args.label
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png_note = plot(result, args.out.with_suffix(".png"))
    result["png"] = png_note or str(args.out.with_suffix(".png").name)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("requests", "wall_s", "passed", "checks", "counts",
                                             "pool", "ttft_s", "latency_s", "tokens_per_s", "png")}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
