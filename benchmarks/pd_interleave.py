"""PD 1P1D against colocated with the set-ups interleaved under one host load (docs/pd.md
"ITL at concurrency 1 on CPU"; docs/performance.md).

`benchmarks/pd.py` measures its set-ups one after another; on a shared host the load moves between
them, and the ratio measures the load as much as PD. Here a colocated server and one or more PD
pairs (each with its own environment, e.g. `SGLANG_DSV41_PD_CPU_WAIT_MS=2` against `=0`) are all
up at once (idle servers sleep), and each cycle runs one concurrency level on every set-up in turn,
so every set-up sees the same load within seconds. The client, prompts and metrics are pd.py's
(`run_level`: streamed greedy /generate, TTFT, ITL, per-chunk gaps of the first request). Each level
also records every server's CPU seconds, the busiest threads (process, thread id, name) and the
host's busy CPU seconds over the level's wall time (`host_busy_s`; 2 × wall = both cores busy).

    python benchmarks/pd_interleave.py --pd wait:SGLANG_DSV41_PD_CPU_WAIT_MS=2 \\
        --pd spin:SGLANG_DSV41_PD_CPU_WAIT_MS=0 --cycles 3 --out benchmarks/results/pd_cpu_interleaved.json

Writes JSON and a PNG (when matplotlib is present); every process group is stopped at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pd as bench  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402


def parse_pd(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME[:K=V[,K=V...]]` → (name, environment of that pair)."""
    name, _, rest = spec.partition(":")
    env = {}
    for kv in filter(None, rest.split(",")):
        if "=" not in kv:
            raise argparse.ArgumentTypeError(f"--pd {spec!r}: expected NAME:K=V[,K=V...]")
        k, v = kv.split("=", 1)
        env[k] = v
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--pd {spec!r}: the name must be an identifier")
    return name, env


def threads_cpu(procs: dict[str, bench.Proc]) -> dict[tuple[str, str, int, str], float]:
    """CPU seconds of every thread of every process tree: (set-up role, process, tid, thread name)."""
    import psutil

    out = {}
    for role, p in procs.items():
        try:
            root = psutil.Process(p.p.pid)
            for q in [root, *root.children(recursive=True)]:
                for t in q.threads():
                    try:
                        comm = Path(f"/proc/{q.pid}/task/{t.id}/comm").read_text().strip()
                    except OSError:
                        comm = "?"
                    out[(role, q.name()[:20], t.id, comm)] = t.user_time + t.system_time
        except psutil.NoSuchProcess:
            pass
    return out


def level(args: argparse.Namespace, target: bench.Target, procs: dict[str, bench.Proc], c: int) -> dict[str, Any]:
    import psutil

    th0, cpu0, host0 = threads_cpu(procs), {k: p.cpu_s() for k, p in procs.items()}, psutil.cpu_times()
    load0 = os.getloadavg()[0]
    lv = bench.run_level(target, c, args.rounds, args.prompt_len, args.new_tokens, seed=10 * c + args.prompt_len)
    host1 = psutil.cpu_times()
    lv["cpu_s"] = {k: round(p.cpu_s() - cpu0[k], 2) for k, p in procs.items()}
    lv["host_busy_s"] = round(sum(host1) - host1.idle - (sum(host0) - host0.idle), 2)
    busy = sorted(((v - th0.get(k, 0.0), k) for k, v in threads_cpu(procs).items()), reverse=True)
    lv["threads"] = [[round(d, 2), *map(str, k)] for d, k in busy[:8] if d > 0.05]
    lv["loadavg_1m_start_end"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return lv


def run(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    sargs = argparse.Namespace(device="cpu", checkpoint=args.checkpoint, max_total_tokens=args.max_total_tokens,
                               concurrency=args.concurrency, server_arg=[], pd_threads=0, startup_s=args.startup_s,
                               no_router=False)
    result: dict[str, Any] = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds,
                              "concurrency": args.concurrency, "cycles": args.cycles,
                              "pd_env": {name: env for name, env in args.pd}, "setups": {}}
    everything: list[bench.Proc] = []
    targets: dict[str, tuple[bench.Target, dict[str, bench.Proc]]] = {}
    saved = dict(os.environ)
    try:
        port = bench.free_port()
        co = bench.serve(sargs, port, logs / "colocated.log", [])
        everything.append(co)
        pairs = []
        for name, env in args.pd:
            os.environ.clear()
            os.environ.update({**saved, **env})          # the pair's servers inherit it
            (logs / name).mkdir(parents=True, exist_ok=True)
            procs, P, D, boot = bench.start_pd(sargs, logs / name)
            everything += procs
            pairs.append((name, procs, P, D, boot))
        os.environ.clear()
        os.environ.update(saved)
        bench.wait_up(f"http://127.0.0.1:{port}/health_generate", everything, args.startup_s)
        targets["colocated"] = (bench.Target(f"http://127.0.0.1:{port}"), {"colocated": co})
        for name, procs, P, D, boot in pairs:
            t = bench.pd_target(sargs, logs / name, procs, P, D, boot)      # appends the router to procs
            everything += procs[2:]
            targets[name] = (t, dict(zip(("prefill", "decode", "router"), procs)))
        for t, _ in targets.values():                                        # warm-up
            t.call(lambda url, extra: bench.http(url + "/generate", {
                "input_ids": bench.prompt(2, args.prompt_len), "sampling_params": {"max_new_tokens": 2}, **extra},
                timeout=600))
        result["setups"] = {name: [] for name in targets}
        for cycle in range(args.cycles):
            for c in args.concurrency:
                for name, (t, procs) in targets.items():
                    lv = {"cycle": cycle, **level(args, t, procs, c)}
                    result["setups"][name].append(lv)
                    print(name, json.dumps({k: lv[k] for k in ("cycle", "concurrency", "n_errors", "ttft_s", "itl_s",
                                                               "wall_s", "host_busy_s", "cpu_s")}), flush=True)
                    args.out.write_text(json.dumps(result, indent=2))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for p in everything:
            p.stop()
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per set-up and concurrency: mean over cycles of the levels' mean ITL / TTFT, and the ratio of
    ITL to the colocated server's in the same cycle (mean over cycles)."""
    out: dict[str, Any] = {}
    colo = {(x["cycle"], x["concurrency"]): x for x in result["setups"].get("colocated", [])}
    for name, levels in result["setups"].items():
        for c in result["concurrency"]:
            lv = [x for x in levels if x["concurrency"] == c and x["itl_s"]["mean"] is not None]
            if not lv:
                continue
            ratios = [x["itl_s"]["mean"] / colo[(x["cycle"], c)]["itl_s"]["mean"] for x in lv
                      if (x["cycle"], c) in colo and colo[(x["cycle"], c)]["itl_s"]["mean"]]
            out[f"{name}@c{c}"] = {"itl_ms_mean": round(1e3 * sum(x["itl_s"]["mean"] for x in lv) / len(lv), 1),
                                   "ttft_s_mean": round(sum(x["ttft_s"]["mean"] for x in lv) / len(lv), 3),
                                   "itl_ratio_to_colocated": round(sum(ratios) / len(ratios), 2) if ratios else None}
    return out


def plot(result: dict[str, Any], path: Path) -> str:
    """ITL and TTFT per cycle and set-up (concurrency levels side by side); '' when written."""
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, levels in result["setups"].items():
        for c in result["concurrency"]:
            lv = [x for x in levels if x["concurrency"] == c]
            cyc = [x["cycle"] for x in lv]
            axes[0].plot(cyc, [1e3 * (x["itl_s"]["mean"] or 0) for x in lv], "o-", label=f"{name} c={c}")
            axes[1].plot(cyc, [x["ttft_s"]["mean"] or 0 for x in lv], "o-", label=f"{name} c={c}")
    for ax, title in zip(axes, ("mean ITL (ms)", "mean TTFT (s)")):
        ax.set(xlabel="cycle (set-ups measured in turn within a cycle)" if result.get("interleaved", True)
               else "level (each set-up's levels in a row)", title=title,
               xticks=range(result["cycles"]))
        ax.set_ylim(bottom=0)
        ax.legend()
    order = "interleaved" if result.get("interleaved", True) else "one set-up after the other"
    fig.suptitle(f"1P1D vs colocated, {order}, CPU, prompts {result['prompt_len']}, "
                 f"{result['new_tokens']} new tokens")
    save_png(fig, path, dpi=110)
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="default: a tiny checkpoint made in a temp dir")
    ap.add_argument("--pd", type=parse_pd, action="append", default=None,
                    help="a PD pair: NAME[:K=V,...] (its environment; repeat for more pairs; default: one pair 'pd')")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--startup-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=bench.RESULTS / "pd_cpu_interleaved.json")
    args = ap.parse_args(argv)
    args.pd = args.pd or [("pd", {})]
    if len({n for n, _ in args.pd} | {"colocated"}) != len(args.pd) + 1:
        ap.error("--pd names must be distinct and not 'colocated'")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def stop(signum, frame):                 # `timeout` sends SIGTERM: stop the servers, keep the JSON
        raise SystemExit(f"stopped by signal {signum}")

    import signal
    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(os.environ.get("OUT", tmp))
        if args.checkpoint is None:
            args.checkpoint = Path(tmp) / "tiny"
            subprocess.run([sys.executable, "-m", "sglang_dsv41.cli", "make-checkpoint", "--preset", "tiny", "--out",
                            str(args.checkpoint), "--quiet"], check=True, timeout=300)
        t0 = time.perf_counter()
        result = run(args, logs)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        result["host"] = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpus": os.cpu_count()}
    result["summary"] = summary(result)
    note = plot(result, args.out.with_suffix(".png"))
    result["png"] = note or args.out.with_suffix(".png").name
    args.out.write_text(json.dumps(result, indent=2))
    errors = sum(x["n_errors"] for lv in result["setups"].values() for x in lv)
    print(json.dumps({"summary": result["summary"], "errors": errors, "png": result["png"]}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
