"""`runtime/metrics.py`: nothing is created without --enable-metrics; with it, the gauges carry
the caches' figures and the Engram bytes per tier (the scrape through a real server:
tests/test_api_bad_input.py::test_metrics_serves_sglangs_and_the_runtimes_gauges)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from sglang_dsv41.runtime import metrics


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(metrics.PREFIX + name, labels)


def test_disabled_without_a_server(monkeypatch) -> None:
    assert metrics.metrics_enabled() is False          # no SGLang server args in this process
    monkeypatch.setattr(metrics, "_gauges", {})
    metrics.publish_engram([SimpleNamespace(placement="host", nbytes=5)], "host", 0)
    assert metrics._gauges == {}


def test_gauges_per_pool_and_tier(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "metrics_enabled", lambda: True)
    caches = SimpleNamespace(global_bytes_per_token=lambda: 176, swa_bytes_per_token=lambda: 1536,
                             request_state_bytes=lambda: 1552, engram_history_bytes=lambda: 20, num_slots=8194,
                             num_swa_slots=818)
    metrics.publish_caches(caches, tp_rank=3)
    assert _value("kv_bytes_per_token", tp_rank="3", pool="global") == 176
    assert _value("kv_bytes_per_token", tp_rank="3", pool="swa") == 1536
    assert _value("request_state_bytes", tp_rank="3", state="pair_state") == 1552
    assert _value("request_state_bytes", tp_rank="3", state="engram_history") == 20
    assert _value("kv_slots", tp_rank="3", pool="swa") == 818
    tables = [SimpleNamespace(placement="host", nbytes=100), SimpleNamespace(placement="host", nbytes=20)]
    metrics.publish_engram(tables, "host", tp_rank=3)
    assert _value("engram_bytes", tp_rank="3", tier="host") == 120
    assert _value("engram_bytes", tp_rank="3", tier="device") == 0
    assert _value("engram_placement", tp_rank="3", placement="host") == 1


def test_indexer_selection_summary_counts_valid_entries_per_query() -> None:
    import torch

    from sglang_dsv41.runtime.indexer_stats import selection_summary

    sel = {4: torch.tensor([[0, 1, -1, -1], [0, 1, 2, 3]]), 2: torch.tensor([[-1, -1, -1, -1], [5, -1, -1, -1]])}
    layers, means = selection_summary(sel)
    assert layers == [2, 4]
    assert means.tolist() == [0.5, 3.0]


def test_indexer_stats_sample_every_nth_forward_and_publish(monkeypatch) -> None:
    import torch

    from sglang_dsv41.runtime import indexer_stats

    monkeypatch.setattr(metrics, "_gauges", {})
    stats = indexer_stats.IndexerSelectionStats(index_topk=4, tp_rank=5, every=3, enabled=True)
    sel = {1: torch.tensor([[0, 1, 2, -1]])}
    stats.observe(sel, num_tokens=1)
    stats.observe(sel, num_tokens=1)
    assert _value("indexer_topk_fill", tp_rank="5", layer="1") is None          # not sampled yet
    stats.observe(sel, num_tokens=7)
    assert _value("indexer_selected_entries", tp_rank="5", layer="1") == 3.0
    assert _value("indexer_topk_fill", tp_rank="5", layer="1") == 0.75
    assert _value("indexer_sampled_forwards_total", tp_rank="5") == 1
    assert _value("indexer_sampled_tokens_total", tp_rank="5") == 7


def test_indexer_stats_off_without_metrics_or_with_interval_zero(monkeypatch) -> None:
    import torch

    from sglang_dsv41.runtime import indexer_stats

    monkeypatch.setattr(metrics, "_gauges", {})
    sel = {1: torch.tensor([[0, -1]])}
    indexer_stats.IndexerSelectionStats(2, 0).observe(sel, 1)         # no server: metrics disabled
    indexer_stats.IndexerSelectionStats(2, 0, every=0, enabled=True).observe(sel, 1)
    assert metrics._gauges == {}
    monkeypatch.setenv(indexer_stats.EVERY_ENV, "-2")
    with pytest.raises(ValueError, match="must be ≥ 0"):
        indexer_stats.sampling_interval()
    monkeypatch.setenv(indexer_stats.EVERY_ENV, "often")
    with pytest.raises(ValueError, match="not an integer"):
        indexer_stats.sampling_interval()
