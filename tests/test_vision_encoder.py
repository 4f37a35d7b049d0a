"""Vision tower (spec §5.2–§5.3, §3.1): 2-D RoPE, unfold order, span layout, encoder, placeholder
expansion. Random tiny weights built from `tensor_inventory(cfg)`."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import tiny_config_dict
from sglang_dsv41.reference.vision import (
    VisionEncoder,
    apply_rope_half_split,
    build_span_rows,
    expand_image_placeholders,
    unfold_features,
    vision_rope_angles,
)
from sglang_dsv41.vision_preprocess import preprocess_image

CFG = DeepseekV41Config.from_dict(tiny_config_dict(500))


def random_vision_weights(cfg: DeepseekV41Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random vision/aligner/marker tensors, BF16-valued (norms fp32 around 1)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in tensor_inventory(cfg, dspark=False):
        if spec.group != "vision":
            continue
        t = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
        if spec.name.endswith("norm1.weight") or spec.name.endswith("norm2.weight") or spec.name == "vision.norm.weight":
            t = 1.0 + 0.1 * t
        elif spec.name.endswith(".bias"):
            t = 0.1 * t
        elif len(spec.shape) == 2:
            t = t / math.sqrt(spec.shape[1])
        out[spec.name] = t if spec.kind is Kind.FP32 else t.to(torch.bfloat16).to(torch.float32)
    return out


WEIGHTS = random_vision_weights(CFG)


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


# ---- 2-D RoPE -----------------------------------------------------------------------------------

def test_rope_angles_explicit():
    vit_h, vit_w, hd, theta = 3, 4, 32, 10000.0
    ang = vision_rope_angles(vit_h, vit_w, hd, theta)
    rope_dim = hd // 2
    assert ang.shape == (vit_h * vit_w, rope_dim) and ang.dtype == torch.float32
    for r in range(vit_h):
        for c in range(vit_w):
            for i in range(rope_dim // 2):
                f = theta ** (-2 * i / rope_dim)
                assert ang[r * vit_w + c, i].item() == pytest.approx(r * f, rel=1e-6, abs=1e-7)
                assert ang[r * vit_w + c, rope_dim // 2 + i].item() == pytest.approx(c * f, rel=1e-6, abs=1e-7)


def test_rope_half_split_matches_complex_rotation():
    gen = torch.Generator().manual_seed(1)
    vit_h, vit_w, heads, hd = 4, 5, 2, 32
    x = torch.randn(vit_h * vit_w, heads, hd, generator=gen, dtype=torch.float32)
    got = apply_rope_half_split(x, vision_rope_angles(vit_h, vit_w, hd, 10000.0))
    # Independent: pair j = (x[j], x[j + hd/2]) as a complex number, rotated by e^{iθ_j} in float64.
    half, quarter = hd // 2, hd // 4
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    theta = torch.empty(vit_h * vit_w, half, dtype=torch.float64)
    for r in range(vit_h):
        for c in range(vit_w):
            for i in range(quarter):
                f = 10000.0 ** (-i / quarter)
                theta[r * vit_w + c, i] = r * f
                theta[r * vit_w + c, quarter + i] = c * f
    rot = z * torch.polar(torch.ones_like(theta), theta)[:, None, :]
    want = torch.cat([rot.real, rot.imag], dim=-1).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_on_relative_2d_offset():
    gen = torch.Generator().manual_seed(2)
    hd = 32
    q = torch.randn(1, 1, hd, generator=gen).expand(25, 1, hd)
    k = torch.randn(1, 1, hd, generator=gen).expand(25, 1, hd)
    ang = vision_rope_angles(5, 5, hd, 10000.0)
    qr, kr = apply_rope_half_split(q, ang)[:, 0], apply_rope_half_split(k, ang)[:, 0]
    idx = lambda r, c: r * 5 + c  # noqa: E731
    # same (Δr, Δc) = (1, 2) at two places ⇒ same score; a transposed offset ⇒ different score
    s1 = qr[idx(1, 0)] @ kr[idx(0, 2)]
    s2 = qr[idx(4, 2)] @ kr[idx(3, 4)]
    s3 = qr[idx(2, 1)] @ kr[idx(0, 0)]
    torch.testing.assert_close(s1, s2, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(s1, s3, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(apply_rope_half_split(q, ang)[0], q[0])  # (0, 0) is the identity


# ---- unfold + span --------------------------------------------------------------------------------

@pytest.mark.parametrize("vit_h, vit_w", [(6, 6), (7, 5), (1, 4)])
def test_unfold_matches_explicit_loop(vit_h, vit_w):
    k, d = 3, 4
    feats = torch.randn(vit_h * vit_w, d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = unfold_features(feats, vit_h, vit_w, k)
    gh, gw = -(-vit_h // k), -(-vit_w // k)
    want = torch.zeros(gh * gw, d * k * k, dtype=torch.bfloat16)
    for gi in range(gh):
        for gj in range(gw):
            for ch in range(d):
                for ki in range(k):
                    for kj in range(k):
                        r, c = gi * k + ki, gj * k + kj
                        if r < vit_h and c < vit_w:
                            want[gi * gw + gj, ch * k * k + ki * k + kj] = feats[r * vit_w + c, ch]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_span_layout():
    n_h, n_w, hidden = 3, 4, 5
    feats = torch.arange(n_h * n_w, dtype=torch.float32)[:, None].expand(n_h * n_w, hidden) + 1.0
    start, newline, end = (torch.full((hidden,), v) for v in (-1.0, -2.0, -3.0))
    rows = build_span_rows(feats, n_h, n_w, start, newline, end)
    assert rows.shape == (n_h * (n_w + 1) + 2, hidden)
    labels = rows[:, 0].tolist()
    want = [-1.0]
    for i in range(n_h):
        want += [1.0 + i * n_w + j for j in range(n_w)] + [-2.0]
    want += [-3.0]
    assert labels == want


# ---- encoder ----------------------------------------------------------------------------------

def test_encoder_shape_dtype_markers():
    enc = VisionEncoder(CFG, WEIGHTS)
    pre = preprocess_image(_image(0, (84, 84)), CFG.vision)
    out = enc.encode(pre)
    assert out.shape == (8, CFG.text.hidden_size) and out.dtype == torch.bfloat16
    bf = lambda n: WEIGHTS[n].to(torch.bfloat16)  # noqa: E731
    assert torch.equal(out[0], bf("image_start")) and torch.equal(out[-1], bf("image_end"))
    assert torch.equal(out[3], bf("image_newline")) and torch.equal(out[6], bf("image_newline"))
    assert torch.isfinite(out.float()).all()


def test_encoder_resize_path_and_non_square():
    enc = VisionEncoder(CFG, WEIGHTS)
    assert enc.encode(preprocess_image(_image(1, (420, 420)), CFG.vision)).shape == (32, 64)
    pre = preprocess_image(_image(2, (100, 84)), CFG.vision)  # 8×6 patches → 2×3 grid (zero-padded unfold)
    assert (pre.grid.vit_h, pre.grid.vit_w, pre.grid.n_h, pre.grid.n_w) == (6, 8, 2, 3)
    assert enc.encode(pre).shape == (pre.grid.num_tokens, 64) == (10, 64)


def test_encoder_deterministic_and_image_dependent():
    pre_a = preprocess_image(_image(3, (84, 84)), CFG.vision)
    pre_b = preprocess_image(_image(4, (84, 84)), CFG.vision)
    a1 = VisionEncoder(CFG, WEIGHTS).encode(pre_a)
    a2 = VisionEncoder(CFG, random_vision_weights(CFG)).encode(pre_a)
    b = VisionEncoder(CFG, WEIGHTS).encode(pre_b)
    assert torch.equal(a1, a2)
    feature_rows = [1, 2, 4, 5]
    for r in feature_rows:
        assert not torch.equal(a1[r], b[r])
    assert torch.equal(a1[[0, 3, 6, 7]], b[[0, 3, 6, 7]])
    # and different weights give different features
    c = VisionEncoder(CFG, random_vision_weights(CFG, seed=9)).encode(pre_a)
    assert not torch.equal(a1[feature_rows], c[feature_rows])


def _independent_forward(pre, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 restatement of §5.2–§5.3 with different primitives (SDPA, complex RoPE, conv unfold)."""
    v, g = CFG.vision, pre.grid
    hd, nh = v.head_dim, v.num_attention_heads
    x = pre.patches.float() @ w["vision.patch_embed.proj.weight"].T + w["vision.patch_embed.proj.bias"]
    quarter = hd // 4
    f = 1.0 / (v.rope_theta ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    rr, cc = torch.meshgrid(torch.arange(g.vit_h), torch.arange(g.vit_w), indexing="ij")
    theta = torch.cat([rr.reshape(-1, 1) * f, cc.reshape(-1, 1) * f], dim=1)
    phase = torch.polar(torch.ones_like(theta), theta)[:, None, :]

    def rope(t):  # t [N, heads, hd]
        z = torch.complex(t[..., : hd // 2].double(), t[..., hd // 2:].double()) * phase
        return torch.cat([z.real, z.imag], -1).float()

    def norm(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    for b in range(v.num_hidden_layers):
        p = f"vision.blocks.{b}."
        h = norm(x, w[p + "norm1.weight"]) @ w[p + "attn.wqkv.weight"].T + w[p + "attn.wqkv.bias"]
        q, k, val = (t.reshape(-1, nh, hd) for t in h.split(v.hidden_size, dim=-1))
        o = F.scaled_dot_product_attention(rope(q).transpose(0, 1), rope(k).transpose(0, 1), val.transpose(0, 1))
        x = x + o.transpose(0, 1).reshape(-1, v.hidden_size) @ w[p + "attn.wo.weight"].T + w[p + "attn.wo.bias"]
        gu = norm(x, w[p + "norm2.weight"]) @ w[p + "mlp.w1.weight"].T
        gate, up = gu[:, : v.intermediate_size], gu[:, v.intermediate_size:]
        x = x + (F.silu(gate) * up) @ w[p + "mlp.w2.weight"].T
    x = norm(x, w["vision.norm.weight"])
    kk = v.downsample_ratio
    img = F.pad(x.T.reshape(1, -1, g.vit_h, g.vit_w), (0, (-g.vit_w) % kk, 0, (-g.vit_h) % kk))
    # a k×k stride-k conv with one-hot kernels is the unfold, independent of F.unfold
    d = v.hidden_size
    eye = torch.zeros(d * kk * kk, d, kk, kk)
    for ch in range(d):
        for ki in range(kk):
            for kj in range(kk):
                eye[ch * kk * kk + ki * kk + kj, ch, ki, kj] = 1.0
    cols = F.conv2d(img, eye, stride=kk)[0].reshape(d * kk * kk, -1).T
    hid = F.gelu(cols @ w["aligner.w1.weight"].T + w["aligner.w1.bias"])
    feats = hid @ w["aligner.w2.weight"].T + w["aligner.w2.bias"]
    return feats


def test_encoder_matches_independent_fp32_forward():
    pre = preprocess_image(_image(5, (100, 84)), CFG.vision)
    enc = VisionEncoder(CFG, WEIGHTS)
    got = enc.align(enc.vit(pre), pre).float()
    want = _independent_forward(pre, WEIGHTS)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 0.03 * scale, (err, scale)  # BF16 rounding between modules only


def test_encoder_rejects_bad_weights():
    w = dict(WEIGHTS)
    del w["aligner.w2.bias"]
    with pytest.raises(KeyError, match="aligner.w2.bias"):
        VisionEncoder(CFG, w)
    w = dict(WEIGHTS)
    w["vision.blocks.0.attn.wqkv.weight"] = torch.zeros(10, 10)
    with pytest.raises(ValueError, match="wqkv"):
        VisionEncoder(CFG, w)
    w = dict(WEIGHTS)
    w["vision.blocks.7.norm1.weight"] = torch.ones(64)
    with pytest.raises(KeyError, match="unexpected"):
        VisionEncoder(CFG, w)


# ---- placeholder expansion ------------------------------------------------------------------------

def test_expand_image_placeholders():
    img_id = CFG.image_token_id
    ids = [5, img_id, 7, img_id, 9]
    new_ids, spans = expand_image_placeholders(ids, [_image(0, (84, 84)), _image(1, (420, 420))], CFG)
    assert spans == [(1, 8), (10, 32)]
    assert len(new_ids) == 3 + 8 + 32
    assert new_ids[0] == 5 and new_ids[9] == 7 and new_ids[-1] == 9
    for s, n in spans:
        assert new_ids[s:s + n] == [img_id] * n
    with pytest.raises(ValueError, match="placeholders"):
        expand_image_placeholders(ids, [_image(0, (84, 84))], CFG)
