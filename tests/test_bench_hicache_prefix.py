"""CPU check of benchmarks/hicache_prefix.py's summary (no server, milliseconds): per case the median
TTFT and its ratio to cold, the tier's tokens, greedy equality with the cold run of the same prompt,
and the host-tier bandwidth from SGLang's load-back metrics when they carry durations, else from
the TTFT difference (docs/hicache.md "Benchmark: one long prefix by tier")."""
from __future__ import annotations

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
