"""The V4.1 vision tower of the runtime: ViT, 3×3 unfold + aligner, image-span rows (spec
`model.md` §5.2–§5.3; issue 17).

`VisionTower` is an `nn.Module` owning one parameter per vision tensor of the inventory
(`checkpoint.names.tensor_inventory`, group ``vision``), registered under its checkpoint name
(`vision.blocks.0.attn.wqkv.weight` → `tower.vision.blocks[0].attn.wqkv.weight`; the markers
`image_start` / `image_end` / `image_newline` at the top), each created in its §2.4 runtime form
(fp32 holding the BF16 value; the ViT norms fp32) and filled by its `weight_loader`
(`quant_methods.plain_parameter`). `load_weights` streams the checkpoint's vision tensors in and
raises on an unknown or, on the first load, a missing one.

Numerics: every module boundary is BF16-valued; linears round their product once (bias
included); RMSNorm, RoPE, softmax, SwiGLU and GELU (erf) in fp32. This is the reference's rule
(`reference/vision.py`) except RMSNorm (fp32 here, float64 there) and the attention kernel. The
attention core and the linears' operand precision come from `vision_attention.py` by device:
torch SDPA with fp32 operands on CPU, SGLang's FA3 / Triton vision attention with BF16 operands on
CUDA. Either way the span rows agree with the reference's within the bound pinned in
tests/test_runtime_vision.py.

Invariants
----------
* `encode(pre)` returns exactly `pre.grid.num_tokens` rows [start, (features × n_w, newline) × n_h,
  end], fp32 holding BF16 values, on the tower's device. `encode_many(pres)` returns the same rows
  per image, in order.
* `encode_many` packs the images into as few ViT calls as `vision_calls.call_groups` allows (at most
  `call_patch_budget` patches each): one call runs every linear, norm and RoPE over all its images'
  patches and one varlen attention over their `Segments` (one kernel call per layer with
  ``triton`` / ``fa3``). Each image attends only to itself (bidirectional, no mask), so the rows
  equal per-image calls' up to the GEMMs' row blocking (tests/test_vision_attention.py).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint.names import tensor_inventory
from ..checkpoint.reader import CheckpointFormatError
from ..config import DeepseekV41Config
from ..vision_preprocess import PreprocessedImage
from .quant_methods import plain_parameter
from .vision_attention import Segments, ViTAttention, pick_backend
from .vision_calls import call_groups, call_patch_budget

BF16, F32 = torch.bfloat16, torch.float32


def is_vision_tensor(name: str) -> bool:
    """True for the checkpoint names the vision tower owns."""
    return name.startswith(("vision.", "aligner.")) or name in ("image_start", "image_end", "image_newline")


def _place(root: nn.Module, name: str, param: nn.Parameter) -> None:
    *path, leaf = name.split(".")
    node = root
    for part in path:
        child = getattr(node, part, None) if part in node._modules else None
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.register_parameter(leaf, param)


def _bf16(x: Tensor) -> Tensor:
    """fp32 holding the BF16 rounding of `x`."""
    return x.to(BF16).to(F32)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _bf16(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight)


def rope_angles(vit_h: int, vit_w: int, head_dim: int, theta: float, device: torch.device) -> Tensor:
    """fp32 [vit_h·vit_w, head_dim/2]: row angles then column angles of the 2-D RoPE (§5.2)."""
    rope_dim = head_dim // 2
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=F32, device=device) / rope_dim))
    rows = torch.arange(vit_h, dtype=F32, device=device).repeat_interleave(vit_w)
    cols = torch.arange(vit_w, dtype=F32, device=device).repeat(vit_h)
    return torch.cat([torch.outer(rows, freqs), torch.outer(cols, freqs)], dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split rotation of x [N, heads, hd] (BF16-valued fp32), rounded back to BF16."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return _bf16(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


class VisionTower(nn.Module):
    """ViT + aligner + span markers (module doc). Built on the current default device; `attention`
    names the `vision_attention` backend (``auto``: by that device)."""

    def __init__(self, cfg: DeepseekV41Config, attention: str = "auto") -> None:
        super().__init__()
        if cfg.vision is None:
            raise ValueError("config has no vision_config: this checkpoint has no vision tower")
        self.vcfg = cfg.vision
        self.specs = {s.name: s for s in tensor_inventory(cfg, dspark=False) if s.group == "vision"}
        for name, spec in self.specs.items():
            _place(self, name, plain_parameter(spec, None))
        self._loaded_once = False
        self.attn = ViTAttention(pick_backend(attention, self.device))

    @property
    def device(self) -> torch.device:
        return self.image_start.device

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load vision tensors by their checkpoint names through the parameters' loaders; one
        `CheckpointFormatError` names every unknown, mis-typed or (first load) missing tensor."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        problems: list[str] = []
        for name, tensor in weights:
            if name not in params:
                problems.append(f"unexpected vision tensor {name} (not in the inventory for this config)")
                continue
            try:
                params[name].weight_loader(params[name], tensor)
            except CheckpointFormatError as err:
                problems.append(str(err))
            seen.add(name)
        missing = sorted(set(self.specs) - seen) if not self._loaded_once else []
        if missing:
            problems.append(f"missing {len(missing)} vision tensor(s): {', '.join(missing[:12])}")
        if problems:
            raise CheckpointFormatError("checkpoint vision tensors do not match the config:\n  "
                                        + "\n  ".join(problems))
        self._loaded_once = True
        return seen

    # ---- ViT ----------------------------------------------------------------------------------
    def _attention(self, block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, segs: Segments) -> Tensor:
        v = self.vcfg
        n, heads, hd = x.shape[0], v.num_attention_heads, v.head_dim
        qkv = self.attn.linear(x, block.attn.wqkv.weight, block.attn.wqkv.bias)
        q, k, val = qkv.view(n, 3, heads, hd).unbind(1)          # fused rows: [q | k | v]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = self.attn.attend(q, k, val, segs)
        return self.attn.linear(out, block.attn.wo.weight, block.attn.wo.bias)

    def _mlp(self, block: nn.Module, x: Tensor) -> Tensor:
        gate, up = self.attn.linear(x, block.mlp.w1.weight).chunk(2, dim=-1)   # w1 rows: [gate | up]
        return self.attn.linear(_bf16(F.silu(gate) * up), block.mlp.w2.weight)

    def vit(self, pres: list[PreprocessedImage]) -> Tensor:
        """[Σ vit_h·vit_w, D] BF16-valued fp32, the images' patches packed in order: patch embed →
        blocks → final RMSNorm, in one call (module invariants)."""
        v = self.vcfg
        for pre in pres:
            g = pre.grid
            if tuple(pre.patches.shape) != (g.num_patches, 3 * v.patch_size ** 2):
                raise ValueError(f"patches {tuple(pre.patches.shape)} do not match grid {g}")
        segs = Segments.of([pre.grid.num_patches for pre in pres], self.device)
        patches = torch.empty(segs.cu[-1], 3 * v.patch_size ** 2, dtype=self.attn.operand_dtype, device=self.device)
        for pre, start, end in zip(pres, segs.cu, segs.cu[1:]):     # one device copy, no host concatenation
            patches[start:end].copy_(pre.patches)
        vit = self.vision
        x = self.attn.linear(patches, vit.patch_embed.proj.weight, vit.patch_embed.proj.bias)
        del patches
        angles = torch.cat([rope_angles(pre.grid.vit_h, pre.grid.vit_w, v.head_dim, v.rope_theta, self.device)
                            for pre in pres])
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        del angles
        eps = v.rms_norm_eps
        for block in vit.blocks.children():
            x = _bf16(x + self._attention(block, _rms_norm(x, block.norm1.weight, eps), cos, sin, segs))
            x = _bf16(x + self._mlp(block, _rms_norm(x, block.norm2.weight, eps)))
        return _rms_norm(x, vit.norm.weight, eps)

    # ---- aligner + span -------------------------------------------------------------------------
    def _unfold(self, feats: Tensor, pre: PreprocessedImage) -> Tensor:
        """[n_h·n_w, k²·D]: the k×k unfold (zero pad bottom/right, (channel, row, col) order)."""
        g, k = pre.grid, self.vcfg.downsample_ratio
        grid = feats.reshape(g.vit_h, g.vit_w, -1).permute(2, 0, 1)
        grid = F.pad(grid, (0, (-g.vit_w) % k, 0, (-g.vit_h) % k))
        return F.unfold(grid[None], kernel_size=k, stride=k)[0].transpose(0, 1)

    def align(self, feats: Tensor, pres: list[PreprocessedImage]) -> Tensor:
        """[Σ n_h·n_w, hidden] of the packed ViT rows `feats`: per image the k×k unfold, then over
        all images Linear → GELU(erf) → Linear."""
        cols = [self._unfold(f, pre) for f, pre in zip(feats.split([pre.grid.num_patches for pre in pres]), pres)]
        cols = cols[0] if len(cols) == 1 else torch.cat(cols)
        h = self.attn.linear(cols, self.aligner.w1.weight, self.aligner.w1.bias)
        del cols
        return self.attn.linear(_bf16(F.gelu(h, approximate="none")), self.aligner.w2.weight, self.aligner.w2.bias)

    def _span(self, feats: Tensor, pre: PreprocessedImage) -> Tensor:
        g, hidden = pre.grid, feats.shape[-1]
        nl = self.image_newline.expand(g.n_h, 1, hidden)
        body = torch.cat([feats.reshape(g.n_h, g.n_w, hidden), nl], dim=1).reshape(-1, hidden)
        return torch.cat([self.image_start[None], body, self.image_end[None]], dim=0)

    @torch.no_grad()
    def encode_many(self, pres: list[PreprocessedImage]) -> list[Tensor]:
        """Each image's span rows [num_tokens, hidden], in order, from packed ViT calls (module doc)."""
        out: list[Tensor] = []
        for group in call_groups([pre.grid.num_patches for pre in pres], call_patch_budget(self.vcfg)):
            call = [pres[i] for i in group]
            feats = self.align(self.vit(call), call)
            out.extend(self._span(f, pre) for f, pre in zip(feats.split([p.grid.n_h * p.grid.n_w for p in call]), call))
            del feats
        return out

    @torch.no_grad()
    def encode(self, pre: PreprocessedImage) -> Tensor:
        """The image's span rows [num_tokens, hidden] (module doc)."""
        return self.encode_many([pre])[0]
