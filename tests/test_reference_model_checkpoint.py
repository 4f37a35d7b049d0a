"""The reference model on the real tiny checkpoint (writer `checkpoint.synth`, reader
`checkpoint.loader`, tiny tokenizer): load → prompt → generate (spec §2, §3, §7)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.reference.state import NumericsProfile



@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(tiny_checkpoint)


def test_tiny_checkpoint_generates(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. It was")
    assert ids[0] == model.cfg.bos_token_id and len(ids) > 8
    out = model.forward(model.new_request(), ids)
    assert torch.isfinite(out.logits).all()
    tokens = model.generate(ids, 16)
    assert len(tokens) == 16
    assert len(set(tokens)) > 1                          # not a constant stream
    assert all(0 <= t < model.text.vocab_size for t in tokens)
    assert model.generate(ids, 16, chunk=7) == tokens    # chunked prefill, same greedy tokens
    assert isinstance(model.tokenizer.decode(tokens), str)


def test_tiny_checkpoint_profiles_and_engram_token_map(model: ReferenceModel, tiny_checkpoint: Path) -> None:
    t = model.text
    assert model.hasher is not None
    assert int(model.hasher.token_map.max()) + 1 == t.engram_compressed_vocab_size
    ids = model.tokenizer.encode("hello hello world")
    fp4 = ReferenceModel.from_checkpoint(tiny_checkpoint, NumericsProfile.parse("fp4"))
    a = model.forward(model.new_request(), ids).logits
    b = fp4.forward(fp4.new_request(), ids).logits
    assert torch.isfinite(b).all() and not torch.equal(a, b)


def test_from_checkpoint_requires_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ReferenceModel.from_checkpoint(tmp_path)
