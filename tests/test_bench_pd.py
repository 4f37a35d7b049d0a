"""CPU checks of benchmarks/pd.py's transfer accounting: the prefill's Prometheus histograms
parsed over every label set, and per-request means from the difference around a level."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pd as bench  # noqa: E402

METRICS = """# HELP sglang:kv_transfer_latency_ms KV transfer latency
# TYPE sglang:kv_transfer_latency_ms histogram
sglang:kv_transfer_latency_ms_bucket{le="1.0",model_name="m"} 0.0
sglang:kv_transfer_latency_ms_sum{model_name="m",tp_rank="0"} 30.0
sglang:kv_transfer_latency_ms_count{model_name="m",tp_rank="0"} 3.0
sglang:kv_transfer_latency_ms_sum{model_name="m",tp_rank="1"} 10.0
sglang:kv_transfer_latency_ms_count{model_name="m",tp_rank="1"} 1.0
sglang:kv_transfer_total_mb_sum{model_name="m"} 2.0
sglang:kv_transfer_total_mb_count{model_name="m"} 4.0
sglang:kv_transfer_speed_gb_s_sum 0.8
sglang:kv_transfer_speed_gb_s_count 4
sglang:kv_transfer_latency_ms_created{model_name="m"} 1.7e9
"""


def test_histograms_are_summed_over_label_sets():
    got = bench.parse_transfer(METRICS)
    assert got == {"latency_ms_sum": 40.0, "latency_ms_count": 4.0, "total_mb_sum": 2.0, "total_mb_count": 4.0,
                   "speed_gb_s_sum": 0.8, "speed_gb_s_count": 4.0}


def test_per_request_means_come_from_the_difference():
    before = bench.parse_transfer(METRICS)
    after = dict(before, latency_ms_sum=100.0, latency_ms_count=6.0, total_mb_sum=3.0, total_mb_count=6.0,
                 speed_gb_s_sum=1.2, speed_gb_s_count=6.0)
    d = bench.transfer_delta(before, after)
    assert d["transfers"] == 2 and d["mean_latency_ms"] == pytest.approx(30.0)
    assert d["mean_total_mb"] == pytest.approx(0.5) and d["mean_speed_gb_s"] == pytest.approx(0.2)


def test_no_transfer_gives_no_mean():
    before = bench.parse_transfer(METRICS)
    assert bench.transfer_delta(before, before) == {"mean_latency_ms": None, "mean_total_mb": None,
                                                    "mean_speed_gb_s": None, "transfers": 0.0}


def test_interleaved_pairs_and_ratio_to_colocated_per_cycle():
    """benchmarks/pd_interleave.py: `--pd NAME:K=V,...` gives each pair its environment (a malformed
    one is refused), and the ITL ratio is taken against the colocated level of the same cycle."""
    import argparse

    import pd_interleave as inter

    assert inter.parse_pd("wait:SGLANG_DSV41_PD_CPU_WAIT_MS=2,OMP_NUM_THREADS=1") == (
        "wait", {"SGLANG_DSV41_PD_CPU_WAIT_MS": "2", "OMP_NUM_THREADS": "1"})
    assert inter.parse_pd("pd") == ("pd", {})
    for bad in ("wait:NOEQUALS", "not-a-name:K=V"):
        with pytest.raises(argparse.ArgumentTypeError):
            inter.parse_pd(bad)

    def lv(cycle, itl, ttft=0.5):
        return {"cycle": cycle, "concurrency": 1, "itl_s": {"mean": itl}, "ttft_s": {"mean": ttft}}

    result = {"concurrency": [1], "setups": {"colocated": [lv(0, 0.05), lv(1, 0.20)],
                                             "pd": [lv(0, 0.10), lv(1, 0.20)]}}
    s = inter.summary(result)
    assert s["pd@c1"]["itl_ratio_to_colocated"] == pytest.approx(1.5)     # (2.0 + 1.0) / 2, not 0.30 / 0.25
    assert s["colocated@c1"]["itl_ms_mean"] == pytest.approx(125.0)
