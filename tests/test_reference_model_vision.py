"""Image prompts through the whole reference model (spec §3.1, §3.3.1–§3.3.2, §3.6, §5.3):
span merge and markers, image-routing bias, Engram ungating/blocking, id remap, chunking."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sglang_dsv41.engram_hash import MULTIMODAL_PAD_ID_BASE
from sglang_dsv41.reference import model as model_mod
from sglang_dsv41.reference import moe as moe_mod
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.reference.ops import bf16

from reference_weights import TINY_TEST_COMPRESSED_VOCAB, random_reference_weights, tiny_config

CFG = tiny_config()
T_CFG = CFG.text
IMG_ID = CFG.image_token_id
WEIGHTS = random_reference_weights(CFG, seed=21, dspark=False)
# 84×84 = min_pixels → 6×6 patches → 2×2 grid → [start, f, f, nl, f, f, nl, end] = 8 rows
IMAGE = Image.fromarray(np.random.default_rng(5).integers(0, 256, (84, 84, 3), dtype=np.uint8))
PROMPT = [0, 17, 300, 41, IMG_ID, 55, 66, 77, 88, 99, 123, 234, 345, 456]
SPAN_START, SPAN_LEN = 4, 8



def make_model(weights=WEIGHTS, cfg=CFG) -> ReferenceModel:
    return ReferenceModel(cfg, weights, engram_token_map=np.arange(TINY_TEST_COMPRESSED_VOCAB))


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return make_model()


@pytest.fixture(scope="module")
def encoded(model: ReferenceModel):
    return model.encode_images(PROMPT, [IMAGE])


@pytest.fixture(scope="module")
def full_logits(model: ReferenceModel, encoded) -> torch.Tensor:
    ids, spans = encoded
    return model.forward(model.new_request(), ids, spans).logits


def _image_mask(n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[SPAN_START:SPAN_START + SPAN_LEN] = True
    return mask


def test_span_expansion_and_merge(model: ReferenceModel, encoded) -> None:
    ids, spans = encoded
    assert len(ids) == len(PROMPT) - 1 + SPAN_LEN
    assert [(s, r.shape[0]) for s, r in spans] == [(SPAN_START, SPAN_LEN)]
    assert ids[SPAN_START:SPAN_START + SPAN_LEN] == [IMG_ID] * SPAN_LEN
    e = model.embed(model.remap_ids(torch.tensor(ids)), spans)
    rows = e[SPAN_START:SPAN_START + SPAN_LEN]
    assert torch.equal(rows, bf16(spans[0][1]))
    assert torch.equal(rows[0], bf16(WEIGHTS["image_start"]))
    assert torch.equal(rows[3], bf16(WEIGHTS["image_newline"])) and torch.equal(rows[6], rows[3])
    assert torch.equal(rows[-1], bf16(WEIGHTS["image_end"]))
    text = ~_image_mask(len(ids))
    assert torch.equal(e[text], WEIGHTS["embed.weight"][torch.tensor(ids)[text]])


@pytest.mark.parametrize("chunk", [3, 5, 6])
def test_image_prompt_chunked_equals_one_shot(model: ReferenceModel, encoded, full_logits, chunk: int) -> None:
    """Chunk edges inside the span (span rows are split between forward calls)."""
    ids, spans = encoded
    state = model.new_request()
    last = model.prefill(state, ids, spans, chunk=chunk)
    assert torch.equal(last, full_logits[-1])
    assert torch.isfinite(full_logits).all()


def test_multimodal_pad_ids_are_remapped(model: ReferenceModel, encoded, full_logits) -> None:
    ids, spans = encoded
    padded = [MULTIMODAL_PAD_ID_BASE + 7 * i if t == IMG_ID else t for i, t in enumerate(ids)]
    assert torch.equal(model.forward(model.new_request(), padded, spans).logits, full_logits)


def test_vl_bias_routes_only_image_rows(model: ReferenceModel, encoded, full_logits,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ids, spans = encoded
    seen: list[torch.Tensor] = []
    moe = moe_mod.moe_sublayer

    def rec(cfg, w, prefix, x, **k):
        seen.append(k["image_rows"].clone())
        return moe(cfg, w, prefix, x, **k)

    monkeypatch.setattr(moe_mod, "moe_sublayer", rec)
    model.forward(model.new_request(), ids, spans)
    assert len(seen) == T_CFG.num_hidden_layers
    assert all(torch.equal(m, _image_mask(len(ids))) for m in seen)
    monkeypatch.setattr(moe_mod, "moe_sublayer", moe)

    shifted = dict(WEIGHTS)
    for i in range(T_CFG.num_hidden_layers):
        bias_vl = WEIGHTS[f"layers.{i}.ffn.gate.bias_vl"].clone()
        bias_vl[int(torch.argmin(bias_vl))] += 50.0          # a different expert for image rows
        shifted[f"layers.{i}.ffn.gate.bias_vl"] = bias_vl
    other = make_model(shifted).forward(make_model(shifted).new_request(), ids, spans).logits
    assert torch.equal(other[:SPAN_START], full_logits[:SPAN_START])       # causal: before the span
    assert not torch.equal(other[SPAN_START:SPAN_START + SPAN_LEN], full_logits[SPAN_START:SPAN_START + SPAN_LEN])
    text_only = [t for t in ids if t != IMG_ID]
    assert torch.equal(make_model(shifted).forward(make_model(shifted).new_request(), text_only).logits,
                       model.forward(model.new_request(), text_only).logits)


def test_engram_ungates_image_rows_and_blocks_lookback(model: ReferenceModel, encoded,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ids, spans = encoded
    engram_io: list[tuple[torch.Tensor, torch.Tensor]] = []
    eng = model_mod.engram_residual_update

    def rec(R, *a, **k):
        out = eng(R, *a, **k)
        engram_io.append((R.clone(), out.clone()))
        return out

    row_ids: list[list[torch.Tensor]] = []
    hasher_rows = model.hasher.row_ids

    def rec_rows(*a, **k):
        out = hasher_rows(*a, **k)
        row_ids.append(out)
        return out

    monkeypatch.setattr(model_mod, "engram_residual_update", rec)
    monkeypatch.setattr(model.hasher, "row_ids", rec_rows)
    model.forward(model.new_request(), ids, spans)
    image = _image_mask(len(ids))
    assert len(engram_io) == len(T_CFG.engram_layer_ids)
    for R_in, R_out in engram_io:
        assert torch.equal(R_out[image], R_in[image])                    # image rows untouched
        assert not torch.equal(R_out[~image], R_in[~image])
    # first token after the span: every look-back hits the image, so every shift ≥ 1 is blocked
    # and its row ids equal those of the same token at position 0
    after = SPAN_START + SPAN_LEN
    alone = hasher_rows(torch.tensor([ids[after]]), torch.tensor([0]), model.hasher.new_history(1)[0])
    for layer_rows, ref in zip(row_ids[0], alone):
        assert torch.equal(layer_rows[after], ref[0])


def test_generate_with_image(model: ReferenceModel, full_logits) -> None:
    out = model.generate(PROMPT, 3, images=[IMAGE], chunk=6)
    assert out[0] == int(full_logits[-1].argmax())
    assert out == model.generate(PROMPT, 3, images=[IMAGE])


def test_image_input_errors(model: ReferenceModel, encoded) -> None:
    ids, spans = encoded
    with pytest.raises(ValueError, match="image_token_id"):
        model.forward(model.new_request(), ids, [(0, spans[0][1])])     # span over text ids
    with pytest.raises(ValueError, match="placeholders"):
        model.generate(PROMPT, 1, images=[IMAGE, IMAGE])
    text_cfg = tiny_config(vision=False)
    text_model = make_model(random_reference_weights(text_cfg, seed=3, vision=False, dspark=False), text_cfg)
    with pytest.raises(ValueError, match="no vision"):
        text_model.forward(text_model.new_request(), ids, spans)
    with pytest.raises(ValueError, match="vocabulary"):                # no remap without vision
        text_model.forward(text_model.new_request(), [5, MULTIMODAL_PAD_ID_BASE])
