"""CPU checks of benchmarks/sglang_v4_results.py: the per-layer prefill rate rule (never from a worker's
first timed batch), merging runs of one model timed in separate calls (and refusing anything else)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sglang_v4_results as res  # noqa: E402


def _worker(layers: int, runs: list[tuple[int, float, float]]) -> dict:
    """A worker record: warm-up run first, then (batch, prefill_s, step_us) runs at context 8192."""
    warm = {"batch": 1, "context": 256, "prefill_s": 0.1, "step_median_us": 1.0, "warmup": True}
    return {"layers": layers, "runs": [warm] + [{"batch": b, "context": 8192, "prefill_s": p, "step_median_us": u}
                                                for b, p, u in runs]}


def _result(batches: list[int], lo: list, hi: list, context: int = 8192) -> dict:
    return {"configs": {"2": {"hidden_size": 4096}, "4": {"hidden_size": 4096}}, "context": context,
            "layer_counts": [2, 4], "batches": batches, "workers": [_worker(2, lo), _worker(4, hi)],
            "errors": [], "wall_s": 10.0}


def test_prefill_rate_skips_each_workers_first_timed_batch():
    r = _result([8, 64], [(8, 9.0, 2000.0), (64, 2.0, 2600.0)], [(8, 12.0, 2400.0), (64, 4.0, 3200.0)])
    rows = {row["batch"]: row for row in res.per_layer(res.steps_by_layers(r), [2, 4], [8, 64])}
    assert rows[8]["per_layer_us"] == pytest.approx(200.0)
    assert "prefill_tokens_per_s_per_layer" not in rows[8]             # first timed: may hold JIT time
    assert rows[64]["prefill_tokens_per_s_per_layer"] == pytest.approx(64 * 8192 / 1.0)
    assert rows[64]["fixed_us"] == pytest.approx(2600.0 - 2 * 300.0)


def test_merge_combines_batches_of_separate_runs():
    a = _result([1], [(1, 0.6, 2000.0)], [(1, 0.7, 2400.0)])
    b = _result([8, 64], [(8, 0.8, 2100.0), (64, 2.0, 2600.0)], [(8, 1.1, 2500.0), (64, 4.0, 3200.0)])
    m = res.merge([a, b], ["a.json", "b.json"])
    assert m["batches"] == [1, 8, 64] and m["errors"] == []
    assert [round(r["per_layer_us"]) for r in m["per_layer"]] == [200, 200, 300]
    assert [s["file"] for s in m["merged_from"]] == ["a.json", "b.json"] and len(m["workers"]) == 4


def test_merge_refuses_other_models_contexts_and_repeated_batches():
    a = _result([1], [(1, 0.6, 2000.0)], [(1, 0.7, 2400.0)])
    other = _result([8], [(8, 0.8, 2100.0)], [(8, 1.1, 2500.0)])
    other["configs"]["4"]["hidden_size"] = 7168
    with pytest.raises(ValueError, match="'configs' differs"):
        res.merge([a, other], ["a", "other"])
    with pytest.raises(ValueError, match="'context' differs"):
        res.merge([a, _result([8], [(8, 1, 1)], [(8, 1, 1)], context=4096)], ["a", "short"])
    with pytest.raises(ValueError, match="batch 1 is in both a and again"):
        res.merge([a, a], ["a", "again"])


def test_merge_cli_writes_the_json(tmp_path):
    files = []
    for name, r in (("a", _result([1], [(1, 0.6, 2000.0)], [(1, 0.7, 2400.0)])),
                    ("b", _result([256], [(256, 8.0, 4800.0)], [(256, 16.0, 7500.0)]))):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(r))
    rc = res.main(["merge", str(tmp_path / "m.json"), *map(str, files)])
    assert rc == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert [r["batch"] for r in m["per_layer"]] == [1, 256]
    assert m["per_layer"][1]["per_layer_us"] == pytest.approx(1350.0)


def test_ours_graph_us_reads_the_graphed_layer_step(tmp_path):
    (tmp_path / "decode_step.json").write_text(json.dumps(
        {"decode": [{"tokens": 1, "layer_us_graph": 1062.0}, {"tokens": 8, "layer_us_graph": None}]}))
    assert res.ours_graph_us(tmp_path / "decode_step.json") == {1: 1062.0}
    assert res.ours_graph_us(tmp_path / "missing.json") == {}
