"""End-to-end serving benchmark (issue 21 item 4; issue 16 "Benchmark"; docs/performance.md
"End-to-end serving").

One client for every server: random prompt ids (``--input-len``, default 1K), ``--output-len``
(default 256) greedy tokens with EOS ignored, streamed ``/generate``; at each concurrency C a closed
loop keeps C requests in flight until ``max(C · --rounds, --min-requests)`` finished (`serving_client.py`:
TTFT, ITL, output tokens/s on the client clock). Servers are started by the caller's command
line (``--launch -- ARGV``) in their own process group, waited for (``/health_generate``, capped),
warmed up (one wave of C full-length prompts with ``WARMUP_TOKENS`` outputs at every level C), run
through the levels ``--passes`` times (the last pass is reported: both servers JIT-compiled inside a first
pass at C = 64 in session 36) and stopped; or ``--url`` points at a running one.

    python benchmarks/serving_e2e.py model-dirs OUT_DIR [--layers 4]   # ours (config-only) + SGLang V4-Flash
    python benchmarks/serving_e2e.py client --label ours --out-dir DIR [--concurrency 1 16 64] -- \\
        python -m sglang.launch_server --model-path OUT_DIR/dsv41 --load-format dummy ...
    python benchmarks/serving_e2e.py report DIR [--out benchmarks/results/serving_e2e.json]

`model-dirs` writes ``dsv41/`` (`sglang-dsv41 make-checkpoint --preset slice --layers L
--config-only`: Flash widths, L layers, tokenizer, no tensors) and ``sglang_v4/`` (SGLang 0.5.17's
DeepseekV4ForCausalLM at released V4-Flash widths, L layers, `sglang_v4_baseline.v4_config_dict`, with
the same 129,280-id tokenizer, so both servers detokenize the same ids). `report` reads every
``<label>.json`` and writes one JSON (+ PNG when matplotlib is present) with, per concurrency,
ours / SGLang ratios (output tokens/s, TTFT, ITL, the server-side decode rate: `server_decode_rates`) and
DSpark / no-speculation output tokens/s.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import pyplot, save_png  # noqa: E402
from serving_client import Proc, closed_loop, free_port, prompt, stream_generate, wait_up  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: id range of the random prompts: inside both models' 129,280-id vocabularies, above the specials
ID_RANGE = (100, 120_000)
#: labels `report` pairs: (numerator, denominator, what)
PAIRS = (("ours", "sglang_v4", "sglang-dsv41 V4.1 / SGLang V4-Flash"),
         ("ours_dspark", "ours", "DSpark (synthetic AL) / no speculation"),
         ("ours_engram_host", "ours", "Engram tables in pinned host memory / on the GPU"),
         ("ours_b2k", "ours", "prefill graph buckets to 2,048 tokens / the defaults"),
         ("ours_c2k", "ours", "chunked prefill and prefill graph buckets to 2,048 tokens / the defaults"),
         ("ours_overlap", "ours", "the side stream (SGLANG_DSV41_OVERLAP=on) / the defaults"),
         ("tiny", "llama8", "tiny V4.1 / stock-SGLang 8-layer Llama of the same widths (scripts/gpu/tiny_vs_llama.sh)"),
         ("tiny", "tiny_eager", "tiny V4.1: prefill CUDA graphs / eager prefill"),
         ("tiny_b1k", "llama8", "tiny V4.1 with prefill buckets to 1,024 tokens / the 8-layer Llama"),
         ("tiny_b2k", "llama8", "tiny V4.1 with prefill buckets to 2,048 tokens / the 8-layer Llama"),
         ("tiny_c1k", "llama8", "tiny V4.1, prefill buckets and chunked prefill 1,024 tokens / the 8-layer Llama"),
         ("tiny_c2k", "llama8", "tiny V4.1, prefill buckets and chunked prefill 2,048 tokens / the 8-layer Llama"))


def model_dirs(out: Path, layers: int) -> dict[str, str]:
    from sglang_v4_baseline import v4_config_dict
    from sglang_dsv41.checkpoint.synth import make_config_dir

    ours = make_config_dir("slice", out / "dsv41", layers=layers, overwrite=True)
    v4 = out / "sglang_v4"
    v4.mkdir(parents=True, exist_ok=True)
    (v4 / "config.json").write_text(json.dumps(v4_config_dict(layers), indent=2))
    for f in ours.iterdir():
        if f.name != "config.json":
            shutil.copy2(f, v4 / f.name)
    return {"dsv41": str(ours), "sglang_v4": str(v4)}


#: output tokens of a warm-up request; one wave of C full-length prompts runs at every level C before any is
#: timed, so a server that JIT-compiles per prefill shape (SGLang's V4: DeepGEMM M-classes, TileLang splits)
#: does so outside the timed levels
WARMUP_TOKENS = 16


#: the line SGLang's scheduler (both servers run it) writes every `--decode-log-interval` (40) decode steps
DECODE_LOG = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([0-9.]+)")


def server_decode_rates(log_text: str, levels: list[int]) -> dict[str, dict[str, float]]:
    """Per level C: the median (and count) of the decode rates the scheduler logged while exactly C requests
    ran. A JIT pause moves the client's output tok/s of a level but only the one window it falls in here."""
    rates: dict[int, list[float]] = {}
    for m in DECODE_LOG.finditer(log_text):
        rates.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    return {str(c): {"median": statistics.median(rates[c]), "windows": len(rates[c])} for c in levels if c in rates}


def run_client(url: str, levels: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        n = max(c * args.rounds, args.min_requests)
        limit = min(args.level_timeout_s, args.deadline - time.monotonic())
        if limit < 20:
            print(f"[{args.label}] C={c}: skipped, {limit:.0f} s of --budget-s left", flush=True)
            rows.append({"concurrency": c, "skipped": f"{limit:.0f} s of --budget-s left"})
            continue

        def send(i: int, c: int = c) -> dict[str, Any]:
            ids = prompt(args.seed + 100_000 * c + i, args.input_len, *args.id_range)
            return stream_generate(url, ids, args.output_len, {}, timeout=limit)
        row = closed_loop(send, c, n, limit)
        print(f"[{args.label}] C={c}: {row['output_tokens_per_s']:.1f} output tok/s, TTFT p50 "
              f"{_ms(row['ttft_s']['p50'])} ms, ITL p50 {_ms(row['itl_s']['p50'])} ms, {row['n_errors']} errors",
              flush=True)
        rows.append(row)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def client(args: argparse.Namespace) -> int:
    out = args.out_dir / f"{args.label}.json"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"label": args.label, "argv": args.server_argv, "input_len": args.input_len,
                           "output_len": args.output_len, "concurrency": args.concurrency,
                           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    proc = None
    args.deadline = time.monotonic() + args.budget_s

    def stop_on_term(signum, frame):          # `timeout` sends SIGTERM: still stop the server (finally)
        raise SystemExit(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop_on_term)
    try:
        if args.url:
            url = args.url
        else:
            port = free_port()
            argv = [*args.server_argv, "--port", str(port), "--host", "127.0.0.1"]
            t0 = time.perf_counter()
            proc = Proc(argv, args.out_dir / f"{args.label}_server.log")
            url = f"http://127.0.0.1:{port}"
            wait_up(url + "/health_generate", [proc], min(args.startup_s, args.deadline - time.monotonic()))
            rec["startup_s"] = time.perf_counter() - t0
            print(f"[{args.label}] up after {rec['startup_s']:.0f} s", flush=True)
        t0 = time.perf_counter()
        rec["warmup"] = [closed_loop(lambda i, c=c: stream_generate(url, prompt(args.seed - 1 - 1000 * c - i,
                                                                                args.input_len, *args.id_range),
                                                                     WARMUP_TOKENS, {}, timeout=args.level_timeout_s),
                                     c, c, args.level_timeout_s) for c in sorted(set(args.concurrency))]
        rec["warmup_s"] = time.perf_counter() - t0
        rec["earlier_passes"] = [run_client(url, args.concurrency, args) for _ in range(args.passes - 1)]
        rec["levels"] = run_client(url, args.concurrency, args)
        if proc is not None:
            log = proc.log.read_text(errors="replace")
            rec["dummy_log"] = [ln for ln in log.splitlines() if "dummy weights" in ln or "parameters hold" in ln][:4]
            rec["server_decode_tok_s"] = server_decode_rates(log, args.concurrency)
    except (Exception, SystemExit) as e:   # recorded with the server log's tail; the exit status says it failed
        rec["error"] = f"{type(e).__name__}: {e}"[:4000]
        print(f"[{args.label}] FAILED: {rec['error'][:2000]}", flush=True)
    finally:
        if proc is not None:
            proc.stop()
        out.write_text(json.dumps(rec, indent=2))
    return 1 if "error" in rec else 0


def _level(rec: dict[str, Any], c: int) -> dict[str, Any] | None:
    return next((r for r in rec.get("levels", []) if r["concurrency"] == c and "skipped" not in r), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _decode_rate(rec: dict[str, Any], c: int) -> float | None:
    return (rec.get("server_decode_tok_s") or {}).get(str(c), {}).get("median")


def report(args: argparse.Namespace) -> int:
    recs = {p.stem: json.loads(p.read_text()) for p in sorted(args.dir.glob("*.json")) if not p.stem.endswith("report")}
    for label, rec in recs.items():       # records written before the client kept the rates: read the server log
        log = args.dir / f"{label}_server.log"
        if "server_decode_tok_s" not in rec and log.exists():
            rec["server_decode_tok_s"] = server_decode_rates(log.read_text(errors="replace"), rec.get("concurrency", []))
    out: dict[str, Any] = {"what": "end-to-end serving, one client (random ids, EOS ignored, closed loop per "
                                   "concurrency); ratios are numerator / denominator",
                           "runs": recs, "ratios": {}}
    for num, den, what in PAIRS:
        if num not in recs or den not in recs:
            continue
        rows = []
        for lv in recs[num].get("levels", []):
            other = _level(recs[den], lv["concurrency"])
            if other is None or "skipped" in lv:
                continue
            rows.append({"concurrency": lv["concurrency"],
                         "output_tokens_per_s": _ratio(lv["output_tokens_per_s"], other["output_tokens_per_s"]),
                         "ttft_p50": _ratio(lv["ttft_s"]["p50"], other["ttft_s"]["p50"]),
                         "itl_p50": _ratio(lv["itl_s"]["p50"], other["itl_s"]["p50"]),
                         "server_decode_tok_s": _ratio(_decode_rate(recs[num], lv["concurrency"]),
                                                       _decode_rate(recs[den], lv["concurrency"]))})
        out["ratios"][f"{num}/{den}"] = {"what": what, "per_concurrency": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["ratios"], indent=2))
    print(plot(recs, args.out.with_suffix(".png")))
    return 0


def plot(recs: dict[str, Any], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "no PNG: matplotlib missing"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, rec in recs.items():
        lv = [r for r in rec.get("levels") or [] if "skipped" not in r]
        if not lv:
            continue
        cs = [r["concurrency"] for r in lv]
        for ax, key in zip(axes, ("output_tokens_per_s", "ttft_s", "itl_s")):
            ys = [r[key] if key == "output_tokens_per_s" else (r[key]["p50"] or 0) * 1e3 for r in lv]
            ax.plot(cs, ys, "o-", label=label)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_png(fig, path, dpi=110)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_argv: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_argv = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("model-dirs", help="write the two model directories (config + tokenizer, no tensors)")
    d.add_argument("out", type=Path)
    d.add_argument("--layers", type=int, default=4)
    c = sub.add_parser("client", help="start (after --) or reach (--url) one server and run the levels")
    c.add_argument("--label", required=True)
    c.add_argument("--out-dir", type=Path, required=True)
    c.add_argument("--url")
    c.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    c.add_argument("--input-len", type=int, default=1024)
    c.add_argument("--output-len", type=int, default=256)
    c.add_argument("--rounds", type=int, default=2, help="requests per level = max(C * rounds, --min-requests)")
    c.add_argument("--min-requests", type=int, default=4)
    c.add_argument("--passes", type=int, default=2,
                   help="every level runs this many times; `levels` holds the last pass, `earlier_passes` the others "
                        "(a level's first pass can meet batch shapes the warm-up did not, and JIT-compile inside it)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--id-range", type=int, nargs=2, default=list(ID_RANGE), help="prompt ids: uniform in [LOW, HIGH)")
    c.add_argument("--startup-s", type=float, default=240)
    c.add_argument("--level-timeout-s", type=float, default=120)
    c.add_argument("--budget-s", type=float, default=1800, help="whole run (start-up included): levels past it are skipped")
    r = sub.add_parser("report", help="combine <label>.json files: ratios, JSON + PNG")
    r.add_argument("dir", type=Path)
    r.add_argument("--out", type=Path, default=RESULTS / "serving_e2e.json")
    a = ap.parse_args(argv)
    if a.cmd == "model-dirs":
        print(json.dumps(model_dirs(a.out, a.layers)))
        return 0
    if a.cmd == "client":
        if a.passes < 1:
            ap.error(f"client: --passes {a.passes} (at least 1)")
        if bool(a.url) == bool(server_argv):
            ap.error("client: give either --url or a server command line after --")
        a.server_argv = server_argv
        return client(a)
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
