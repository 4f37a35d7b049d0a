"""HiCache L3 write-through rate: how fast one long prompt's pages reach the `file` storage tier
(issue 14; docs/hicache.md "L3 write throughput").

One server (`sglang-dsv41 serve`, `--enable-hierarchical-cache`, write_through, `--hicache-storage-backend
file` on a temp directory) serves one prompt of `--prompt-tokens` random ids (1 new token); the
directory's page files are counted every `--poll-s` from the request's end until none was added for
`--quiet-s` (or `--cap-s` passed). Reported: KV and SWA page files, the time from the response to the
last file (writes also run during the prefill: `request_to_last_file_s` is from the request), files/s and prompt tokens/s (KV pages x page size / that time), and whether every KV page
arrived. `--fs-probe N` first times N writes of 3,072-byte page files through SGLang's `HiCacheFile`
alone (no server) in the storage directory's file system, once plainly and once beside a thread that
spins in Python (the GIL contention of a busy scheduler loop), at CPython's switch interval (5 ms) and at
the plugin's (`hicache_gil`): per-file cost without the server. The server's scheduler gets the plugin's
switch interval unless `SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=off` is in the environment. JSON
to `--out`:

    python benchmarks/hicache_l3_write.py --model-path /tmp/tiny --device cpu --prompt-tokens 3000 \
        --flags="--page-size 2"
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import Proc, free_port, http, wait_up  # noqa: E402

BASE_FLAGS = ("--enable-hierarchical-cache --hicache-write-policy write_through --hicache-storage-backend file "
              "--hicache-ratio 4 --swa-full-tokens-ratio 1.0 --enable-cache-report")


def fs_probe(root: Path, n: int, intervals_ms: tuple[float, ...] = (5.0, 0.2)) -> dict:
    """Microseconds per page file written by SGLang's `HiCacheFile.set` in `root`: alone, and beside a
    thread spinning in Python, at each CPython switch interval of `intervals_ms` (5 ms: CPython's
    default; 0.2 ms: the plugin's opt-in value, `hicache_gil.TRIAL_MS`)."""
    import threading

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="probe")
    page = torch.arange(3072, dtype=torch.int32).to(torch.uint8)
    out, saved = {}, sys.getswitchinterval()
    try:
        for ms in intervals_ms:
            sys.setswitchinterval(ms / 1e3)
            for mode in ("alone", "spinning_thread"):
                where = tempfile.mkdtemp(prefix=f"probe_{mode}_", dir=root)
                store = HiCacheFile(cfg, file_path=where)
                stop = threading.Event()

                def spin() -> None:
                    while not stop.is_set():
                        pass

                spinner = threading.Thread(target=spin, daemon=True)
                if mode != "alone":
                    spinner.start()
                t = time.perf_counter()
                for i in range(n):
                    store.set(f"{mode}{i}", page)
                key = f"{mode}_us_per_file" if ms == 5.0 else f"{mode}_us_per_file_switch_{ms:g}ms"
                out[key] = (time.perf_counter() - t) / n * 1e6
                stop.set()
                shutil.rmtree(where, ignore_errors=True)
    finally:
        sys.setswitchinterval(saved)
    return out


def switch_line(log: Path) -> str | None:
    """The server's `hicache_gil` log line (what the scheduler process's switch interval is)."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "switch interval" in x]
    return lines[-1][-220:] if lines else None


def count(store: Path) -> tuple[int, int]:
    """(KV page files, SWA page files) in `store`."""
    names = [p.name for p in store.iterdir() if p.name.endswith(".bin")]
    swa = sum(1 for n in names if ".swa_" in n)
    return len(names) - swa, swa


def watch(store: Path, t0: float, poll_s: float, quiet_s: float, cap_s: float) -> list[tuple[float, int, int]]:
    """(seconds since t0, KV files, SWA files) at each change, until quiet for `quiet_s` or `cap_s` passed."""
    trace, last, since = [], None, time.monotonic()
    while time.monotonic() - t0 < cap_s:
        now, c = time.monotonic(), count(store)
        if c != last:
            trace.append((round(now - t0, 3), *c))
            last, since = c, now
        elif now - since >= quiet_s:
            break
        time.sleep(poll_s)
    return trace


def summarise(trace: list[tuple[float, int, int]], prompt_tokens: int, page: int, cap_hit: bool) -> dict:
    """Rates from the trace: files and tokens per second over [response, last file]."""
    end_s, kv, swa = trace[-1] if trace else (0.0, 0, 0)
    span = max(end_s, 1e-9)
    return {"kv_files": kv, "swa_files": swa, "expected_kv_files": prompt_tokens // page, "last_file_s": end_s,
            "files_per_s": (kv + swa) / span, "kv_pages_per_s": kv / span, "tokens_per_s": kv * page / span,
            "complete": kv >= prompt_tokens // page, "cap_hit": cap_hit}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--page-size", type=int, default=None, help="--page-size for the server (default: the plugin's)")
    p.add_argument("--flags", default="", help="more server flags")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--poll-s", type=float, default=0.25)
    p.add_argument("--quiet-s", type=float, default=5.0)
    p.add_argument("--cap-s", type=float, default=300.0)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--fs-probe", type=int, default=0, help="page files for the no-server probe (0: none)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log", type=Path, default=Path("hicache_l3_write.log"))
    a = p.parse_args()

    store = Path(tempfile.mkdtemp(prefix="hicache_l3w_"))
    probe = fs_probe(store.parent, a.fs_probe) if a.fs_probe else {}
    port = free_port()
    flags = shlex.split(BASE_FLAGS) + shlex.split(a.flags)
    if a.page_size is not None:
        flags += ["--page-size", str(a.page_size)]
    argv = [sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", a.device, "--model-path", a.model_path,
            "--port", str(port), *flags]
    proc = Proc(argv, a.log, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url + "/health_generate", [proc], a.startup_timeout)
        info = http(url + "/get_server_info", timeout=60)
        page = int(info["page_size"])
        rng = random.Random(0)
        ids = [0] + [rng.randrange(3, a.vocab) for _ in range(a.prompt_tokens - 1)]
        t_req = time.monotonic()
        http(url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
             timeout=a.cap_s)
        t0 = time.monotonic()
        trace = watch(store, t0, a.poll_s, a.quiet_s, a.cap_s)
        cap_hit = time.monotonic() - t0 >= a.cap_s
        out = {"prompt_tokens": a.prompt_tokens, "page_size": page, "device": a.device, "flags": flags,
               "switch_interval_env": os.environ.get("SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS", "(unset: plugin default)"),
               "switch_interval_log": switch_line(a.log),
               "request_s": round(t0 - t_req, 3), **summarise(trace, a.prompt_tokens, page, cap_hit), "fs_probe": probe,
               "request_to_last_file_s": round(t0 - t_req + (trace[-1][0] if trace else 0.0), 3),
               "trace": trace}
    finally:
        proc.stop()
        shutil.rmtree(store, ignore_errors=True)
    print(json.dumps({k: v for k, v in out.items() if k not in ("trace", "flags")}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0 if out["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
