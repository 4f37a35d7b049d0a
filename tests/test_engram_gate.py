"""Engram gate on the residual (spec §3.3.2, §8 item 14, §11 item 16)."""

import math

import pytest
import torch

from sglang_dsv41.reference.engram import (
    GATE_DOT_FLOOR, engram_embedding, engram_gate, engram_residual_update,
)
from sglang_dsv41.reference.ops import bf16, linear_fp8

EPS = 1e-20
T, HC, H, COLS, D, ROWS = 5, 4, 64, 6, 32, 97


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    R = bf16(torch.randn(T, HC, H, generator=g))
    row_ids = torch.randint(0, ROWS, (T, COLS), generator=g)
    table = bf16(torch.randn(ROWS, D, generator=g) * 0.5)
    wkv = torch.randn((HC + 1) * H, COLS * D, generator=g) * 0.05
    q = bf16(1 + 0.3 * torch.randn(HC, H, generator=g))
    k = bf16(1 + 0.3 * torch.randn(HC, H, generator=g))
    return R, row_ids, table, wkv, q, k


def _plain_linear(x, w):
    return bf16(x.float() @ w.float().t())


def test_matches_slow_per_stream_formula():
    R, row_ids, table, wkv, q, k = _inputs(1)
    out = engram_residual_update(R, row_ids, table, wkv, q, k, EPS, linear=_plain_linear)
    emb = torch.cat([table[row_ids[:, c]] for c in range(COLS)], dim=1)
    kv = _plain_linear(emb, wkv).double()
    for t in range(T):
        value = kv[t, HC * H:]
        for c in range(HC):
            h = R[t, c].double()
            key = kv[t, c * H:(c + 1) * H]
            w = q[c].double() * k[c].double()
            dot = float((h * w * key).sum()) / math.sqrt(float(h.pow(2).mean()) + EPS) \
                / math.sqrt(float(key.pow(2).mean()) + EPS) / math.sqrt(H)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            want = h + gate * value
            # One bf16 rounding of an fp32-vs-fp64 computation: at most one ulp apart.
            assert torch.allclose(out[t, c].double(), want, rtol=2 ** -7, atol=1e-6)


def test_default_linear_is_fp8_linear_and_dtype_preserved():
    R, row_ids, table, wkv, q, k = _inputs(2)
    default = engram_residual_update(R, row_ids, table, wkv, q, k, EPS)
    explicit = engram_residual_update(R, row_ids, table, wkv, q, k, EPS, linear=linear_fp8)
    assert torch.equal(default, explicit) and default.dtype == torch.float32
    assert torch.equal(bf16(default), default)                  # BF16 values
    as_bf16 = engram_residual_update(R.to(torch.bfloat16), row_ids, table.to(torch.bfloat16), wkv,
                                     q, k, EPS)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16.float(), default)


def test_embedding_concatenates_columns_in_order():
    R, row_ids, table, wkv, q, k = _inputs(3)
    seen = {}

    def spy(x, w):
        seen["x"] = x
        return _plain_linear(x, w)

    engram_residual_update(R, row_ids, table, wkv, q, k, EPS, linear=spy)
    for c in range(COLS):
        assert torch.equal(seen["x"][:, c * D:(c + 1) * D], table[row_ids[:, c]])
    assert torch.equal(engram_embedding(row_ids, table), seen["x"])
    with pytest.raises(ValueError):
        engram_embedding(torch.tensor([[0, ROWS]]), table)


def test_image_rows_unchanged():
    R, row_ids, table, wkv, q, k = _inputs(4)
    image = torch.tensor([False, True, False, False, True])
    out = engram_residual_update(R, row_ids, table, wkv, q, k, EPS, image_rows=image)
    ungated = engram_residual_update(R, row_ids, table, wkv, q, k, EPS)
    assert torch.equal(out[image], R[image])
    assert torch.equal(out[~image], ungated[~image])
    assert not torch.equal(out[~image], R[~image])


def _gate_for_dot(scale: float) -> float:
    """h = key = ones and w = scale ⇒ dot = Σ w / (1·1·√H) = scale·√H exactly."""
    hidden = 4
    residual = torch.ones(1, 1, hidden)
    keys = torch.ones(1, 1, hidden)
    q = torch.full((1, hidden), scale)
    return float(engram_gate(residual, keys, q, torch.ones(1, hidden), EPS)[0, 0])


def test_signed_sqrt_and_clamp():
    # dot = 2·scale for H = 4.
    assert _gate_for_dot(2.0) == pytest.approx(1 / (1 + math.exp(-2.0)), rel=1e-6)      # dot 4
    assert _gate_for_dot(-2.0) == pytest.approx(1 / (1 + math.exp(2.0)), rel=1e-6)      # dot −4
    assert _gate_for_dot(0.125) == pytest.approx(1 / (1 + math.exp(-0.5)), rel=1e-6)   # dot 0.25
    # dot = +0: upstream copies the sign (srt/layers/engram.py:1291), so the clamp gives +1e-3
    assert _gate_for_dot(0.0) == pytest.approx(1 / (1 + math.exp(-math.sqrt(GATE_DOT_FLOOR))), rel=1e-7)
    # |dot| = 1e−9 < 1e−6: clamped to √1e−6 = 1e−3 (unclamped would give sigmoid(3.2e−5)).
    tiny = _gate_for_dot(5e-10)
    assert tiny == pytest.approx(1 / (1 + math.exp(-math.sqrt(GATE_DOT_FLOOR))), rel=1e-7)
    assert _gate_for_dot(-5e-10) == pytest.approx(1 - tiny, rel=1e-6)


def test_two_separate_rms_factors():
    """Scaling a stream's residual or its key alone leaves the gate unchanged; a joint RMS
    (one factor over residual and key together, or of their product) would not."""
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(3, HC, H, generator=g)
    keys = torch.randn(3, HC, H, generator=g)
    q = 1 + 0.3 * torch.randn(HC, H, generator=g)
    k = 1 + 0.3 * torch.randn(HC, H, generator=g)
    base = engram_gate(residual, keys, q, k, EPS)
    stream_scale = torch.tensor([1.0, 8.0, 0.01, 3.0])[None, :, None]
    key_scale = torch.tensor([0.002, 1.0, 50.0, 0.5])[None, :, None]
    scaled = engram_gate(residual * stream_scale, keys * key_scale, q, k, EPS)
    assert torch.allclose(scaled, base, rtol=1e-5, atol=1e-6)
    # The same scaling moves a joint-RMS gate: the test has teeth.
    def joint(res, key):
        w = q * k
        inner = (res * w * key).sum(-1)
        both = torch.cat([res, key], dim=-1)
        dot = inner * torch.rsqrt(both.pow(2).mean(-1) + EPS) ** 2 / H ** 0.5  # one RMS, used twice
        return torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())
    assert not torch.allclose(joint(residual * stream_scale, keys * key_scale), joint(residual, keys),
                              rtol=1e-3)
    # Per-stream: changing stream 1's key does not touch stream 0's gate.
    keys2 = keys.clone()
    keys2[:, 1] = torch.randn(3, H, generator=g)
    changed = engram_gate(residual, keys2, q, k, EPS)
    assert torch.equal(changed[:, [0, 2, 3]], base[:, [0, 2, 3]])
    assert not torch.equal(changed[:, 1], base[:, 1])


def test_value_is_last_segment_and_shared_across_streams():
    R, row_ids, table, wkv, q, k = _inputs(6)
    g = torch.Generator().manual_seed(7)
    kv = bf16(torch.randn(T, (HC + 1) * H, generator=g))
    out = engram_residual_update(R, row_ids, table, wkv, q, k, EPS, linear=lambda x, w: kv)
    keys = kv[:, :HC * H].reshape(T, HC, H)
    gate = engram_gate(R, keys, q, k, EPS)
    value = kv[:, HC * H:]
    for c in range(HC):
        assert torch.equal(out[:, c], bf16(R[:, c] + gate[:, c, None] * value))
    # Changing a stream's key slice changes only that stream; changing value changes all.
    kv_key = kv.clone()
    kv_key[:, 2 * H:3 * H] *= -1
    out_key = engram_residual_update(R, row_ids, table, wkv, q, k, EPS, linear=lambda x, w: kv_key)
    assert torch.equal(out_key[:, [0, 1, 3]], out[:, [0, 1, 3]]) and not torch.equal(out_key[:, 2], out[:, 2])
    kv_val = kv.clone()
    kv_val[:, HC * H:] += 1
    out_val = engram_residual_update(R, row_ids, table, wkv, q, k, EPS, linear=lambda x, w: kv_val)
    assert all(not torch.equal(out_val[:, c], out[:, c]) for c in range(HC))


def test_shape_errors():
    R, row_ids, table, wkv, q, k = _inputs(8)
    with pytest.raises(ValueError):
        engram_residual_update(R, row_ids[:-1], table, wkv, q, k, EPS)
    with pytest.raises(ValueError):
        engram_residual_update(R, row_ids, table, wkv[:-1], q, k, EPS)
    with pytest.raises(ValueError):
        engram_residual_update(R, row_ids, table, wkv, q[:-1], k, EPS)
    with pytest.raises(ValueError):
        engram_residual_update(R, row_ids, table, wkv, q, k, EPS, image_rows=torch.zeros(T + 1, dtype=torch.bool))
