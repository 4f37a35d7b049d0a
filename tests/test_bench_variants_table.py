"""benchmarks/variants_table.py: the variants JSON of `decode_step.py --variants` as markdown tables."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import variants_table as vt  # noqa: E402


def test_tables_mark_the_fastest_and_keep_errors() -> None:
    result = {"rows": {
        "8": {"attention": {"decode_splits": {"graph_us": 80.0}, "gather_decode": {"graph_us": 40.0, "max_scale_ulps": 0.0},
                            "flashmla_decode": {"error": "RuntimeError: no kernel"}}},
        "1": {"attention": {"decode_splits": {"graph_us": 30.0}, "gather_decode": {"graph_us": 33.0, "max_scale_ulps": 0.0}},
              "moe_routed": {"default": {"graph_us": 70.0}}}}}
    text = vt.tables(result)
    lines = text.splitlines()
    assert lines[0] == "### attention" and "| variant | N = 1 | N = 8 |" in text      # batches in numeric order
    gather = next(line for line in lines if line.startswith("| gather_decode"))
    assert "33.0 (1.10×) ulps 0" in gather and "**40.0 (0.50×)** ulps 0" in gather
    assert "**30.0 (1.00×)**" in next(line for line in lines if line.startswith("| decode_splits"))
    flash = next(line for line in lines if line.startswith("| flashmla_decode"))
    assert "—" in flash and "error: RuntimeError: no kernel" in flash
    assert "### moe_routed" in text and "| default | **70.0 (1.00×)** | — |" in text
