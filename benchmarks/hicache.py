"""HiCache benchmark: multi-turn sessions, prefix hit rate and time to first token with HiCache on
vs off (issue 14; docs/hicache.md "Benchmark").

Starts one server per setting (`python -m sglang_dsv41.cli serve`, i.e. `python -m
sglang.launch_server` with the plugin) with the same small device pool, so the sessions evict one
another from the device:

* ``off``: the device radix cache only;
* ``on``: ``--enable-hierarchical-cache`` (L2 host tier, write_through) plus any ``--on-flags``.

The workload is S sessions of T turns, interleaved round-robin (turn t of every session, then turn
t + 1): turn 1 is a random prompt of ``--first`` token ids, turn t + 1 is turn t's prompt + its
greedy reply (``--reply`` tokens) + ``--user`` new ids, so every turn after the first could reuse
the whole previous turn. Each request streams `/generate` (`serving_client.py`); TTFT is the time
to its first chunk with a token, the hit is SGLang's ``cached_tokens`` (by tier:
``cached_tokens_details``). Both settings must give the same greedy replies (exit 1 otherwise).

Writes JSON (per request and summary) and a PNG (hit rate and mean TTFT per turn, on vs off):

    python benchmarks/hicache.py --model-path /tmp/tiny --device cpu --out benchmarks/results/hicache_cpu.json

``--mode prefix`` runs `hicache_prefix.py` instead (TTFT on one long prefix: cold, GPU, L2, L3 after a
restart); every other argument goes to it.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import Proc, free_port, stream_generate, wait_up  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def start_server(args: argparse.Namespace, flags: list[str], log: Path) -> tuple[Proc, str]:
    """One `sglang-dsv41 serve` process group on a free port (`serving_client.Proc`) and its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", args.device, "--model-path",
            args.model_path, "--port", str(port), "--max-total-tokens", str(args.device_tokens),
            "--enable-cache-report", *flags]
    return Proc(argv, log), f"http://127.0.0.1:{port}"


def run_sessions(url: str, args: argparse.Namespace) -> list[dict]:
    """The sessions' turns round-robin, each a streamed greedy `/generate` (`serving_client.stream_generate`;
    TTFT on the client clock, the hit from the last chunk's ``meta_info``)."""
    rng = random.Random(args.seed)
    prompts = [[0] + [rng.randrange(3, args.vocab) for _ in range(args.first)] for _ in range(args.sessions)]
    rows = []
    for turn in range(1, args.turns + 1):
        for s in range(args.sessions):
            out = stream_generate(url, prompts[s], args.reply, {}, timeout=args.request_timeout, keep_last=True)
            meta, output_ids = out["last"]["meta_info"], out["last"]["output_ids"]
            rows.append({"session": s, "turn": turn, "prompt_tokens": len(prompts[s]),
                         "cached_tokens": int(meta.get("cached_tokens", 0)),
                         "cached_details": meta.get("cached_tokens_details"),
                         "ttft_s": out["ttft_s"], "latency_s": out["latency_s"], "output_ids": output_ids})
            prompts[s] = prompts[s] + output_ids + [rng.randrange(3, args.vocab) for _ in range(args.user)]
    return rows


def summarize(rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] > 1]
    by_turn = {}
    for turn in sorted({r["turn"] for r in rows}):
        rs = [r for r in rows if r["turn"] == turn]
        by_turn[turn] = {"hit_rate": sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs),
                         "ttft_ms_mean": 1e3 * mean(r["ttft_s"] for r in rs)}
    host = sum(int((r["cached_details"] or {}).get("host", 0)) for r in rows)
    return {"requests": len(rows),
            "hit_rate_turns_2_plus": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
            "host_hit_tokens": host,
            "ttft_ms_mean_turn_1": by_turn[1]["ttft_ms_mean"],
            "ttft_ms_mean_turns_2_plus": 1e3 * mean(r["ttft_s"] for r in later) if later else None,
            "by_turn": by_turn}


def plot(result: dict, path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed"

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("off", "on"):
        turns = result[name]["summary"]["by_turn"]
        xs = [int(t) for t in turns]
        a.plot(xs, [100 * turns[t]["hit_rate"] for t in turns], marker="o", label=f"HiCache {name}")
        b.plot(xs, [turns[t]["ttft_ms_mean"] for t in turns], marker="o", label=f"HiCache {name}")
    a.set(xlabel="turn", ylabel="prompt tokens cached (%)", title="prefix hit rate")
    b.set(xlabel="turn", ylabel="mean TTFT (ms)", title="time to first token")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(result["title"], fontsize=9)
    save_png(fig, path, dpi=110)
    return str(path)


def main() -> int:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--mode", choices=("sessions", "prefix"), default="sessions")
    known, rest = mode.parse_known_args()
    if known.mode == "prefix":
        import hicache_prefix

        return hicache_prefix.main(rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("sessions", "prefix"), default="sessions",
                   help="sessions (this file) or prefix (hicache_prefix.py)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--device-tokens", type=int, default=512, help="--max-total-tokens of both servers")
    p.add_argument("--on-flags", default="--hicache-write-policy write_through --hicache-io-backend direct "
                                         "--hicache-ratio 4", help="HiCache flags of the 'on' server")
    p.add_argument("--common-flags", default="--swa-full-tokens-ratio 0.25", help="flags of both servers")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first", type=int, default=64)
    p.add_argument("--user", type=int, default=16)
    p.add_argument("--reply", type=int, default=8)
    p.add_argument("--vocab", type=int, default=990, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=RESULTS / "hicache.json")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()), help="server logs")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"off": args.common_flags.split(),
                "on": [*args.common_flags.split(), "--enable-hierarchical-cache", *args.on_flags.split()]}
    result = {"title": f"{args.sessions} sessions x {args.turns} turns, first {args.first} + {args.reply} reply + "
                       f"{args.user} user ids per turn, {args.device_tokens}-token device pool, {args.device}",
              "args": {k: str(v) for k, v in vars(args).items()}}
    for name, flags in settings.items():
        server, url = start_server(args, flags, args.log_dir / f"{args.out.stem}_{name}.log")
        try:
            t0 = time.monotonic()
            wait_up(url + "/health_generate", [server], args.startup_timeout)
            rows = run_sessions(url, args)
            result[name] = {"flags": flags, "startup_s": time.monotonic() - t0, "summary": summarize(rows),
                            "requests": rows}
        finally:
            server.stop()
        print(name, json.dumps(result[name]["summary"]))
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(result["off"]["requests"], result["on"]["requests"])]
    result["greedy_equal_fraction"] = sum(same) / len(same)
    result["png"] = plot(result, args.out.with_suffix(".png"))
    args.out.write_text(json.dumps(result, indent=1))
    print("greedy equal", result["greedy_equal_fraction"], "->", args.out)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
