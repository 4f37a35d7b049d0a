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
