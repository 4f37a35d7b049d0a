"""CPU check of benchmarks/hicache_prefix.py's summary (no server, milliseconds): per case the median
TTFT and its ratio to cold, the tier's tokens, greedy equality with the cold run of the same prompt,
and the host-tier bandwidth from SGLang's load-back metrics when they carry durations, else from
the TTFT difference (docs/hicache.md "Benchmark: one long prefix by tier")."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_loader import load_benchmark

KV = {"global_per_token": 192, "swa_per_token": 1536, "page": 2, "swa_restore_rows": 8}
COPY = {"h2d_gbps": 10.0, "d2h_gbps": 10.0}


def _row(case: str, prompt: str, ttft: float, cached: int = 0, tier: str | None = None, out=(1, 2)) -> dict:
    return {"case": case, "prompt": prompt, "ttft_s": ttft, "cached_tokens": cached,
            "cached_details": {tier: cached} if tier else {}, "output_ids": list(out)}


def _rows() -> list[dict]:
    rows = [_row("cold", p, t) for p, t in (("gpu0", 1.0), ("l20", 1.2), ("l30", 0.8), ("last", 1.1))]
    rows += [_row("gpu", "gpu0", 0.05, 100, "device"), _row("push", "push0", 1.0),
             _row("l2", "l20", 0.07, 100, "host", out=(1, 3)), _row("l3", "l30", 0.3, 98, "storage")]
    return rows


def test_summary_ratios_tiers_equality_and_bandwidth_from_ttft() -> None:
    h = load_benchmark("hicache_prefix.py")
    assert h.prefix_load_bytes(KV, 100) == 100 * 192 + 8 * 1536
    s = h.summarize(_rows(), 100, KV, COPY, {})
    c = s["cases"]
    assert c["cold"]["requests"] == 4 and c["cold"]["ttft_ms_median"] == pytest.approx(1050) and c["cold"]["all_cold"]
    assert c["push"]["all_cold"] and "greedy_equal" not in c["push"]
    assert c["gpu"]["ttft_vs_cold"] == pytest.approx(0.05 / 1.05) and c["gpu"]["greedy_equal"] == "1/1"
    assert c["l2"]["tier_tokens_min"] == 100 and c["l2"]["greedy_equal"] == "0/1" and c["l2"]["meets_goal"]
    assert c["l3"]["prefix_from_tier"] and not c["l3"]["meets_goal"]        # 98 >= 100 - page; 0.3 / 1.05 > 25 %
    bw = s["host_tier_bandwidth"]
    assert bw["source"].startswith("prefix KV bytes")
    assert bw["gbps"] == pytest.approx((100 * 192 + 8 * 1536) / 0.02 / 1e9)
    assert bw["fraction_of_copy_h2d"] == pytest.approx(bw["gbps"] / 10.0)
    assert "MISSED" in h.table(s)


def test_bandwidth_from_load_back_metrics_when_they_carry_durations() -> None:
    h = load_benchmark("hicache_prefix.py")
    m = {"sglang:load_back_duration_seconds_sum": 0.002, "sglang:load_back_duration_seconds_count": 2.0,
         "sglang:load_back_tokens_total": 200.0}
    bw = h.summarize(_rows(), 100, KV, COPY, m)["host_tier_bandwidth"]
    assert bw["source"].startswith("sglang:load_back_duration_seconds")
    assert bw["gbps"] == pytest.approx((200 * 192 + 2 * 8 * 1536) / 0.002 / 1e9)


def _hit_rows() -> list[dict]:
    rows = []
    for n, cold, hits in ((1024, 0.5, (0.11, 0.10, 0.12)), (4096, 2.0, (0.16, 0.13, 0.13))):
        rows.append({**_row("hit_cold", f"hit{n}", cold), "prompt_tokens": n})
        rows += [{**_row("hit", f"hit{n}", t, n - 64, "device"), "prompt_tokens": n} for t in hits]
    return rows


def test_hit_cost_by_length_line_fit_and_its_pass_rule() -> None:
    h = load_benchmark("hicache_prefix.py")
    hc = h.summarize_hit_cost(_hit_rows())
    d = hc["by_length"]
    assert d[1024]["hit_ms_median"] == pytest.approx(110) and d[1024]["cold_ms"] == pytest.approx(500)
    assert d[4096]["cached_tokens_min"] == 4032 and d[4096]["greedy_equal"] == "3/3"
    # two points: the line goes through both medians (110 ms at 1K, 130 ms at 4K)
    assert hc["fit"]["per_1k_tokens_ms"] == pytest.approx(20 / 3)
    assert hc["fit"]["fixed_ms"] == pytest.approx(110 - 20 / 3)
    assert h.hit_cost_ok(hc, 64) and not h.hit_cost_ok(hc, 32)      # 4032 < 4096 - 32: not a full hit
    bad = _hit_rows()
    bad[-1]["output_ids"] = [9]
    assert not h.hit_cost_ok(h.summarize_hit_cost(bad), 64)
    assert "fit: hit TTFT" in h.hit_table(hc, {})
    assert "fit" not in h.summarize_hit_cost(_hit_rows()[:4])        # one length: no line


def test_net_of_hit_takes_the_device_hit_off_both_sides() -> None:
    h = load_benchmark("hicache_prefix.py")
    s = h.summarize(_rows(), 100, KV, COPY, {})
    net = h.net_of_hit(s)
    assert net["hit_overhead_ms"] == pytest.approx(50) and net["hit_overhead_vs_cold"] == pytest.approx(50 / 1050)
    assert net["l2_net_vs_cold_net"] == pytest.approx((70 - 50) / (1050 - 50))
    assert net["l3_net_vs_cold_net"] == pytest.approx((300 - 50) / (1050 - 50))


def test_dummy_flash_dir_is_a_config_only_flash_width_model(tmp_path) -> None:
    import json

    h = load_benchmark("hicache_prefix.py")
    d = h.dummy_flash_dir(tmp_path / "m", 3)
    cfg = json.loads((d / "config.json").read_text())["text_config"]
    assert cfg["num_hidden_layers"] == 3 and cfg["hidden_size"] == 5120 and (d / "tokenizer.json").is_file()
    assert not list(d.glob("*.safetensors"))
    stamp = (d / "config.json").stat().st_mtime_ns
    assert h.dummy_flash_dir(d, 3) == d and (d / "config.json").stat().st_mtime_ns == stamp   # reused
    h.dummy_flash_dir(d, 4)
    assert json.loads((d / "config.json").read_text())["text_config"]["num_hidden_layers"] == 4


def test_trace_summary_splits_cpu_span_and_gpu_busy(tmp_path) -> None:
    import gzip
    import json

    h = load_benchmark("hicache_prefix.py")
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000, "dur": 3000},
          {"ph": "X", "cat": "python_function", "name": "sglang_dsv41/runtime/model.py(303): forward", "ts": 500, "dur": 9500},
          {"ph": "X", "cat": "python_function", "name": "threading.py(331): wait", "ts": 600, "dur": 9000},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2000, "dur": 1500},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 4000, "dur": 500},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 5000, "dur": 250},
          {"ph": "i", "cat": "cpu_op", "name": "marker", "ts": 0}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = h.trace_summary(path)
    assert s["cpu_span_ms"] == pytest.approx(9.5) and s["gpu_busy_ms"] == pytest.approx(2.25) and s["gpu_events"] == 3
    assert s["top_gpu_ms"] == {"gemm": pytest.approx(2.0), "Memcpy HtoD": pytest.approx(0.25)}
    assert s["top_cpu_ops_ms"] == {"aten::mm": pytest.approx(3.0)}
    assert s["top_python_ms"] == {"sglang_dsv41/runtime/model.py(303): forward": pytest.approx(9.5)}
    assert "GPU busy 2.2 ms in 3" in h.profile_line({**s, "ttft_ms": 20.0})
    assert h.profile_line(None) == "hit profile: not taken"


def test_a_cold_run_that_hit_storage_is_discarded_and_redone(monkeypatch) -> None:
    """`ask_cold`: a backup landing after the storage was cleared turns a cold run into an L3 hit; the
    run is redone after a longer settle (up to 3 tries), and the kept row counts the discarded runs."""
    from types import SimpleNamespace

    h = load_benchmark("hicache_prefix.py")
    calls: list[str] = []
    answers = iter([32768, 32768, 0, 0])
    monkeypatch.setattr(h, "http", lambda url, body, timeout: calls.append(url.rsplit("/", 1)[1]))
    monkeypatch.setattr(h, "flush", lambda url: calls.append("flush"))
    monkeypatch.setattr(h, "ask", lambda url, case, key, ids, args: dict(_row(case, key, 1.0), cached_tokens=next(answers)))
    settles: list[float] = []
    run = SimpleNamespace(settle=lambda scale=1.0: settles.append(scale), prompt=lambda key: [1, 2], args=None)
    row = h.ask_cold(run, "http://x", "gpu0")
    assert row["cached_tokens"] == 0 and row["cold_retries"] == 2 and settles == [1, 2, 3]
    assert calls == ["clear_hicache_storage_backend", "flush"] * 3
    assert h.ask_cold(run, "http://x", "gpu0")["cold_retries"] == 0
    answers = iter([5] * 3)
    assert h.ask_cold(run, "http://x", "gpu0", tries=3)["cached_tokens"] == 5      # kept, and all_cold will say so


def test_a_storage_still_growing_at_the_cap_is_recorded_not_fatal(tmp_path, monkeypatch) -> None:
    """`Run.settle`: a storage directory still growing at --settle-cap-s no longer ends the run (the
    session-16 H200 run lost its L2 and L3 cases that way); the settle is recorded in `unsettled`."""
    from types import SimpleNamespace

    h = load_benchmark("hicache_prefix.py")
    args = SimpleNamespace(seed=0, vocab=50, prefix_tokens=8, suffix_tokens=2, reps=1, settle_s=0.5, settle_cap_s=0.3)
    run = h.Run(args, tmp_path)
    run.rows.append({"case": "cold"})
    grow = iter(range(1000))
    monkeypatch.setattr(h.Path, "iterdir", lambda self: [Path(f"p{i}.bin") for i in range(next(grow))])
    run.settle()
    assert len(run.unsettled) == 1 and run.unsettled[0]["after_requests"] == 1
    assert "still growing" in run.unsettled[0]["error"]
    monkeypatch.setattr(h.Path, "iterdir", lambda self: [])
    args.settle_cap_s = 3.0
    run.settle()                                                      # quiet: settles, nothing recorded
    assert len(run.unsettled) == 1
