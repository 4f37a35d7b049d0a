"""`sglang-dsv41 demo`: renders with the card's defaults and generates with the reference."""
from __future__ import annotations

import json

from sglang_dsv41.cli import main
from sglang_dsv41.reference.model import ReferenceModel


def _demo(capsys, *args: str) -> dict:
    assert main(["demo", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_demo_default_is_thinking_at_effort_50_and_matches_the_reference(capsys, tiny_checkpoint) -> None:
    out = _demo(capsys, "--checkpoint", str(tiny_checkpoint), "--max-new-tokens", "6")
    assert out["thinking"] is True and out["effort"] == 50
    assert "Reasoning Effort: 50" in out["prompt"] and out["prompt"].endswith("<think>")
    assert out["prompt_ids"][0] == 0  # BOS
    ref = ReferenceModel.from_checkpoint(tiny_checkpoint)
    assert out["output_ids"] == ref.generate(out["prompt_ids"], 6, stop_ids=ref.cfg.eos_ids)


def test_demo_thinking_off_renders_closed_think(capsys, tiny_checkpoint) -> None:
    out = _demo(capsys, "--checkpoint", str(tiny_checkpoint), "--thinking", "off", "--max-new-tokens", "2")
    assert out["thinking"] is False and "Reasoning Effort" not in out["prompt"]
    assert out["prompt"].endswith("</think>")


def test_demo_rejects_zero_tokens(capsys) -> None:
    assert main(["demo", "--max-new-tokens", "0"]) == 2
