"""Vision tower of the pure-PyTorch reference: ViT, 3×3 unfold, aligner, image-span rows.

Spec: `shared/spec/model.md` §5.2 (ViT), §5.3 (aligner, span layout), §3.1 (image merge and
id remap), §2.2 (tensor names/shapes), §11 item 18.

Precision (spec §5.2, §2.4): every module boundary is BF16. Linear layers multiply BF16-valued
operands in fp32 and round the result (bias included) once to BF16; RMSNorm (eps
`VisionConfig.rms_norm_eps` = 1e-6) computes in fp32 with fp32 weights; RoPE is applied in
fp32 and cast back; attention softmax runs in fp32 on the BF16 q/k/v; SwiGLU and GELU (erf)
compute in fp32 and round once. Residual sums are rounded to BF16 after each add.

Invariants
----------
* `VisionEncoder.encode` returns exactly `grid.num_tokens` rows, laid out
  `[image_start] + ([feature × n_w] + [image_newline]) × n_h + [image_end]`.
* The weights mapping must contain exactly the `group == "vision"` tensors of
  `tensor_inventory(cfg)` with their logical shapes; anything missing, mis-shaped or unknown is
  an error (no default values are substituted).
* `expand_image_placeholders` maps the i-th `image_token_id` in the prompt to the i-th image;
  the number of placeholders must equal the number of images.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from PIL import Image

from ..checkpoint.names import tensor_inventory
from ..config import DeepseekV41Config, VisionConfig
from .ops import rms_norm
from ..vision_preprocess import PreprocessedImage, plan_image_grid

_FP32_NAMES_SUFFIX = ("norm1.weight", "norm2.weight")


def linear_bias_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """BF16 tensor of `x @ weight.T + bias`, accumulated in fp32 (bias included), rounded once."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.rms_norm` (fp32 math, fp32 weight, one BF16 rounding) as a BF16 tensor."""
    return rms_norm(x, weight, eps).to(torch.bfloat16)


def vision_rope_angles(vit_h: int, vit_w: int, head_dim: int, theta: float) -> torch.Tensor:
    """fp32 [vit_h·vit_w, head_dim/2] rotation angles of the 2-D RoPE (spec §5.2).

    rope_dim = head_dim/2; f_i = theta^(−2i/rope_dim), i < rope_dim/2. For the patch at
    (row r, col c) in row-major order the angles are [r·f_0 … r·f_last, c·f_0 … c·f_last].
    """
    rope_dim = head_dim // 2
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    rows = torch.arange(vit_h, dtype=torch.float32).repeat_interleave(vit_w)
    cols = torch.arange(vit_w, dtype=torch.float32).repeat(vit_h)
    return torch.cat([rows[:, None] * freqs[None, :], cols[:, None] * freqs[None, :]], dim=-1)


def apply_rope_half_split(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """NeoX half-split rotation of x [N, heads, head_dim] by angles [N, head_dim/2], in fp32.

    x1 = dims [0, hd/2), x2 = dims [hd/2, hd); out = [x1·cos − x2·sin, x2·cos + x1·sin],
    cast back to x's dtype.
    """
    half = x.shape[-1] // 2
    if angles.shape[-1] != half:
        raise ValueError(f"RoPE angles have {angles.shape[-1]} values per position, head_dim/2 is {half}")
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def unfold_features(features: torch.Tensor, vit_h: int, vit_w: int, k: int) -> torch.Tensor:
    """[vit_h·vit_w, D] → [⌈vit_h/k⌉·⌈vit_w/k⌉, D·k²] (spec §5.3).

    The grid is zero-padded at the bottom/right to multiples of k, then cut into non-overlapping
    k×k windows; each window's vector is ordered (channel, kernel row, kernel col) — torch
    `F.unfold` order — and windows are listed row-major.
    """
    d = features.shape[-1]
    if features.shape[0] != vit_h * vit_w:
        raise ValueError(f"{features.shape[0]} ViT rows for a {vit_h}x{vit_w} patch grid")
    grid = features.reshape(vit_h, vit_w, d).permute(2, 0, 1)  # D, h, w
    pad_h, pad_w = (-vit_h) % k, (-vit_w) % k
    grid = F.pad(grid, (0, pad_w, 0, pad_h))
    cols = F.unfold(grid[None].float(), kernel_size=k, stride=k)  # 1, D·k², L
    return cols[0].transpose(0, 1).to(features.dtype).contiguous()


def expected_vision_shapes(cfg: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """name → logical shape of every vision/aligner/marker tensor (spec §2.2, `names.py`)."""
    return {s.name: s.shape for s in tensor_inventory(cfg, dspark=False) if s.group == "vision"}


class VisionEncoder:
    """ViT + aligner + span markers for one image at a time (spec §5.2–§5.3).

    `weights` maps DeepSeek-native names (`vision.blocks.0.attn.wqkv.weight`, `aligner.w1.weight`,
    `image_start`, …) to dequantised float tensors. ViT RMSNorm weights are kept fp32; all other
    tensors are stored as BF16 (they are BF16-valued in the checkpoint).
    """

    def __init__(self, cfg: DeepseekV41Config, weights: Mapping[str, torch.Tensor]) -> None:
        if cfg.vision is None:
            raise ValueError("config has no vision_config: this checkpoint has no vision tower")
        self.cfg = cfg
        self.vcfg: VisionConfig = cfg.vision
        expected = expected_vision_shapes(cfg)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise KeyError(f"vision weights missing {len(missing)} tensors, e.g. {missing[:5]}")
        unknown = sorted(n for n in weights if n not in expected and _is_vision_name(n))
        if unknown:
            raise KeyError(f"unexpected vision tensors {unknown[:5]} (not in the tensor inventory)")
        self.w: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            if not t.is_floating_point():
                raise TypeError(f"{name}: expected a dequantised float tensor, got {t.dtype}")
            keep_fp32 = name.endswith(_FP32_NAMES_SUFFIX) or name == "vision.norm.weight"
            self.w[name] = t.detach().to(torch.float32 if keep_fp32 else torch.bfloat16).contiguous()

    # ---- ViT ---------------------------------------------------------------------------
    def _attention(self, b: int, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        v = self.vcfg
        n, heads, hd = x.shape[0], v.num_attention_heads, v.head_dim
        p = f"vision.blocks.{b}.attn."
        qkv = linear_bias_bf16(x, self.w[p + "wqkv.weight"], self.w[p + "wqkv.bias"])
        q, k, val = qkv.view(n, 3, heads, hd).unbind(1)  # fused rows are [q | k | v]
        q = apply_rope_half_split(q, angles)
        k = apply_rope_half_split(k, angles)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * hd**-0.5
        probs = torch.softmax(scores, dim=-1)  # bidirectional: no mask
        out = torch.einsum("hqk,khd->qhd", probs, val.float()).to(torch.bfloat16)
        return linear_bias_bf16(out.reshape(n, heads * hd), self.w[p + "wo.weight"], self.w[p + "wo.bias"])

    def _mlp(self, b: int, x: torch.Tensor) -> torch.Tensor:
        p = f"vision.blocks.{b}.mlp."
        gate_up = linear_bias_bf16(x, self.w[p + "w1.weight"])
        gate, up = gate_up.float().chunk(2, dim=-1)  # w1 rows: [gate | up]
        hidden = (F.silu(gate) * up).to(torch.bfloat16)
        return linear_bias_bf16(hidden, self.w[p + "w2.weight"])

    def vit(self, pre: PreprocessedImage) -> torch.Tensor:
        """BF16 [vit_h·vit_w, D]: patch embed → blocks → final RMSNorm."""
        v, g = self.vcfg, pre.grid
        if pre.patches.shape != (g.num_patches, 3 * v.patch_size**2):
            raise ValueError(f"patches {tuple(pre.patches.shape)} do not match grid {g}")
        x = linear_bias_bf16(pre.patches, self.w["vision.patch_embed.proj.weight"], self.w["vision.patch_embed.proj.bias"])
        angles = vision_rope_angles(g.vit_h, g.vit_w, v.head_dim, v.rope_theta)
        eps = v.rms_norm_eps
        for b in range(v.num_hidden_layers):
            p = f"vision.blocks.{b}."
            x = (x + self._attention(b, rms_norm_bf16(x, self.w[p + "norm1.weight"], eps), angles)).to(torch.bfloat16)
            x = (x + self._mlp(b, rms_norm_bf16(x, self.w[p + "norm2.weight"], eps))).to(torch.bfloat16)
        return rms_norm_bf16(x, self.w["vision.norm.weight"], eps)

    # ---- aligner + span ----------------------------------------------------------------
    def align(self, vit_out: torch.Tensor, pre: PreprocessedImage) -> torch.Tensor:
        """BF16 [n_h·n_w, hidden]: 3×3 unfold → Linear → GELU(erf) → Linear."""
        g = pre.grid
        cols = unfold_features(vit_out, g.vit_h, g.vit_w, self.vcfg.downsample_ratio)
        h = linear_bias_bf16(cols, self.w["aligner.w1.weight"], self.w["aligner.w1.bias"])
        h = F.gelu(h.float(), approximate="none").to(torch.bfloat16)
        return linear_bias_bf16(h, self.w["aligner.w2.weight"], self.w["aligner.w2.bias"])

    def encode(self, pre: PreprocessedImage) -> torch.Tensor:
        """BF16 [num_tokens, hidden]: the image span rows, markers included (spec §5.3)."""
        feats = self.align(self.vit(pre), pre)
        return build_span_rows(feats, pre.grid.n_h, pre.grid.n_w,
                               self.w["image_start"], self.w["image_newline"], self.w["image_end"])


def _is_vision_name(name: str) -> bool:
    return name.startswith(("vision.", "aligner.")) or name in ("image_start", "image_end", "image_newline")


def build_span_rows(features: torch.Tensor, n_h: int, n_w: int, start: torch.Tensor,
                    newline: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """[start] + ([feature × n_w] + [newline]) × n_h + [end]; features row-major [n_h·n_w, H]."""
    if features.shape[0] != n_h * n_w:
        raise ValueError(f"{features.shape[0]} feature rows for an {n_h}x{n_w} grid")
    hidden = features.shape[-1]
    rows = features.reshape(n_h, n_w, hidden)
    nl = newline.to(features.dtype).expand(n_h, 1, hidden)
    body = torch.cat([rows, nl], dim=1).reshape(n_h * (n_w + 1), hidden)
    return torch.cat([start.to(features.dtype)[None], body, end.to(features.dtype)[None]], dim=0)


def expand_image_placeholders(token_ids: Sequence[int], images: Sequence[Image.Image],
                              cfg: DeepseekV41Config) -> tuple[list[int], list[tuple[int, int]]]:
    """Expand each `image_token_id` placeholder to its image's span (spec §5.3, §3.1).

    Returns the new ids (every span position = `image_token_id`) and the spans as
    (start, length) in prompt order; span i belongs to images[i].
    """
    if cfg.vision is None:
        raise ValueError("config has no vision_config: cannot expand image placeholders")
    image_id = cfg.image_token_id
    n_placeholders = sum(1 for t in token_ids if t == image_id)
    if n_placeholders != len(images):
        raise ValueError(f"prompt has {n_placeholders} image placeholders (id {image_id}) for {len(images)} images")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    it = iter(images)
    for t in token_ids:
        if t != image_id:
            out.append(int(t))
            continue
        img = next(it)
        n = plan_image_grid(img.width, img.height, cfg.vision).num_tokens
        spans.append((len(out), n))
        out.extend([image_id] * n)
    return out, spans
