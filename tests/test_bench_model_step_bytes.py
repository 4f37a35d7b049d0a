"""benchmarks/model_step_bytes.py on CPU: a layer's bytes are decode_step's with its experts replaced by
the model's routed spread, the shares follow from them, and the run writes both shares per record."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import model_step_bytes as bench  # noqa: E402

#: 4 routed experts of 100 bytes each; decode_step touched 1 / 2 experts at N = 1 / 8 (graph bytes 150 / 400)
DECODE = {"stored_layer_bytes": {"experts": 400, "dense": 50},
          "decode": [{"tokens": 1, "distinct_experts": 1, "graph": {"bytes": {"current": 150, "design": 140}}},
                     {"tokens": 8, "distinct_experts": 2, "graph": {"bytes": {"current": 400, "design": 390}}},
                     {"tokens": 64, "distinct_experts": 3, "graph": {"median_us": None}}]}
STEP = {"rows": [{"batch": 1, "on": {"layer_us": 1.5}}, {"batch": 8, "on": {"layer_us": 4.0}},
                 {"batch": 64, "on": {"layer_us": 9.0}}]}


def test_layer_bytes_swap_the_experts_and_shares_follow() -> None:
    by_n = bench.layer_bytes(DECODE, {1: 1.0, 8: 3.5, 64: 4.0}, 4)
    assert set(by_n) == {1, 8}                                 # N = 64 has no bytes in the decode record
    assert by_n[1]["bytes"] == 150 and by_n[8]["bytes"] == 400 + 1.5 * 100
    rows = bench.shares(STEP, by_n, copy_gbs=1e-3)             # 1 MB/s: share = bytes / µs
    assert [r["tokens"] for r in rows] == [1, 8]
    assert rows[0]["share"] == pytest.approx(150 / 1.5) and rows[1]["share"] == pytest.approx(550 / 4.0)
    assert rows[1]["share_by_decode_bytes"] == pytest.approx(400 / 4.0)


def test_run_writes_both_shares(tmp_path: Path, monkeypatch) -> None:
    decode, step = tmp_path / "decode.json", tmp_path / "step.json"
    decode.write_text(json.dumps(DECODE))
    step.write_text(json.dumps(STEP))
    seen = {}

    def spread(layers, batches, draws=4):
        seen.update(layers=layers, batches=batches)
        return {"n_routed_experts": 4, "per_batch": [{"tokens": n, "distinct_experts": 2.0} for n in batches]}

    monkeypatch.setattr(bench, "model_spread", spread)
    assert bench.main(["--decode-step", str(decode), "--model-step", f"A={step}@0.001", "--layers", "2",
                       "--out", str(tmp_path)]) == 0
    assert seen == {"layers": 2, "batches": (1, 8, 64)}
    rec = json.loads((tmp_path / "model_step_bytes.json").read_text())
    assert rec["runs"]["A"]["copy_gbs"] == 0.001
    assert [r["bytes"] for r in rec["runs"]["A"]["rows"]] == [250.0, 400.0]
