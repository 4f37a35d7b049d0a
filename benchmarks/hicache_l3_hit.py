"""What one L3 (file) hit costs after a restart, and where its time goes (docs/hicache.md "What an L3
hit costs"; issue 14).

Server A (`--hicache-storage-backend file`, write_through, page 64, `wait_complete`) serves each
prompt P + s_j cold (storage and caches cleared first) and writes P's pages; A is stopped. Then, per
`--variant LABEL=DIR[@VAR=VALUE,...]` (DIR: a plugin checkout put first on the servers' PYTHONPATH,
`.` = this one; VAR=VALUE: environment of that server B only), a server B on the same directory: a warm-up prompt, then per j a `/flush_cache` and P + s_j
(an L3 hit: `cached_tokens_details.storage`), then P + s_j again (a device hit of the same prompt).
Both must equal A's cold output (greedy). The JSON has per request the TTFT and tier, per variant
the medians, and B's prefetch timeline lines (`runtime/hicache_prefetch.py`; variants without it
have none).

Roofline, in this process, on the same page files: a plain read of every file (open / readinto),
and one batch of KV pages through `HiCacheFile` by SGLang's generic page get and by the plugin's
batched one, alone and beside a thread that spins in Python (the scheduler loop's stand-in: it
keeps the GIL until the switch interval forces it to give it up).

    python benchmarks/hicache_l3_hit.py --model-path /tmp/tiny --tokens 8192 --reps 3 \\
        --variant before=/tmp/base --variant after=.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hicache_prefix import flush, storage_settled  # noqa: E402
from serving_client import Proc, free_port, http, stream_generate, wait_up  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
PAGE = 64


def server(args, store: Path, name: str, pythonpath: Path | None, extra_env: dict[str, str] | None = None) -> tuple[Proc, str]:
    port = free_port()
    need = -(-int((args.tokens + 2 * PAGE + args.new_tokens) * 1.1) // PAGE) * PAGE
    argv = [sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", args.device, "--model-path", args.model_path,
            "--port", str(port), "--max-total-tokens", str(need), "--enable-cache-report", "--enable-metrics",
            "--enable-hierarchical-cache", "--hicache-write-policy", "write_through", "--hicache-storage-backend", "file",
            "--page-size", str(PAGE), "--hicache-storage-prefetch-policy", "wait_complete",
            "--context-length", str(max(16384, 1 << (args.tokens + 2 * PAGE).bit_length())), *args.flags.split()]
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store), "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    if pythonpath is not None:                 # first on the path: no cwd entry before it (-m would put one)
        env.update(PYTHONPATH=str(pythonpath), PYTHONSAFEPATH="1")
    env.update(extra_env or {})
    proc = Proc(argv, args.log_dir / f"{args.out.stem}_{name}.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url + "/health_generate", [proc], args.startup_timeout)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def plugin_file(pythonpath: Path) -> str:
    """Where a server started with `pythonpath` imports the plugin from (checks the variant is the one meant)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONSAFEPATH": "1"}
    return subprocess.run([sys.executable, "-c", "import sglang_dsv41; print(sglang_dsv41.__file__)"], env=env,
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()


def ask(url: str, ids: list[int], args, **tags) -> dict:
    out = stream_generate(url, ids, args.new_tokens, {}, timeout=args.request_timeout, keep_last=True)
    meta = out["last"]["meta_info"]
    row = {**tags, "ttft_s": out["ttft_s"], "cached_tokens": int(meta.get("cached_tokens", 0)),
           "cached_details": meta.get("cached_tokens_details") or {}, "output_ids": out["last"]["output_ids"]}
    print(json.dumps({k: v for k, v in row.items() if k != "output_ids"}), flush=True)
    return row


def prefetch_lines(log: Path) -> list[str]:
    return [ln.split("HiCache: prefetch ", 1)[1].strip() for ln in log.read_text(errors="replace").splitlines()
            if "sglang-dsv41 HiCache: prefetch req=" in ln]


def plain_read(files: list[Path], reps: int = 5) -> dict:
    """Best of `reps` passes of open + readinto over `files` (the page cache is warm)."""
    buf = bytearray(max(f.stat().st_size for f in files))
    sizes = [f.stat().st_size for f in files]
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for f, n in zip(files, sizes):
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(memoryview(buf)[:n])
        best = min(best, time.perf_counter() - t)
    return {"files": len(files), "bytes": sum(sizes), "best_s": best, "gbps": sum(sizes) / best / 1e9}


def page_get_roofline(model_path: str, pages: int, reps: int = 5) -> dict:
    """µs per KV page of one batch of `pages` pages (the tiny model's KV row widths) through SGLang's
    `HiCacheFile` in a temp dir: SGLang's generic page get vs the plugin's, alone and beside a spinner."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController, PrefetchOperation

    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.hicache_faults import FaultLog
    from sglang_dsv41.runtime.hicache_host import ComponentHostPool
    from sglang_dsv41.runtime.hicache_prefetch import V41CacheController
    from sglang_dsv41.runtime.kv_layout import CompressedRowLayout

    lay = CompressedRowLayout.from_config(DeepseekV41Config.from_file(Path(model_path)).text)
    size = 2 * pages * PAGE
    comp = SimpleNamespace(buffers=[torch.randint(0, 256, (size + PAGE, w), dtype=torch.uint8)
                                    for w in (lay.latent_row_stride, lay.key_row_stride)],
                           size=size, page_size=PAGE, layer_num=1, device="cpu", store_dtype=torch.uint8,
                           start_layer=0, end_layer=0, allocation_label="kv", layer_shard_enabled=False)
    host = ComponentHostPool(comp, ratio=1.0, host_size_gb=0.0, page_size=PAGE, label="kv")
    for h in host.kv_buffer:
        h.copy_(torch.randint(0, 256, h.shape, dtype=torch.uint8))
    out: dict = {"pages": pages, "page_bytes": host.page_bytes}
    with tempfile.TemporaryDirectory(prefix="l3_roofline_") as d:
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                   is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                   model_name="roofline")
        store = HiCacheFile(cfg, file_path=d)
        keys = [f"page{i:06d}" for i in range(pages)]
        for i, k in enumerate(keys):
            assert store.set(k, host.get_data_page(i * PAGE))
        ctl = object.__new__(V41CacheController)
        ctl.page_size, ctl.storage_backend = PAGE, store
        ctl.mem_pool_host = SimpleNamespace(anchor_entry=SimpleNamespace(host_pool=host),
                                            get_dummy_flat_data_page=host.get_dummy_flat_data_page,
                                            set_from_flat_data_page=host.set_from_flat_data_page)
        ctl.storage_faults = FaultLog("roofline", 0, 3600)
        ways = {"sglang_generic": HybridCacheController._generic_page_get, "plugin_batched": V41CacheController._generic_page_get}
        dst = torch.arange(pages * PAGE, 2 * pages * PAGE)

        def once(fn) -> float:
            op = PrefetchOperation("roofline", list(range(pages * PAGE)))
            t = time.perf_counter()
            fn(ctl, op, keys, dst)
            dt = time.perf_counter() - t
            assert op.completed_tokens == pages * PAGE
            return dt / pages * 1e6

        stop = threading.Event()

        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        for beside in (False, True):
            th = threading.Thread(target=spin, daemon=True) if beside else None
            if th:
                stop.clear()
                th.start()
                time.sleep(0.05)
            runs = {w: [] for w in ways}
            for _ in range(reps):
                for w, fn in ways.items():
                    runs[w].append(once(fn))
            if th:
                stop.set()
                th.join()
            out["beside_spinner" if beside else "alone"] = {
                w: {"median_us_per_page": statistics.median(v), "min": min(v), "max": max(v)} for w, v in runs.items()}
        for i in range(pages):
            assert torch.equal(host.get_data_page((pages + i) * PAGE), host.get_data_page(i * PAGE))
    out["switch_interval_s"] = sys.getswitchinterval()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=8192, help="prefix P (a multiple of the page)")
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR[@VAR=VALUE,...]",
                   help="server B's plugin checkout (first on PYTHONPATH; '.' = this one) and its own environment "
                        "(e.g. after=.@SGLANG_DSV41_HICACHE_PREFETCH_WAIT_MS=0); repeatable")
    p.add_argument("--flags", default="--hicache-io-backend direct --hicache-ratio 4 --swa-full-tokens-ratio 1.0")
    p.add_argument("--roofline-pages", type=int, default=512)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=RESULTS / "hicache_l3_hit.json")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args(argv)
    variants, envs = [], {}
    for v in args.variant or ["after=."]:
        label, _, rest = v.partition("=")
        path, _, extra = rest.partition("@")
        variants.append((label, Path(path).resolve()))
        envs[label] = dict(kv.split("=", 1) for kv in extra.split(",") if kv)
    plugins = {label: plugin_file(path) for label, path in variants}
    for label, path in variants:
        if not plugins[label].startswith(str(path) + os.sep):
            raise SystemExit(f"variant {label}: the plugin imports from {plugins[label]}, not {path}")
    rng = random.Random(0)
    prefix = [0] + [rng.randrange(3, 990) for _ in range(args.tokens - 1)]
    prompts = [prefix + [rng.randrange(3, 990) for _ in range(args.suffix_tokens)] for _ in range(args.reps)]
    warm = [[0] + [rng.randrange(3, 990) for _ in range(200)] for _ in range(len(variants) + 1)]
    rows: list[dict] = []
    lines: dict[str, list[str]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hicache_l3_hit_") as d:
        store = Path(d)
        proc, url = server(args, store, "a", None)
        try:
            ask(url, warm[0], args, server="a", case="warmup")
            for j, ids in enumerate(prompts):
                http(url + "/clear_hicache_storage_backend", {}, timeout=60)
                flush(url)
                rows.append(ask(url, ids, args, server="a", case="cold", prompt=j))
            files = storage_settled(store, 2.0, 600)
        finally:
            proc.stop()
        for k, (label, path) in enumerate(variants):
            proc, url = server(args, store, f"b_{label}", path, envs[label])
            try:
                ask(url, warm[k + 1], args, server=label, case="warmup")
                for j, ids in enumerate(prompts):
                    storage_settled(store, 1.0, 120)
                    flush(url)
                    rows.append(ask(url, ids, args, server=label, case="l3", prompt=j))
                    rows.append(ask(url, ids, args, server=label, case="device", prompt=j))
            finally:
                proc.stop()
            lines[label] = prefetch_lines(args.log_dir / f"{args.out.stem}_b_{label}.log")
        bins = sorted(store.glob("*.bin"))
        roof = {"all_files": plain_read(bins), "kv_files": plain_read([f for f in bins if ".swa_" not in f.name])}
    roof["page_get"] = page_get_roofline(args.model_path, args.roofline_pages)
    cold = {r["prompt"]: r["output_ids"] for r in rows if r["case"] == "cold"}
    want = {"l3": "storage", "device": "device"}
    summary, ok = {}, True
    for label, _ in variants:
        summary[label] = {}
        for case, tier in want.items():
            rs = [r for r in rows if r["server"] == label and r["case"] == case]
            good = [r["cached_details"].get(tier, 0) == args.tokens and r["output_ids"] == cold[r["prompt"]] for r in rs]
            ok &= all(good) and len(rs) == args.reps
            summary[label][case] = {"ttft_ms": [round(r["ttft_s"] * 1e3, 1) for r in rs],
                                    "median_ms": round(statistics.median(r["ttft_s"] for r in rs) * 1e3, 1),
                                    "from_tier_and_equal_to_cold": f"{sum(good)}/{len(rs)}"}
        l3, dev = summary[label]["l3"]["median_ms"], summary[label]["device"]["median_ms"]
        summary[label]["l3_minus_device_ms"] = round(l3 - dev, 1)
    cold_ms = statistics.median(r["ttft_s"] for r in rows if r["case"] == "cold") * 1e3
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(time.monotonic() - t0, 1),
              "plugin_files": plugins, "variant_env": envs, "files_written": files, "cold_median_ms": round(cold_ms, 1), "summary": summary,
              "prefetch_timeline": lines, "roofline": roof, "ok": ok,
              "requests": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"cold_median_ms": result["cold_median_ms"], "summary": summary, "roofline": roof}, indent=1))
    for label, ls in lines.items():
        for ln in ls:
            print(label, ln)
    print("->", args.out, "ok" if ok else "FAILED (a hit not from its tier or not equal to cold)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
