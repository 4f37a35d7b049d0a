"""Where one DSpark decode step's time goes, on a running DSPARK server (issue 16 "Benchmark";
run by scripts/gpu/dspark8.sh on the 4-layer full-width dummy server).

Two sources, both SGLang 0.5.17's own (nothing in the plugin changes):

* the DSpark worker's per-step records (`SGLANG_DSPARK_DEBUG_DUMP=core,step_cpu_time,
  step_gpu_time,draft_gpu_time,target_verify_gpu_time`; CUDA events around the draft proposal —
  draft forward, base logits, Markov sampling — and around the target verify forward), read back
  through `/server_info` after one concurrency-1 request. Per decode step: `step_gpu_ms` (begin of
  the step to the end of the verify bookkeeping), `draft_gpu_ms`, `target_verify_gpu_ms`,
  `step_cpu_ms` (host time between two decode steps); the rest of the step on the GPU is the
  accept, the draft-context write and the Engram commit.
* a torch.profiler trace of a few decode steps (`/start_profile`): kernel time by name.

    python benchmarks/dspark_step.py run --url http://127.0.0.1:PORT --out DIR [--input-len 1024 --output-len 256]
    python benchmarks/dspark_step.py table RECORDS.json          # the per-phase table of saved records
    python benchmarks/dspark_step.py kernels TRACE.json[.gz]     # kernel time by name of a trace
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

DUMP_COMPONENTS = "core,step_cpu_time,step_gpu_time,draft_gpu_time,target_verify_gpu_time"
PHASES = (("draft (forward + base logits + Markov sampling)", "draft_gpu_ms"),
          ("target verify (forward + logits)", "target_verify_gpu_ms"))


def _post(url: str, body: dict | None, timeout: float = 300.0) -> dict | str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def phase_table(records: list[dict]) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """Per phase (name, mean ms over decode steps, share of the GPU step) and the summary
    (steps, mean GPU step, mean host step, rest, host gap). Steps without a GPU time are skipped."""
    steps = [r for r in records if r.get("step_gpu_ms") is not None]
    if not steps:
        raise ValueError("no decode step with step_gpu_ms in the records (was SGLANG_DSPARK_DEBUG_DUMP set?)")

    def mean(key: str, rows=steps) -> float:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(vals) if vals else float("nan")

    step = mean("step_gpu_ms")
    rows = [(name, mean(key), mean(key) / step) for name, key in PHASES]
    rest = step - sum(ms for _, ms, _ in rows)
    rows.append(("rest on the GPU (accept, draft-context write, Engram commit, bookkeeping)", rest, rest / step))
    cpu = mean("step_cpu_ms")
    summary = {"steps": len(steps), "step_gpu_ms": step, "step_cpu_ms": cpu,
               "host_gap_ms": cpu - step if cpu == cpu else float("nan"),
               "bs": statistics.median(r.get("bs", -1) for r in steps),
               "verify_tokens": statistics.median(r.get("num_verify_tokens", -1) for r in steps)}
    return rows, summary


def format_table(rows, summary, accept_length: float | None = None, plain_itl_ms: float | None = None) -> str:
    out = [f"DSpark decode step, {summary['steps']} steps, bs {summary['bs']:g}, "
           f"{summary['verify_tokens']:g} verify tokens a step",
           f"{'phase':<76} {'mean ms':>8} {'share':>6}"]
    out += [f"{name:<76} {ms:8.3f} {share:6.1%}" for name, ms, share in rows]
    out.append(f"{'GPU step (events: begin of step .. end of verify bookkeeping)':<76} {summary['step_gpu_ms']:8.3f}")
    out.append(f"{'host time between decode steps (step_cpu_ms)':<76} {summary['step_cpu_ms']:8.3f}")
    out.append(f"{'host time not covered by the GPU step':<76} {summary['host_gap_ms']:8.3f}")
    if accept_length:
        per_token = summary["step_cpu_ms"] / accept_length
        line = f"accept length {accept_length:.2f}: {per_token:.3f} ms a token"
        if plain_itl_ms:
            line += (f"; plain ITL {plain_itl_ms:.2f} ms → speed-up {plain_itl_ms / per_token:.2f}×; "
                     f"2.5× needs a step ≤ {accept_length * plain_itl_ms / 2.5:.2f} ms")
        out.append(line)
    return "\n".join(out)


def kernel_table(trace_path: Path, top: int = 25) -> str:
    """Kernel time by name in a Chrome trace (torch.profiler), total and per name."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_name[e.get("name", "?")].append(float(e.get("dur", 0.0)))
    if not by_name:
        return f"{trace_path.name}: no kernel events"
    total = sum(sum(v) for v in by_name.values())
    lines = [f"{trace_path.name}: {sum(len(v) for v in by_name.values())} kernels, {total / 1000:.2f} ms GPU time",
             f"{'us total':>10} {'count':>6} {'share':>6}  name"]
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(durs):10.1f} {len(durs):6d} {sum(durs) / total:6.1%}  {name[:110]}")
    return "\n".join(lines)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def run(url: str, out: Path, input_len: int, output_len: int, profile_steps: int, plain_itl_ms: float | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    greedy = {"temperature": 0, "ignore_eos": True}
    _post(f"{url}/generate", {"input_ids": _ids(input_len, 1), "sampling_params": {**greedy, "max_new_tokens": 32}})
    _post(f"{url}/set_internal_state", {"server_args": {"dspark_clear_info_records": True}})
    t0 = time.monotonic()
    res = _post(f"{url}/generate", {"input_ids": _ids(input_len, 2),
                                    "sampling_params": {**greedy, "max_new_tokens": output_len}})
    wall = time.monotonic() - t0
    meta = res["meta_info"]
    info = _post(f"{url}/server_info", None)
    states = info.get("internal_states") or [{}]
    record = states[0].get("dspark_info_record")
    if record is None:
        print("no dspark_info_record in /server_info (SGLANG_DSPARK_DEBUG_DUMP unset, or not a DSPARK server)")
        return 1
    (out / "records.json").write_text(json.dumps(record))
    rows, summary = phase_table(record["records"])
    accept = meta.get("spec_accept_length")
    print(f"request: {input_len} in / {meta['completion_tokens']} out in {wall:.3f} s "
          f"({meta['completion_tokens'] / wall:.1f} tok/s incl. prefill), {meta.get('spec_verify_ct')} verify steps, "
          f"accept length {accept}")
    print(format_table(rows, summary, accept, plain_itl_ms))
    (out / "summary.json").write_text(json.dumps({"rows": rows, "summary": summary, "meta": meta, "wall_s": wall}))
    if profile_steps > 0:
        prof = out / "trace"
        _post(f"{url}/start_profile", {"output_dir": str(prof), "num_steps": profile_steps,
                                       "activities": ["CPU", "GPU"]})
        _post(f"{url}/generate", {"input_ids": _ids(input_len, 3),
                                  "sampling_params": {**greedy, "max_new_tokens": 8 * profile_steps}})
        deadline = time.monotonic() + 60
        traces: list[Path] = []
        while time.monotonic() < deadline and not traces:
            time.sleep(2)
            traces = sorted(prof.glob("**/*.json*")) if prof.exists() else []
        time.sleep(3)                      # the exporter may still be writing the file it created
        for t in traces:
            try:
                print(kernel_table(t))
            except (OSError, ValueError, EOFError) as e:
                print(f"{t.name}: unreadable trace ({e})")
        if not traces:
            print("no profiler trace within 60 s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--url", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--input-len", type=int, default=1024)
    r.add_argument("--output-len", type=int, default=256)
    r.add_argument("--profile-steps", type=int, default=10)
    r.add_argument("--plain-itl-ms", type=float, default=4.65, help="the plain server's ITL to compare against")
    t = sub.add_parser("table")
    t.add_argument("records", type=Path)
    k = sub.add_parser("kernels")
    k.add_argument("trace", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "run":
        return run(a.url.rstrip("/"), a.out, a.input_len, a.output_len, a.profile_steps, a.plain_itl_ms)
    if a.cmd == "table":
        record = json.loads(a.records.read_text())
        print(format_table(*phase_table(record["records"] if isinstance(record, dict) else record)))
        return 0
    print(kernel_table(a.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
