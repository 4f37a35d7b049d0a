"""benchmarks/model_step.py on CPU (tiny preset, eager calls: its graphs are GPU-only): the record
holds both modes per batch size with their outputs compared, and the decode case is the server's
(static layout, one token per request at position context − 1, rows of its own slots)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import model_step as bench  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return bench.build_engine("tiny", 0, torch.device("cpu"))


def test_record_per_batch_and_mode(engine, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "build_engine", lambda *a: engine)
    assert bench.main(["--preset", "tiny", "--batches", "1", "3", "--context", "16", "--device", "cpu",
                       "--cap-s", "0.05", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "model_step.json").read_text())
    assert [r["batch"] for r in rec["rows"]] == [1, 3] and rec["skipped"] == []
    for r in rec["rows"]:
        assert r["layers"] == engine.text.num_hidden_layers and r["bits_equal"] is True
        for mode in bench.MODES:
            assert r[mode]["step_us"] > 0 and r[mode]["layer_us"] == round(r[mode]["step_us"] / r["layers"], 1)
        assert r["on_over_off"] == round(r["on"]["step_us"] / r["off"]["step_us"], 4)


def test_fp32_activations_run_is_recorded_and_restored(engine, tmp_path: Path, monkeypatch) -> None:
    """MODEL_STEP_ACTIVATIONS=fp32: the run inside `fp32_activations.Fp32Activations` (the backend's methods
    patched for its duration, then restored), the record says so; an unknown value stops the run."""
    from sglang_dsv41.runtime import attention_ops
    monkeypatch.setattr(bench, "build_engine", lambda *a: engine)
    monkeypatch.setenv(bench.ACTIVATIONS_ENV, "fp32")
    attend = attention_ops.KernelAttentionOps.attend
    assert bench.main(["--preset", "tiny", "--batches", "1", "--context", "16", "--device", "cpu",
                       "--cap-s", "0.05", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "model_step.json").read_text())
    assert rec["activations"] == "fp32" and rec["rows"][0]["bits_equal"] is True
    assert "linear_fp8" not in vars(engine.backend) and attention_ops.KernelAttentionOps.attend is attend
    monkeypatch.setenv(bench.ACTIVATIONS_ENV, "bf17")
    with pytest.raises(SystemExit, match="MODEL_STEP_ACTIVATIONS"):
        bench.main(["--preset", "tiny", "--batches", "1", "--device", "cpu", "--out", str(tmp_path)])


def test_decode_case_is_one_token_per_request_at_the_context_end(engine) -> None:
    seen = {}

    def spy(ids, layout, caches):
        seen.update(ids=ids, layout=layout, caches=caches)
        return torch.zeros(ids.shape[0], engine.text.hidden_size)

    forward, ring, snapshot = bench.decode_case(engine, 3, 16)
    engine_hidden, engine.hidden_states = engine.hidden_states, spy
    try:
        forward()
    finally:
        engine.hidden_states = engine_hidden
    layout = seen["layout"]
    assert layout.static and layout.num_tokens == 3
    assert layout.positions.tolist() == [15, 15, 15] and layout.req_rows.tolist() == [1, 2, 3]
    assert layout.out_slots.tolist() == [bench.PAGE + 16 * b + 15 for b in range(3)]
    assert int(seen["caches"].latent_rows.max()) < 120                 # random bytes without NaN codes
    assert torch.equal(ring.ids, snapshot[0]) and torch.equal(ring.end, snapshot[1])


def test_plot_only_mode(tmp_path: Path) -> None:
    """`--plot LABEL=JSON` draws from earlier records without running: 0 with a PNG where matplotlib is
    installed, 1 without it (this CPU machine)."""
    rec = dict(device="cpu", layers=2, context=16, rows=[dict(batch=b, off=dict(layer_us=10.0 * b), on=dict(layer_us=9.0 * b))
                                                         for b in (1, 8)])
    src = tmp_path / "a.json"
    src.write_text(json.dumps(rec))
    from plotting import pyplot
    rc = bench.main(["--plot", f"triton={src}", "--out", str(tmp_path / "png")])
    assert rc == (0 if pyplot() is not None else 1)
    assert (tmp_path / "png" / "model_step.png").exists() == (rc == 0)


def test_plot_of_records_without_rows_writes_nothing(tmp_path: Path) -> None:
    """A record whose every batch was skipped (its budget spent on the build) draws no PNG and does not
    fail the run (session 29: an empty log-scale plot raised after the JSON was written)."""
    from plotting import pyplot
    if pyplot() is None:
        pytest.skip("matplotlib is not installed")
    empty = dict(device="cpu", layers=2, context=16, rows=[], skipped=[1, 8])
    assert bench.plot({"slice": empty}, tmp_path / "model_step.png")
    assert not (tmp_path / "model_step.png").exists()
    full = dict(empty, rows=[dict(batch=1, off=dict(layer_us=10.0), on=dict(layer_us=9.0))])
    assert bench.plot({"empty": empty, "full": full}, tmp_path / "model_step.png")
    assert (tmp_path / "model_step.png").exists()


def test_table_width_is_the_static_bound_and_leaves_the_step_unchanged(engine, tmp_path: Path, monkeypatch) -> None:
    """`--table-width`: the request-to-token table is that wide (the static layout's max_seq_len: the
    served context length), its first `context` columns the requests' slots; one mode timed; the
    hidden states equal those of a table as wide as the context (the padding columns are never read
    as keys)."""
    seen = []

    def forward_of(width):
        forward, ring, snapshot = bench.decode_case(engine, 2, 16, table_width=width)
        hidden = engine.hidden_states

        def spy(ids, layout, caches):
            seen.append(layout)
            return hidden(ids, layout, caches)
        engine.hidden_states = spy
        try:
            return forward()
        finally:
            engine.hidden_states = hidden

    narrow, wide = forward_of(None), forward_of(64)
    assert [lay.max_seq_len for lay in seen] == [16, 64] and seen[1].req_to_token.shape == (3, 64)
    assert torch.equal(seen[1].req_to_token[:, :16], seen[0].req_to_token)
    assert int(seen[1].req_to_token[:, 16:].abs().sum()) == 0
    assert torch.equal(narrow, wide)
    with pytest.raises(ValueError, match="table width"):
        bench.decode_case(engine, 1, 16, table_width=8)
    monkeypatch.setattr(bench, "build_engine", lambda *a: engine)
    assert bench.main(["--preset", "tiny", "--batches", "1", "--context", "16", "--table-width", "16", "32",
                       "--modes", "on", "--device", "cpu", "--cap-s", "0.05", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "model_step.json").read_text())
    assert rec["table_widths"] == [16, 32] and rec["modes"] == ["on"]
    assert [(r["batch"], r["table_width"]) for r in rec["rows"]] == [(1, 16), (1, 32)]
    assert all(r["on"]["step_us"] > 0 and "off" not in r and "bits_equal" not in r for r in rec["rows"])


def test_plot_dispatch_by_table_widths(monkeypatch, tmp_path: Path) -> None:
    """A record of several table widths draws µs per layer against the width, others against the batch."""
    drawn = []
    monkeypatch.setattr(bench, "plot_widths", lambda records, path: drawn.append("widths") or True)
    monkeypatch.setattr(bench, "plot", lambda records, path: drawn.append("batches") or True)
    assert bench._plot_any({"a": dict(table_widths=[16, 32], rows=[])}, tmp_path / "p.png")
    assert bench._plot_any({"a": dict(table_widths=[16], rows=[])}, tmp_path / "p.png")
    assert bench._plot_any({"a": dict(rows=[])}, tmp_path / "p.png")
    assert drawn == ["widths", "batches", "batches"]
