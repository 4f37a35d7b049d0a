"""PD 1P1D against a colocated server on one checkpoint (issue 15 "Benchmark"; docs/pd.md
"Benchmark").

Starts the servers itself, one set-up at a time on 127.0.0.1: a colocated `sglang-dsv41 serve`,
then a prefill and a decode server (`--disaggregation-mode`, Mooncake; `sglang-dsv41 serve` adds
the CPU PD environment) behind `sglang-router` — or, with `--no-router` (the GPU device call
cannot carry the router wheel), the client posts each request to both servers with bootstrap
host/port/room, as the router does. The same client runs in both set-ups:

* at each concurrency C, C streams at a time of greedy ``/generate`` (prompt ``--prompt-len``
  random ids, ``--new-tokens`` with EOS ignored), ``--rounds`` waves: TTFT (first streamed
  chunk), ITL ((last − first chunk time) / (tokens − 1)) and output tokens/s of the wave, and
  the gaps between the token-carrying chunks of the level's first request (even tokens or
  bursts behind a late first chunk);
* several ``--prompt-len`` values run one after another on the same servers (levels carry
  ``prompt_len``); on CUDA the device-to-device copy bandwidth of GPU 0 is measured first
  (``device_copy_gb_s``), the ceiling for the per-request transfer bandwidth;
* transfer, PD only: SGLang's own per-request numbers from the prefill's ``/metrics``
  (``sglang:kv_transfer_{latency_ms,total_mb,speed_gb_s}`` histograms, differenced around each
  concurrency level; its total counts KV pages × Σ kv item lens + state indices × Σ state item
  lens), next to the exact KV-page bytes of one prompt from the layout fingerprint the prefill
  publishes (``⌈N / page⌉ · Σ kv_item_lens``);
* a ``tools`` chat request (tool_choice required, thinking off) in both set-ups: whether the PD
  reply's parsed call equals the colocated one.

Writes JSON and a PNG (when matplotlib is present). Every wait is bounded; every process group is
killed at the end.

    python benchmarks/pd.py --out benchmarks/results/pd_cpu.json            # CPU, ~4 min
    python benchmarks/pd.py --no-router --server-arg=--mem-fraction-static --server-arg=0.3 \\
        --concurrency 1 8 32 --prompt-len 1024 --new-tokens 64 --out $OUT/pd_h200.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_client  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUT_ROUTE = "/sglang_dsv41/layout"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {
    "type": "object", "required": ["unit"], "properties": {"unit": {"type": "string", "enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Time now.", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
TOOLS_CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather or time?"}], "temperature": 0,
              "max_tokens": 160, "tools": [WEATHER, CLOCK], "parallel_tool_calls": False, "tool_choice": "required",
              "chat_template_kwargs": {"thinking": False}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()


class Proc(serving_client.Proc):
    """`serving_client.Proc` plus the CPU seconds of its process tree."""

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of the process and its descendants so far (the scheduler,
        tokenizer and detokenizer of a server are its children)."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.p.pid)
            for q in [root, *root.children(recursive=True)]:
                try:
                    t = q.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return total


wait_up = serving_client.wait_up


def serve(args: argparse.Namespace, port: int, log: Path, extra: list[str],
          env: dict[str, str] | None = None) -> Proc:
    """Every server of both set-ups gets the same flags (metrics on everywhere, so that their cost
    is on both sides of the comparison); `extra` adds only the PD role, `env` its thread split."""
    return Proc([sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", args.device, "--model-path",
                 str(args.checkpoint), "--port", str(port), "--max-total-tokens", str(args.max_total_tokens),
                 "--max-running-requests", str(max(args.concurrency)), "--enable-metrics", *args.server_arg,
                 *extra], log, env)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(3, 900) for _ in range(n - 1)]


def stream_generate(url: str, ids: list[int], new_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One streamed greedy /generate: TTFT, ITL, tokens (client clock)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                                  "ignore_eos": True}, **extra}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    arrivals: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            n = int(chunk["meta_info"]["completion_tokens"])
            if n > tokens:
                last = time.perf_counter() - t0
                first = last if first is None else first
                tokens = n
                arrivals.append(last)
    if tokens != new_tokens:
        raise RuntimeError(f"{tokens} of {new_tokens} tokens streamed")
    return {"ttft_s": first, "itl_s": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "gaps_ms": [round(1e3 * (b - a), 1) for a, b in zip(arrivals, arrivals[1:])]}


class Target:
    """Where the client sends a request: one URL, or (router-less PD) prefill + decode with
    bootstrap fields."""

    def __init__(self, url: str, prefill: str | None = None, bootstrap_port: int | None = None) -> None:
        self.url, self.prefill, self.boot = url, prefill, bootstrap_port
        self._room = random.Random(7).randrange(1 << 30)
        self._lock = threading.Lock()

    def call(self, send: Callable[[str, dict[str, Any]], Any]) -> Any:
        if self.prefill is None:
            return send(self.url, {})
        with self._lock:
            self._room += 1
            extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.boot, "bootstrap_room": self._room}
        errors: list[BaseException] = []

        def to_prefill() -> None:
            try:
                send(self.prefill, extra)
            except BaseException as e:    # re-raised below: a failed prefill fails the request
                errors.append(e)

        t = threading.Thread(target=to_prefill)
        t.start()
        out = send(self.url, extra)
        t.join(timeout=600)
        if errors:
            raise errors[0]
        return out


def run_level(target: Target, c: int, rounds: int, plen: int, new_tokens: int, seed: int) -> dict[str, Any]:
    rows: list[Any] = []
    t0 = time.perf_counter()
    for r in range(rounds):
        wave: list[Any] = [None] * c

        def one(i: int, r: int = r) -> None:
            ids = prompt(seed + 1000 * r + i, plen)
            try:
                wave[i] = target.call(lambda url, extra: stream_generate(url, ids, new_tokens, extra)
                                      if url == target.url else http(url + "/generate", {
                                          "input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens,
                                                                                "temperature": 0, "ignore_eos": True},
                                          **extra}, timeout=600))
            except Exception as e:       # counted as an error in the result
                wave[i] = repr(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        rows += wave
    wall = time.perf_counter() - t0
    ok = [x for x in rows if isinstance(x, dict)]

    def stat(key: str) -> dict[str, float | None]:
        vals = sorted(x[key] for x in ok if x[key] is not None)
        if not vals:
            return {"mean": None, "p50": None, "max": None}
        return {"mean": sum(vals) / len(vals), "p50": vals[len(vals) // 2], "max": vals[-1]}

    return {"concurrency": c, "requests": len(rows), "errors": [x for x in rows if not isinstance(x, dict)][:3],
            "n_errors": len(rows) - len(ok), "wall_s": wall, "ttft_s": stat("ttft_s"), "itl_s": stat("itl_s"),
            "output_tokens_per_s": sum(x["tokens"] for x in ok) / wall,
            "chunk_gaps_ms_first_request": ok[0]["gaps_ms"] if ok else None}


def transfer_metrics(prefill_url: str) -> dict[str, float]:
    return parse_transfer(http(prefill_url + "/metrics", timeout=60))


def parse_transfer(text: str) -> dict[str, float]:
    """Sums and counts of the kv_transfer histograms in a Prometheus text (all label sets)."""
    out: dict[str, float] = {}
    for name in ("latency_ms", "total_mb", "speed_gb_s"):
        for part in ("sum", "count"):
            pat = rf"^sglang:kv_transfer_{name}_{part}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$"
            out[f"{name}_{part}"] = sum(float(m) for m in re.findall(pat, text, flags=re.M))
    return out


def transfer_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    d = {k: after[k] - before[k] for k in before}
    out: dict[str, float | None] = {}
    for name in ("latency_ms", "total_mb", "speed_gb_s"):
        n = d[f"{name}_count"]
        out[f"mean_{name}"] = d[f"{name}_sum"] / n if n else None
    out["transfers"] = d["latency_ms_count"]
    return out


def tool_call(target: Target) -> dict[str, Any]:
    def send(url: str, extra: dict[str, Any]) -> Any:
        return http(url + "/v1/chat/completions", {**TOOLS_CHAT, **extra}, timeout=600)

    choice = target.call(send)["choices"][0]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in choice["message"].get("tool_calls") or []]
    return {"finish_reason": choice["finish_reason"], "tool_calls": calls,
            "content": choice["message"].get("content") or ""}


def measure(args: argparse.Namespace, target: Target, prefill_url: str | None,
            procs: dict[str, Proc]) -> dict[str, Any]:
    """Every level also records each server's CPU seconds over its wall time (`cpu_s`): on a
    shared CPU host this shows who burns the cores (docs/pd.md "Concurrent PD requests on CPU")."""
    load0 = os.getloadavg()[0]
    target.call(lambda url, extra: http(url + "/generate", {"input_ids": prompt(2, args.prompt_len[0]),
                                                            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                                            **extra}, timeout=600))          # warm-up
    levels = []
    for plen, c in [(n, c) for n in args.prompt_len for c in args.concurrency]:
        before = transfer_metrics(prefill_url) if prefill_url else None
        cpu0 = {k: p.cpu_s() for k, p in procs.items()}
        level = {"prompt_len": plen, **run_level(target, c, args.rounds, plen, args.new_tokens, seed=10 * c + plen)}
        level["cpu_s"] = {k: round(p.cpu_s() - cpu0[k], 2) for k, p in procs.items()}
        if prefill_url:
            time.sleep(2)
            level["transfer"] = transfer_delta(before, transfer_metrics(prefill_url))
        levels.append(level)
        print(json.dumps({k: level[k] for k in ("prompt_len", "concurrency", "n_errors", "ttft_s", "itl_s", "output_tokens_per_s",
                                                "wall_s", "cpu_s")}), flush=True)
    out = {"levels": levels, "tool_call": tool_call(target)}
    out["loadavg_1m_start_end"] = [round(load0, 2), round(os.getloadavg()[0], 2)]    # the host is shared
    return out


def device_copy_gb_s(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth of GPU 0 (read + write counted once, as a transfer is): the
    ceiling the per-request KV transfer bandwidth is held against on a GPU."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    gb_s = nbytes * reps / (time.perf_counter() - t0) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gb_s


def save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write what is measured so far (a capped run that is stopped keeps its finished set-ups)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


def start_pd(args: argparse.Namespace, logs: Path) -> tuple[list[Proc], str, str, int]:
    """Prefill and decode servers (not waited for): processes, their URLs, the bootstrap port."""
    env = {"OMP_NUM_THREADS": str(args.pd_threads)} if args.pd_threads else None
    pport, dport, boot = free_port(), free_port(), free_port()
    pd = ["--disaggregation-transfer-backend", "mooncake"]
    procs = [serve(args, pport, logs / "prefill.log", [*pd, "--disaggregation-mode", "prefill",
                                                        "--disaggregation-bootstrap-port", str(boot)], env),
             serve(args, dport, logs / "decode.log", [*pd, "--disaggregation-mode", "decode"], env)]
    return procs, f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}", boot


def pd_target(args: argparse.Namespace, logs: Path, procs: list[Proc], P: str, D: str, boot: int) -> Target:
    """Wait for both PD servers, then start the router (appended to `procs`) unless `--no-router`."""
    wait_up(P + "/health", procs, args.startup_s)
    wait_up(D + "/health", procs, args.startup_s)
    if args.no_router:
        return Target(D, prefill=P, bootstrap_port=boot)
    rport = free_port()
    procs.append(Proc([sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host",
                       "127.0.0.1", "--port", str(rport), "--prefill", P, str(boot), "--decode", D,
                       "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port",
                       str(free_port())], logs / "router.log"))
    wait_up(f"http://127.0.0.1:{rport}/readiness", procs, args.startup_s)
    return Target(f"http://127.0.0.1:{rport}")


def run(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """The set-ups one after another; with `--start-together` every server starts at once (one
    start-up wait instead of two: a budgeted GPU call) and the set-ups are still measured one
    after another, each colocated server stopped before the PD part."""
    result: dict[str, Any] = {"device": args.device, "prompt_len": args.prompt_len,
                              "device_copy_gb_s": device_copy_gb_s() if args.device == "cuda" else None, "new_tokens": args.new_tokens,
                              "rounds": args.rounds, "concurrency": args.concurrency, "router": not args.no_router}
    result["pd_threads"] = args.pd_threads
    result["start_together"] = args.start_together
    colocated: list[Proc] = []
    pd_procs: list[Proc] = []
    try:
        if "colocated" in args.setups:
            port = free_port()
            colocated = [serve(args, port, logs / "colocated.log", [])]
        if "pd" in args.setups and args.start_together:
            pd_procs, P, D, boot = start_pd(args, logs)
        if colocated:
            wait_up(f"http://127.0.0.1:{port}/health_generate", colocated + pd_procs, args.startup_s)
            result["colocated"] = measure(args, Target(f"http://127.0.0.1:{port}"), None, {"colocated": colocated[0]})
            save(args, result)
            for p in colocated:
                p.stop()
        if "pd" not in args.setups:
            return result
        if not pd_procs:
            pd_procs, P, D, boot = start_pd(args, logs)
        target = pd_target(args, logs, pd_procs, P, D, boot)
        result["pd"] = measure(args, target, P, dict(zip(("prefill", "decode", "router"), pd_procs)))
        layout = http(f"http://127.0.0.1:{boot}{LAYOUT_ROUTE}", timeout=30)
        result["layout"] = layout
        result["kv_page_bytes_per_request"] = {n: math.ceil(n / layout["page_size"]) * sum(layout["kv_item_lens"])
                                               for n in args.prompt_len}
    finally:
        for p in colocated + pd_procs:
            p.stop()
    if "colocated" in result:
        result["tool_call_equal"] = result["pd"]["tool_call"] == result["colocated"]["tool_call"]
    return result


def plot(result: dict[str, Any], path: Path) -> str:
    """TTFT, ITL and throughput against concurrency, colocated vs PD; '' when written."""
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name in ("colocated", "pd"):
        if name not in result:
            continue
        for plen in result["prompt_len"]:
            lv = [x for x in result[name]["levels"] if x["prompt_len"] == plen]
            cs, label = [x["concurrency"] for x in lv], f"{name} {plen}"
            axes[0].plot(cs, [x["ttft_s"]["mean"] for x in lv], "o-", label=label)
            axes[1].plot(cs, [1e3 * (x["itl_s"]["mean"] or 0) for x in lv], "o-", label=label)
            axes[2].plot(cs, [x["output_tokens_per_s"] for x in lv], "o-", label=label)
    for ax, title in zip(axes, ("mean TTFT (s)", "mean ITL (ms)", "output tokens/s")):
        ax.set(xlabel="concurrency", title=title, xscale="log", xticks=result["concurrency"])
        ax.set_xticklabels([str(c) for c in result["concurrency"]])
        ax.minorticks_off()
        ax.legend()
    fig.suptitle(f"1P1D vs colocated, {result['device']}, prompts {result['prompt_len']}, "
                 f"{result['new_tokens']} new tokens" + ("" if result["router"] else " (no router)"))
    save_png(fig, path, dpi=110)
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="default: a tiny checkpoint made in a temp dir")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[256])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument (repeat)")
    ap.add_argument("--no-router", action="store_true", help="post to prefill and decode with bootstrap fields")
    ap.add_argument("--startup-s", type=float, default=600)
    ap.add_argument("--setups", nargs="+", default=["colocated", "pd"], choices=("colocated", "pd"))
    ap.add_argument("--start-together", action="store_true",
                    help="start every server at once (one start-up wait; the set-ups are still measured in turn)")
    ap.add_argument("--pd-threads", type=int, default=0,
                    help="OMP_NUM_THREADS of each PD server (0: unset; on CPU: cores / 2, docs/pd.md)")
    ap.add_argument("--out", type=Path, default=RESULTS / "pd_cpu.json")
    args = ap.parse_args(argv)

    def stop(signum, frame):                 # `timeout` sends SIGTERM: stop the servers, keep the JSON
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(os.environ.get("OUT", tmp))
        if args.checkpoint is None:
            args.checkpoint = Path(tmp) / "tiny"
            subprocess.run([sys.executable, "-m", "sglang_dsv41.cli", "make-checkpoint", "--preset", "tiny", "--out",
                            str(args.checkpoint), "--quiet"], check=True, timeout=300)
        t0 = time.perf_counter()
        load0 = os.getloadavg()
        result = run(args, logs)
        result["wall_s"] = time.perf_counter() - t0
        # a shared host's load moves both set-ups' numbers: record it with the date
        result["host"] = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpus": os.cpu_count(),
                          "loadavg_1m_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)]}
    note = plot(result, args.out.with_suffix(".png"))
    result["png"] = note or args.out.with_suffix(".png").name
    save(args, result)
    errors = sum(x["n_errors"] for k in ("colocated", "pd") if k in result for x in result[k]["levels"])
    print(json.dumps({"wall_s": result["wall_s"], "errors": errors, "tool_call_equal": result.get("tool_call_equal"),
                      "kv_page_bytes_per_request": result.get("kv_page_bytes_per_request"),
                      "transfer": [x.get("transfer") for x in result.get("pd", {}).get("levels", [])],
                      "png": result["png"]}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
