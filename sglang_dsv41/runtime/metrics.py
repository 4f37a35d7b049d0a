"""Prometheus gauges of the DeepSeek-V4.1 runtime (issue 20 item 4; docs/observability.md).

With ``--enable-metrics`` SGLang 0.5.17 runs prometheus_client in multiprocess mode (its
``PROMETHEUS_MULTIPROC_DIR``) and serves every process's samples at ``/metrics``. The model lives
in the scheduler processes, so the gauges below are set there (``multiprocess_mode="mostrecent"``,
one series per TP rank) and appear next to SGLang's own ``sglang:`` metrics:

* ``sglang_dsv41:kv_bytes_per_token{pool}`` — ``global`` (packed FP4 rows, per full-pool token),
  ``swa`` (all SWA layers, per SWA token) and ``swa_token_ids`` (Engram history, per SWA slot);
* ``sglang_dsv41:kv_slots{pool}`` — slots of the full (``global``) and ``swa`` pools;
* ``sglang_dsv41:engram_bytes{tier}`` — Engram table bytes this rank holds on the ``device``
  and in ``host`` memory (0 for the tier not used);
* ``sglang_dsv41:engram_placement{placement}`` — 1 for the configured placement;
* indexer selection statistics (`runtime/indexer_stats.py`), sampled from eager forwards;
* ``sglang_dsv41:hicache_storage_failures_total{op}`` — failed HiCache L3 storage operations
  (``query`` / ``read`` / ``write``, `runtime/hicache_faults.py`);
* ``sglang_dsv41:extend_forwards_total{path}`` — extend / mixed forwards by ``path``: ``graph`` (a
  prefill CUDA-graph replay, `runtime/prefill_graph.py`) or ``eager``.

Without ``--enable-metrics`` nothing is created. Every series carries ``tp_rank``.
"""
from __future__ import annotations

from typing import Any, Iterable

PREFIX = "sglang_dsv41:"
TIERS = ("device", "host")
_gauges: dict[str, Any] = {}


def metrics_enabled() -> bool:
    try:
        from sglang.srt.server_args import get_global_server_args

        return bool(get_global_server_args().enable_metrics)
    except (ImportError, AttributeError, ValueError):
        return False   # no server (tests, the reference engine): nothing to export


def gauge(name: str, doc: str, label: str):
    """The `sglang_dsv41:<name>` gauge labelled (tp_rank, `label`), made once per process."""
    if name not in _gauges:
        from prometheus_client import Gauge

        _gauges[name] = Gauge(PREFIX + name, doc, labelnames=("tp_rank", label),
                              multiprocess_mode="mostrecent")
    return _gauges[name]


def counter(name: str, doc: str, label: str | None = None):
    """The `sglang_dsv41:<name>_total` counter labelled (tp_rank[, `label`]), made once per process."""
    if name not in _gauges:
        from prometheus_client import Counter

        _gauges[name] = Counter(PREFIX + name, doc, labelnames=("tp_rank",) + ((label,) if label else ()))
    return _gauges[name]


def count_extend(path: str, tp_rank: int) -> None:
    """One extend / mixed forward on `path` (``graph`` or ``eager``)."""
    if metrics_enabled():
        counter("extend_forwards", "extend forwards by path: a prefill CUDA-graph replay or eager",
                "path").labels(str(tp_rank), path).inc()


def publish_caches(caches: Any, tp_rank: int) -> None:
    """KV figures of a `RuntimeCaches` (what its log line states)."""
    if not metrics_enabled():
        return
    per_token = gauge("kv_bytes_per_token", "KV cache bytes per token of each pool", "pool")
    per_token.labels(str(tp_rank), "global").set(caches.global_bytes_per_token())
    per_token.labels(str(tp_rank), "swa").set(caches.swa_bytes_per_token())
    per_request = gauge("request_state_bytes", "request-scoped state bytes per request row", "state")
    per_request.labels(str(tp_rank), "pair_state").set(caches.request_state_bytes())
    per_request.labels(str(tp_rank), "engram_history").set(caches.engram_history_bytes())
    slots = gauge("kv_slots", "slots of each KV pool", "pool")
    slots.labels(str(tp_rank), "global").set(caches.num_slots)
    slots.labels(str(tp_rank), "swa").set(caches.num_swa_slots)


def publish_engram(tables: Iterable[Any], placement: str, tp_rank: int) -> None:
    """Engram bytes per tier over the loaded tables (objects with ``placement`` and ``nbytes``)."""
    if not metrics_enabled():
        return
    per_tier = dict.fromkeys(TIERS, 0)
    for table in tables:
        per_tier[table.placement] += int(table.nbytes)
    bytes_gauge = gauge("engram_bytes", "Engram table bytes held by this rank, per memory tier", "tier")
    for tier, nbytes in per_tier.items():
        bytes_gauge.labels(str(tp_rank), tier).set(nbytes)
    gauge("engram_placement", "configured Engram table placement (1)", "placement").labels(
        str(tp_rank), placement).set(1)
