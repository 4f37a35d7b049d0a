"""`benchmarks/decode_glue.py`: the CPU census of a decode step's launches.

Pinned: views, allocations and metadata ops are not counted as launches, kernels are; the summary counts
by file and site and keeps the order; `--pattern slice4` gives the tiny widths the 4-layer Flash slice's
layer roles (a ratio-2 kv source with its indexer at layer 2, its reader at 3, Engram at 1); the plot
mode writes a PNG (when matplotlib is installed).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_glue as DG  # noqa: E402


def test_only_kernel_launching_ops_count() -> None:
    for name in ("aten.view.default", "aten.empty.memory_format", "aten.slice.Tensor", "aten.expand.default",
                 "aten.sym_size.int", "aten.t.default", "aten.unsqueeze.default"):
        assert not DG.launches_kernel(name), name
    for name in ("aten.add.Tensor", "aten.index.Tensor", "aten.copy_.default", "aten.where.self", "aten.topk.default",
                 "aten.to.dtype", "aten.tanh.default"):
        assert DG.launches_kernel(name), name


def test_summary_counts_by_file_and_site_in_order() -> None:
    order = [("runtime/a.py:3", "aten.add.Tensor"), ("kernels/k.py:9", "triton"), ("runtime/a.py:3", "aten.mul.Tensor"),
             ("runtime/b.py:1", "aten.where.self")]
    r = DG.summarise(order)
    assert (r["launches"], r["triton"], r["torch"]) == (4, 1, 3)
    assert r["by_file"] == {"runtime/a.py": 2, "kernels/k.py": 1, "runtime/b.py": 1}
    assert r["by_site"]["runtime/a.py:3"] == 2 and r["order"][1] == "kernels/k.py:9 triton"


def test_slice4_pattern_gives_the_flash_slice_roles(tmp_path) -> None:
    from sglang_dsv41.config import DeepseekV41Config

    cfg = DeepseekV41Config.from_file(DG.model_dir("slice4", tmp_path / "m")).text
    assert cfg.num_hidden_layers == 4 and list(cfg.kv_source_layer_ids) == [2]
    assert list(cfg.engram_layer_ids) == [1] and list(cfg.compress_ratios[:4]) == [0, 0, 2, 2]
    assert cfg.hidden_size == 64                                             # the tiny widths


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    run = dict(pattern="slice4", batch=1, context=256, **DG.summarise([("runtime/a.py:1", "aten.add.Tensor")] * 5))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(run))
    assert DG.plot([("a", run), ("b", json.loads(path.read_text()))], tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 1000
