"""HiCache prefix benchmark: time to first token on one long shared prefix P, cold vs served from
each tier (issue 14 "Benchmark"; docs/hicache.md "Benchmark: one long prefix by tier").

One storage directory (a temp dir), servers with `--enable-hierarchical-cache`, write_through,
`--hicache-storage-backend file` and a device pool just big enough for one long prompt:

* **cold**: before each request `/clear_hicache_storage_backend` + `/flush_cache` (device, host and
  storage empty), then P + suffix; every prompt the hit cases send is first served cold here, so
  each hit is compared with the cold greedy output of the same prompt;
* **gpu**: P + a new suffix, P still on the device;
* **l2**: one other prompt as long as P pushes P off the device (it stays on the host), then P + a
  new suffix; the tier is SGLang's ``cached_tokens_details`` (``host``);
* **l3**: server A is stopped, server B starts on the same directory; before each request
  `/flush_cache` (device and host empty, storage kept), then P + a new suffix (``storage``).

Also (docs/hicache.md "What a hit costs"): `--hit-lengths L ...` first measures, on server A, a full
device hit by prompt length (a fresh prompt cold, then the same prompt again: the cost every hit pays,
transfer or not) and fits TTFT = fixed + slope · L; `--hit-cost-only` runs only that. `net_of_hit` in
the JSON: each tier's TTFT less the device hit's, against cold less the same. `--dummy-flash LAYERS`
serves a Flash-width model with dummy weights from a config-only `--model-path` (made there), so the
cold prefill is a realistic one (the tiny checkpoint's is a few hundred ms at 32K on the H200).

Each server first answers one short unrelated prompt (first-use costs stay out of the cases).
Each case runs `--reps` times; the summary has the median TTFT, its ratio to cold, the cached tokens
by tier and the greedy equality. Host-tier bandwidth: from SGLang's ``sglang:load_back_*`` metrics
when they carry durations (CUDA events), else (bytes of P's KV) / (TTFT l2 − TTFT gpu); divided by a
pinned host→device copy measured in the same run (on CPU: a memory copy). JSON + PNG:

    python benchmarks/hicache.py --mode prefix --model-path /tmp/tiny --device cpu --prefix-tokens 3072
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import Proc, free_port, http, stream_generate, wait_up  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("cold", "gpu", "l2", "l3", "push")   # push: the l2 phase's other prompts, cold without a flush
GOALS = {"l2": 0.10, "l3": 0.25}          # TTFT relative to cold (issue 14)
TIER = {"gpu": "device", "l2": "host", "l3": "storage"}
METRICS = ("sglang:load_back_duration_seconds_sum", "sglang:load_back_duration_seconds_count",
           "sglang:load_back_tokens_total")


def kv_bytes(model_path: str, page_size: int | None = None) -> dict:
    """Bytes per token of the mirrored rows (docs/hicache.md "Sizing") and the SWA rows one load-back
    restores (the window rounded up to a page); `page_size` None: the plugin's default."""
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.hicache_swa_bound import swa_restore_bound
    from sglang_dsv41.runtime.kv_layout import CompressedRowLayout
    from sglang_dsv41.runtime.requirements import PAGE_SIZE

    cfg = DeepseekV41Config.from_file(Path(model_path)).text
    page = page_size or PAGE_SIZE
    lay = CompressedRowLayout.from_config(cfg)
    return {"global_per_token": lay.latent_row_stride + lay.key_row_stride,
            "swa_per_token": cfg.num_hidden_layers * cfg.head_dim * 2, "page": page,
            "swa_restore_rows": swa_restore_bound(cfg.sliding_window, page)}


def prefix_load_bytes(kv: dict, tokens: int) -> int:
    """What one load-back of a `tokens`-long prefix moves: every global row, one window of SWA rows."""
    return tokens * kv["global_per_token"] + min(tokens, kv["swa_restore_rows"]) * kv["swa_per_token"]


def copy_bandwidth(device: str, mib: int = 256, reps: int = 5) -> dict:
    """Best of `reps` copies of `mib` MiB: pinned host -> device and back on CUDA (events), a host
    memory copy (`torch.Tensor.copy_`) on CPU. GB/s (1e9 B/s)."""
    import torch

    n = mib << 20
    if device == "cpu":
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
        return {"kind": "host memcpy (torch copy_)", "bytes": n, "h2d_gbps": n / best / 1e9, "d2h_gbps": n / best / 1e9}
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {"kind": "pinned host <-> device (torch copy_, non_blocking, CUDA events)", "bytes": n}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        best = float("inf")
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3)
        out[name] = n / best / 1e9
    return out


def scrape(url: str) -> dict[str, float]:
    """The `METRICS` series of `/metrics`, summed over labels (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def storage_settled(store: Path, quiet_s: float, cap_s: float) -> int:
    """Wait until no page file was added for `quiet_s` (the write-through backups are done); the count."""
    deadline, last, since = time.monotonic() + cap_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = sum(1 for p in store.iterdir() if p.suffix == ".bin")
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return n
        time.sleep(0.2)
    raise TimeoutError(f"storage still growing after {cap_s} s ({last} pages)")


def flush(url: str, cap_s: float = 120) -> None:
    """`/flush_cache` until SGLang accepts it (it refuses while requests or transfers are pending)."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        try:
            http(url + "/flush_cache", {}, timeout=60)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"/flush_cache refused for {cap_s} s")


def ask(url: str, case: str, key: str, ids: list[int], args: argparse.Namespace) -> dict:
    out = stream_generate(url, ids, args.new_tokens, {}, timeout=args.request_timeout, keep_last=True)
    meta = out["last"]["meta_info"]
    return {"case": case, "prompt": key, "prompt_tokens": len(ids), "ttft_s": out["ttft_s"],
            "cached_tokens": int(meta.get("cached_tokens", 0)), "cached_details": meta.get("cached_tokens_details") or {},
            "output_ids": out["last"]["output_ids"]}


class Run:
    """The prompts of one run and the servers' common arguments."""

    def __init__(self, args: argparse.Namespace, store: Path) -> None:
        self.args, self.store = args, store
        rng = random.Random(args.seed)
        ids = lambda n: [rng.randrange(3, args.vocab) for _ in range(n)]  # noqa: E731
        self.prefix = [0] + ids(args.prefix_tokens - 1)
        self.suffix = {f"{c}{j}": ids(args.suffix_tokens) for c in ("gpu", "l2", "l3") for j in range(args.reps)}
        self.suffix["last"] = ids(args.suffix_tokens)      # the last cold prompt: P stays cached and stored
        self.pushers = [[0] + ids(args.prefix_tokens + args.suffix_tokens - 1) for _ in range(args.reps)]
        # full length: every chunk shape of a prompt is compiled before the first measured request
        self.warmups = [[0] + ids(args.prefix_tokens + args.suffix_tokens - 1) for _ in range(2)]
        self.rows: list[dict] = []          # every answered request, in order (kept when a run is cut short)
        self.l2_metrics: dict[str, float] = {}
        self.unsettled: list[dict] = []     # settles that hit --settle-cap-s (`settle`)

    def prompt(self, key: str) -> list[int]:
        return self.prefix + self.suffix[key]

    def start(self, name: str) -> tuple[Proc, str]:
        """One server process on the run's storage directory (not waited for)."""
        a = self.args
        port = free_port()
        argv = [sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", a.device, "--model-path", a.model_path,
                "--port", str(port), "--max-total-tokens", str(a.device_tokens), "--enable-cache-report",
                "--enable-metrics", "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
                "--hicache-storage-backend", "file",
                *(["--page-size", str(a.page_size)] if a.page_size else []), *a.flags.split()]
        proc = Proc(argv, a.log_dir / f"{a.out.stem}_{name}.log", env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.store)})
        return proc, f"http://127.0.0.1:{port}"

    def up(self, server: tuple[Proc, str]) -> tuple[Proc, str]:
        try:
            wait_up(server[1] + "/health_generate", [server[0]], self.args.startup_timeout)
        except BaseException:
            server[0].stop()
            raise
        return server

    def settle(self, scale: float = 1.0) -> None:
        """Wait for the storage directory to stop growing (quiet for settle_s × scale). A storage still
        growing at --settle-cap-s is recorded in `unsettled` (page files then) and the run goes on: the
        next case's tier tokens and cold checks tell whether it mattered."""
        try:
            storage_settled(self.store, self.args.settle_s * scale, self.args.settle_cap_s)
        except TimeoutError as e:
            self.unsettled.append({"after_requests": len(self.rows), "error": str(e)})
            print(f"warning: {e}; going on", file=sys.stderr)


def ask_cold(run: Run, url: str, key: str, tries: int = 3) -> dict:
    """A cold run of prompt `key`: storage settled and cleared, device and host flushed. A backup still
    on its way when the storage was cleared can land after the clear and turn the run into an L3 hit
    (cached tokens > 0: seen on the H200 with a Flash-width model, session 16); such a run is
    discarded and the clear repeated after a longer settle, up to `tries` times. The row counts the
    discarded runs (`cold_retries`); the summary's `all_cold` still tells whether the last was cold."""
    for attempt in range(tries):
        run.settle(scale=1 + attempt)
        http(url + "/clear_hicache_storage_backend", {}, timeout=60)
        flush(url)
        row = ask(url, "cold", key, run.prompt(key), run.args)
        row["cold_retries"] = attempt
        if row["cached_tokens"] == 0:
            break
    return row


def run_a(run: Run, server: tuple[Proc, str]) -> None:
    """Server A: cold (every hit prompt, then `last`), gpu, l2; A stopped. Also the load-back metric
    deltas of the l2 phase (`run.l2_metrics`)."""
    a, rows = run.args, run.rows
    proc, url = server
    try:
        rows.append(ask(url, "warmup", "warmup_a", run.warmups[0], a))   # first-use costs (kernel builds)
        if a.hit_lengths:
            hit_cost(run, url)
        for key in [k for k in run.suffix if k != "last"] + ["last"]:
            rows.append(ask_cold(run, url, key))
        for j in range(a.reps):
            run.settle()
            rows.append(ask(url, "gpu", f"gpu{j}", run.prompt(f"gpu{j}"), a))
        before = scrape(url)
        for j in range(a.reps):
            rows.append(ask(url, "push", f"push{j}", run.pushers[j], a))
            run.settle()
            rows.append(ask(url, "l2", f"l2{j}", run.prompt(f"l2{j}"), a))
        after = scrape(url)
        run.l2_metrics = {k: after[k] - before[k] for k in METRICS}
        run.settle()
    finally:
        proc.stop()


def run_b(run: Run, server: tuple[Proc, str]) -> None:
    """Server B on A's storage directory, used once A is stopped: l3, each after a flush of device
    and host."""
    rows = run.rows
    proc, url = server
    try:
        rows.append(ask(url, "warmup", "warmup_b", run.warmups[1], run.args))
        for j in range(run.args.reps):
            run.settle()
            flush(url)
            rows.append(ask(url, "l3", f"l3{j}", run.prompt(f"l3{j}"), run.args))
    finally:
        proc.stop()


def dummy_flash_dir(path: Path, layers: int) -> Path:
    """A config-only model of Flash widths and `layers` layers in `path` (config.json + tokenizer, no
    tensors: the server generates the weights, `--load-format dummy`); reused when its config already
    has that many layers."""
    cfg = path / "config.json"
    if cfg.is_file() and json.loads(cfg.read_text()).get("text_config", {}).get("num_hidden_layers") == layers:
        return path
    from sglang_dsv41.checkpoint.synth import make_config_dir

    return make_config_dir("slice", path, layers=layers, overwrite=True)


def hit_cost(run: Run, url: str) -> None:
    """A full device hit's TTFT by prompt length, no tier transfer involved: per `--hit-lengths` L,
    a fresh L-token prompt served cold (case ``hit_cold``), then the same prompt `--reps` times
    (case ``hit``: everything but its last partial page is on the device)."""
    a = run.args
    rng = random.Random(a.seed + 1)
    for n in a.hit_lengths:
        ids = [0] + [rng.randrange(3, a.vocab) for _ in range(n - 1)]
        run.settle()
        run.rows.append(ask(url, "hit_cold", f"hit{n}", ids, a))
        for _ in range(a.reps):
            run.settle()
            run.rows.append(ask(url, "hit", f"hit{n}", ids, a))
    if a.profile_hit and a.hit_lengths:
        run.settle()
        profile_hit(run, url, ids)


def profile_hit(run: Run, url: str, ids: list[int], cap_s: float = 90) -> None:
    """`--profile-hit`: SGLang's torch profiler (`/start_profile`, CPU + GPU activities, one step) over
    one more full hit of `ids` (case ``hit_profiled``, left out of the summaries); the trace's
    summary goes to `run.hit_profile` (`trace_summary`)."""
    a = run.args
    out = a.log_dir / f"{a.out.stem}_hit_trace"
    acts = ["CPU"] if a.device == "cpu" else ["CPU", "GPU"]
    http(url + "/start_profile", {"output_dir": str(out), "num_steps": 1, "activities": acts}, timeout=60)
    run.rows.append(ask(url, "hit_profiled", f"hit{len(ids)}", ids, a))
    deadline, traces = time.monotonic() + cap_s, []
    while time.monotonic() < deadline and not traces:
        time.sleep(2)
        traces = sorted(out.glob("**/*.json*")) if out.exists() else []
    time.sleep(3)                          # the exporter may still be writing the file it created
    run.hit_profile = ({"trace": str(traces[0]), **trace_summary(traces[0]), "ttft_ms": 1e3 * run.rows[-1]["ttft_s"]}
                       if traces else {"error": f"no trace in {out} within {cap_s} s"})


def trace_summary(path: Path, top: int = 20) -> dict:
    """A torch.profiler Chrome trace of one step: wall span of its CPU events, GPU kernel / copy busy
    time (sum of durations), and by summed duration (ms): the kernels, the CPU ops (``cpu_op``) and
    the Python functions of SGLang and the plugin (inclusive, so callers include their callees)."""
    import gzip
    from collections import defaultdict

    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    gpu_cats = ("kernel", "gpu_memcpy", "gpu_memset")
    cpu = [e for e in events if e.get("cat") not in gpu_cats]
    groups = {"top_gpu_ms": [e for e in events if e.get("cat") in gpu_cats],
              "top_cpu_ops_ms": [e for e in cpu if e.get("cat") == "cpu_op"],
              "top_python_ms": [e for e in cpu if e.get("cat") == "python_function"
                                and ("sglang_dsv41" in e.get("name", "") or "sglang/srt" in e.get("name", ""))]}
    out: dict = {"cpu_span_ms": (max(e["ts"] + e.get("dur", 0) for e in cpu) - min(e["ts"] for e in cpu)) / 1e3 if cpu else 0.0,
                 "gpu_busy_ms": sum(float(e.get("dur", 0.0)) for e in groups["top_gpu_ms"]) / 1e3,
                 "gpu_events": len(groups["top_gpu_ms"])}
    for key, evs in groups.items():
        acc: dict[str, float] = defaultdict(float)
        for e in evs:
            acc[e.get("name", "?")[:120]] += float(e.get("dur", 0.0)) / 1e3
        out[key] = dict(sorted(acc.items(), key=lambda kv: -kv[1])[:top])
    return out


def summarize_hit_cost(rows: list[dict]) -> dict:
    """Per length: median TTFT cold and on a full hit, cached tokens (min), greedy equality with the
    cold run; with two lengths or more, the least-squares line TTFT_hit = fixed + per_1k · L / 1024."""
    out: dict = {"by_length": {}}
    for n in sorted({r["prompt_tokens"] for r in rows if r["case"] == "hit"}):
        cold = [r for r in rows if r["case"] == "hit_cold" and r["prompt_tokens"] == n]
        hit = [r for r in rows if r["case"] == "hit" and r["prompt_tokens"] == n]
        out["by_length"][n] = {"cold_ms": 1e3 * median(r["ttft_s"] for r in cold) if cold else None,
                               "hit_ms_median": 1e3 * median(r["ttft_s"] for r in hit),
                               "hit_ms": [1e3 * r["ttft_s"] for r in hit],
                               "cached_tokens_min": min(r["cached_tokens"] for r in hit),
                               "greedy_equal": f"{sum(bool(cold) and r['output_ids'] == cold[0]['output_ids'] for r in hit)}"
                                               f"/{len(hit)}"}
    pts = [(n, d["hit_ms_median"]) for n, d in out["by_length"].items()]
    if len(pts) >= 2:
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out["fit"] = {"fixed_ms": my - slope * mx, "per_1k_tokens_ms": 1024 * slope}
    return out


def net_of_hit(summary: dict) -> dict:
    """Each tier's TTFT less the device hit's (the overhead every hit pays, transfer or not) against
    cold less the same: the share of the saved prefill a tier gives back."""
    c = summary["cases"]
    if "gpu" not in c or "cold" not in c:
        return {}
    base, cold = c["gpu"]["ttft_ms_median"], c["cold"]["ttft_ms_median"]
    out = {"hit_overhead_ms": base, "hit_overhead_vs_cold": base / cold}
    for t in ("l2", "l3"):
        if t in c and cold > base:
            out[f"{t}_net_vs_cold_net"] = (c[t]["ttft_ms_median"] - base) / (cold - base)
    return out


def hit_cost_ok(hc: dict, page_size: int | None) -> bool:
    """Every hit-cost repeat equals its cold run and hit all of its prompt but the last page
    (`page_size` None: the plugin's default page with a storage backend)."""
    from sglang_dsv41.runtime.requirements import STORAGE_PAGE_SIZE

    page = page_size or STORAGE_PAGE_SIZE
    return all(d["greedy_equal"] == f"{len(d['hit_ms'])}/{len(d['hit_ms'])}" and d["cached_tokens_min"] >= n - page
               for n, d in hc["by_length"].items())


def hit_table(hc: dict, net: dict) -> str:
    lines = ["hit cost: length  cold_ms  hit_ms(median)  cached_min  greedy_equal"]
    for n, d in hc["by_length"].items():
        cold = "-" if d["cold_ms"] is None else f"{d['cold_ms']:.1f}"
        lines.append(f"          {n:6d} {cold:>8} {d['hit_ms_median']:15.1f} {d['cached_tokens_min']:11d} {d['greedy_equal']:>13}")
    if "fit" in hc:
        lines.append(f"          fit: hit TTFT = {hc['fit']['fixed_ms']:.1f} ms + {hc['fit']['per_1k_tokens_ms']:.2f} ms per 1K tokens")
    if net:
        lines.append("net of the device hit: " + ", ".join(f"{k} {v:.3g}" for k, v in net.items()))
    return "\n".join(lines)


def profile_line(prof: dict | None) -> str:
    if not prof:
        return "hit profile: not taken"
    if "error" in prof:
        return f"hit profile: {prof['error']}"
    return (f"hit profile (one step): TTFT {prof['ttft_ms']:.1f} ms, CPU span {prof['cpu_span_ms']:.1f} ms, "
            f"GPU busy {prof['gpu_busy_ms']:.1f} ms in {prof['gpu_events']} kernels/copies; top CPU ops: "
            + "; ".join(f"{k} {v:.1f}" for k, v in list(prof["top_cpu_ops_ms"].items())[:5]))


def run_hit_cost_only(run: Run) -> None:
    """`--hit-cost-only`: server A answers the warm-up and the hit-cost phase, nothing else."""
    proc, url = run.up(run.start("a"))
    try:
        run.rows.append(ask(url, "warmup", "warmup_a", run.warmups[0], run.args))
        hit_cost(run, url)
    finally:
        proc.stop()


def _sigterm(*_) -> None:
    raise SystemExit("SIGTERM")


def summarize(rows: list[dict], prefix_tokens: int, kv: dict, copy: dict, l2_metrics: dict) -> dict:
    """Per case: median TTFT, ratio to cold, cached tokens (min) and the tier's share, greedy equality
    with the cold run of the same prompt; the host-tier bandwidth and its fraction of the copy."""
    cold = {r["prompt"]: r["output_ids"] for r in rows if r["case"] == "cold"}
    ttft = {c: median(r["ttft_s"] for r in rows if r["case"] == c) for c in CASES if any(r["case"] == c for r in rows)}
    fastest = {c: min(r["ttft_s"] for r in rows if r["case"] == c) for c in ttft}
    cases = {}
    for c, t in ttft.items():
        rs = [r for r in rows if r["case"] == c]
        d = {"requests": len(rs), "ttft_ms_median": 1e3 * t, "ttft_ms": [1e3 * r["ttft_s"] for r in rs],
             "ttft_vs_cold": t / ttft["cold"], "ttft_ms_min": 1e3 * fastest[c],
             "ttft_min_vs_cold_min": fastest[c] / fastest["cold"], "cached_tokens_min": min(r["cached_tokens"] for r in rs),
             "cached_tokens_max": max(r["cached_tokens"] for r in rs)}
        if c in ("cold", "push"):
            d["all_cold"] = d["cached_tokens_max"] == 0
        else:
            tier = TIER[c]
            d["tier"] = tier
            d["tier_tokens_min"] = min(int(r["cached_details"].get(tier, 0)) for r in rs)
            d["prefix_from_tier"] = d["tier_tokens_min"] >= prefix_tokens - kv["page"]
            d["greedy_equal"] = f"{sum(r['output_ids'] == cold[r['prompt']] for r in rs)}/{len(rs)}"
            if c in GOALS:
                d["goal_vs_cold"], d["meets_goal"] = GOALS[c], d["ttft_vs_cold"] <= GOALS[c]
        cases[c] = d
    bw = {"prefix_load_bytes": prefix_load_bytes(kv, prefix_tokens), "copy": copy}
    dur, n = l2_metrics.get("sglang:load_back_duration_seconds_sum", 0.0), l2_metrics.get("sglang:load_back_duration_seconds_count", 0.0)
    tokens = l2_metrics.get("sglang:load_back_tokens_total", 0.0)
    if dur > 0 and n > 0:
        moved = tokens * kv["global_per_token"] + n * kv["swa_restore_rows"] * kv["swa_per_token"]
        bw.update(source="sglang:load_back_duration_seconds / load_back_tokens_total (l2 phase)",
                  gbps=moved / dur / 1e9, load_backs=n, seconds=dur, bytes=moved)
    elif "l2" in ttft and "gpu" in ttft and ttft["l2"] > ttft["gpu"]:
        bw.update(source="prefix KV bytes / (median TTFT l2 - median TTFT gpu)",
                  gbps=bw["prefix_load_bytes"] / (ttft["l2"] - ttft["gpu"]) / 1e9)
    else:
        bw.update(source="none: no load-back durations and TTFT l2 <= TTFT gpu", gbps=None)
    bw["fraction_of_copy_h2d"] = bw["gbps"] / copy["h2d_gbps"] if bw["gbps"] else None
    return {"cases": cases, "host_tier_bandwidth": bw, "l2_load_back_metrics": l2_metrics}


def plot(result: dict, path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed"

    cases = result["summary"]["cases"]
    names = [c for c in CASES if c in cases and c != "push"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    for off, key, ratio, label in ((-0.2, "ttft_ms_median", "ttft_vs_cold", "median"),
                                   (0.2, "ttft_ms_min", "ttft_min_vs_cold_min", "fastest")):
        bars = ax.bar([x + off for x in xs], [cases[c][key] for c in names], width=0.4, label=label,
                      alpha=1.0 if label == "median" else 0.5, color=["#888", "#2a7", "#27c", "#c72"][:len(names)])
        for b, c in zip(bars, names):
            ax.annotate(f"{100 * cases[c][ratio]:.0f} %", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
    for c, goal in GOALS.items():
        if c in cases:
            x = names.index(c)
            ax.hlines(goal * cases["cold"]["ttft_ms_median"], x - 0.4, x, colors="k", linestyles="--", linewidth=1)
    ax.set_xticks(list(xs), names)
    ax.legend(title="TTFT (% of cold's)", fontsize=8)
    ax.set(ylabel="TTFT (ms); dashed: goal", title=result["title"])
    ax.title.set_fontsize(8)
    ax.grid(axis="y", alpha=0.3)
    save_png(fig, path, dpi=110)
    return str(path)


def table(summary: dict) -> str:
    lines = ["case  ttft_ms(median)  vs_cold  ttft_ms(min)  min_vs_cold_min  cached_min  tier_tokens_min  greedy_equal  goal"]
    for c, d in summary["cases"].items():
        goal = f"<= {d['goal_vs_cold']:.0%}: {'met' if d['meets_goal'] else 'MISSED'}" if "goal_vs_cold" in d else ""
        lines.append(f"{c:5} {d['ttft_ms_median']:15.1f} {d['ttft_vs_cold']:8.1%} {d['ttft_ms_min']:13.1f} "
                     f"{d['ttft_min_vs_cold_min']:16.1%} {d['cached_tokens_min']:11d} "
                     f"{d.get('tier_tokens_min', ''):>16} {d.get('greedy_equal', ''):>13}  {goal}")
    bw = summary["host_tier_bandwidth"]
    frac = bw["fraction_of_copy_h2d"]
    lines.append(f"host tier {bw['gbps'] or 0:.2f} GB/s ({bw['source']}); copy {bw['copy']['h2d_gbps']:.1f} GB/s; "
                 f"fraction {frac if frac is None else f'{frac:.1%}'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix-tokens", type=int, default=32768)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device-tokens", type=int, default=None,
                   help="--max-total-tokens; default: the longest prompt (prefix + suffix, or a --hit-lengths one) + new tokens + two pages + 10 %% (one long prompt fits)")
    p.add_argument("--flags", default="--hicache-io-backend direct --hicache-ratio 4 --swa-full-tokens-ratio 1.0 "
                                      "--hicache-storage-prefetch-policy wait_complete",
                   help="further server flags (e.g. --context-length for a 32K prefix on the tiny checkpoint)")
    p.add_argument("--start-b-with-a", action="store_true",
                   help="start server B together with A (one start-up wait) instead of after A stops; B still "
                        "serves only after A is stopped, from storage alone")
    p.add_argument("--page-size", type=int, default=None,
                   help="SGLang --page-size of both servers (default: the plugin's); the file tier stores one object per page")
    p.add_argument("--vocab", type=int, default=990, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-s", type=float, default=1.0, help="storage quiet time before a measured request")
    p.add_argument("--settle-cap-s", type=float, default=120)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--dummy-flash", type=int, default=0, metavar="LAYERS",
                   help="serve a Flash-width model of LAYERS layers with dummy weights: --model-path is (made as) "
                        "its config-only directory, --load-format dummy is added (a realistic cold prefill)")
    p.add_argument("--hit-lengths", type=int, nargs="*", default=[],
                   help="before the cases, on server A: per length a fresh prompt cold, then the same prompt "
                        "--reps times (a full device hit's TTFT by length: the per-request cost of any hit)")
    p.add_argument("--profile-hit", action="store_true",
                   help="after the hit-cost phase, one more hit of the last length under SGLang's torch profiler "
                        "(/start_profile, one step): its CPU span and GPU busy time in the JSON (`hit_profile`)")
    p.add_argument("--hit-cost-only", action="store_true", help="only server A's warm-up and the --hit-lengths phase")
    p.add_argument("--out", type=Path, default=RESULTS / "hicache_prefix.json")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()), help="server logs")
    args = p.parse_args(argv)
    if args.device_tokens is None:
        need = max([args.prefix_tokens, *args.hit_lengths]) + args.suffix_tokens + args.new_tokens + 2 * (args.page_size or 2)
        args.device_tokens = -(-int(need * 1.1) // 64) * 64
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.dummy_flash:
        dummy_flash_dir(Path(args.model_path), args.dummy_flash)
        args.flags += " --load-format dummy"
    kv, copy = kv_bytes(args.model_path, args.page_size), copy_bandwidth(args.device)
    signal.signal(signal.SIGTERM, _sigterm)   # a capped run still writes what it measured
    incomplete = None
    with tempfile.TemporaryDirectory(prefix="hicache_prefix_") as d:
        run = Run(args, Path(d))
        t0 = time.monotonic()
        try:
            if args.hit_cost_only:
                run_hit_cost_only(run)
            elif args.start_b_with_a:
                a_srv, b_srv = run.start("a"), run.start("b")
                try:
                    run.up(a_srv), run.up(b_srv)
                    run_a(run, a_srv)
                except BaseException:
                    a_srv[0].stop(), b_srv[0].stop()
                    raise
            else:
                run_a(run, run.up(run.start("a")))
                b_srv = run.up(run.start("b"))
            if not args.hit_cost_only:
                run_b(run, b_srv)
        except (Exception, SystemExit, KeyboardInterrupt) as e:
            incomplete = f"{type(e).__name__}: {e}"[:2000]
            print("incomplete:", incomplete[-600:], file=sys.stderr)
        wall = time.monotonic() - t0
    rows = run.rows
    hc = summarize_hit_cost(rows) if any(r["case"] == "hit" for r in rows) else None
    hc_ok = hc is None or hit_cost_ok(hc, args.page_size)
    if not any(r["case"] == "cold" for r in rows):
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "incomplete": incomplete,
                                        "hit_cost": hc, "hit_profile": getattr(run, "hit_profile", None),
                                        "requests": rows}, indent=1))
        if hc is None:
            return 2
        print(hit_table(hc, {}))
        print(profile_line(getattr(run, "hit_profile", None)))
        print("->", args.out)
        return 0 if incomplete is None and hc_ok else 1
    summary = summarize(rows, args.prefix_tokens, kv, copy, run.l2_metrics)
    result = {"title": f"{args.prefix_tokens}-token prefix + {args.suffix_tokens}-token suffixes, {args.device_tokens}-token "
                       f"device pool, {args.device}, {args.reps} per hit case",
              "args": {k: str(v) for k, v in vars(args).items()}, "kv_bytes": kv, "wall_s": wall, "incomplete": incomplete,
              "unsettled": run.unsettled, "summary": summary, "hit_cost": hc, "net_of_hit": net_of_hit(summary),
              "hit_profile": getattr(run, "hit_profile", None), "requests": rows}
    result["png"] = plot(result, args.out.with_suffix(".png"))
    args.out.write_text(json.dumps(result, indent=1))
    print(table(summary))
    if run.unsettled:
        print(f"unsettled: {len(run.unsettled)} storage settle(s) hit the {args.settle_cap_s:.0f} s cap; "
              f"last: {run.unsettled[-1]['error']}")
    if hc is not None or result["net_of_hit"]:
        print(hit_table(hc or {"by_length": {}}, result["net_of_hit"]))
        print(profile_line(result["hit_profile"]))
    print("->", args.out)
    ok = incomplete is None and hc_ok and all(d.get("greedy_equal", "1/1").split("/")[0] == d.get("greedy_equal", "1/1").split("/")[1]
             and d.get("prefix_from_tier", True) and d.get("all_cold", True) for d in summary["cases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
