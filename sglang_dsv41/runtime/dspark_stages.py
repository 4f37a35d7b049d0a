"""The DSpark stages as `nn.Module`s owning their `mtp.{s}.*` tensors (spec `model.md` §4).

Each stage is a V4.1 decoder layer without compressor, indexer, Engram and image bias:
attn-hc → SWA-only **block** attention → ffn-hc → MoE with the draft's own experts
(`dspark_n_routed_experts`, top `dspark_num_experts_per_tok`), lagged-pre mHC. Block attention
(`DSparkBlockAttention`): every one of a request's γ block rows (positions P..P+γ−1) attends the
same keys — the stage's context kv of positions P−W..P−1 (`dspark_kv.DSparkContextKV.window`,
W = sliding_window, missing positions masked) followed by the read-back kv of **all** γ block
rows (bidirectional) — with the stage's attn sink. RoPE is the ratio-0 one (base `rope_theta`,
no YaRN). The math is the runtime's (`attention_math`, `attention_ops_torch.attend_with_sink`,
`mhc_ops`, `moe_ops`) on the implementations the draft picked once (`DraftStep`); the block
rows never write the context store.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from ..config import TextConfig
from ..numerics.profile import CacheProfile
from .attention_math import output_projection, project_q_kv, swa_cache_roundtrip
from .attention_ops_torch import attend_with_sink
from .backend import ComputeBackend
from .layers import HyperConnection, OwnedTensors, RMSNorm
from .quant_methods import apply_linear


@dataclass
class DraftStep:
    """What the stages of one draft forward read: the draft's implementations (chosen once) and
    this block's inputs. `context[s]` = (keys [B, W, D], valid [B, W]) of stage s."""

    backend: ComputeBackend
    mhc: object
    moe: Callable[..., Tensor]
    act_quant: bool
    profile: CacheProfile
    inv_freq: Tensor
    positions: Tensor
    gamma: int
    context: list[tuple[Tensor, Tensor]]


def stage_prefix(stage: int) -> str:
    """Checkpoint prefix of DSpark stage `stage` (spec §2.2)."""
    return f"mtp.{stage}."


def stage_text_config(cfg: TextConfig) -> TextConfig:
    """The stages' config: the text config with the draft's expert count and top-k (spec §4)."""
    return replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                   num_experts_per_tok=cfg.dspark_num_experts_per_tok)


def context_kv_rows(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], stage: int, main_x: Tensor,
                    positions: Tensor, inv_freq: Tensor, profile: CacheProfile, act_quant: bool) -> Tensor:
    """Stage `stage`'s stored kv [T, D] of context tokens: read-back of RoPE(RMSNorm_kv(wkv·main_x))
    at their positions (spec §4 "Draft context KV")."""
    p = stage_prefix(stage) + "attn."
    kv = be.rms_norm(apply_linear(w[p + "wkv"], main_x, be, act_quant=act_quant), w[p + "kv_norm.weight"],
                     cfg.rms_norm_eps, round_bf16=False)
    return swa_cache_roundtrip(be, kv, positions, inv_freq, profile, cfg.qk_rope_head_dim)


class DSparkBlockAttention(OwnedTensors):
    """`mtp.{s}.attn.*`: SWA-only block attention (module doc)."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, stage: int) -> None:
        super().__init__(weights, stage_prefix(stage) + "attn.")
        self.cfg, self.stage = cfg, stage

    def forward(self, x: Tensor, step: DraftStep) -> Tensor:
        """x [B·γ, H] (normed sublayer input) → [B·γ, H] BF16 values (after wo_b)."""
        cfg, be, g = self.cfg, step.backend, step.gamma
        N, D = x.shape[0], cfg.head_dim
        B = N // g
        _, q, kv = project_q_kv(be, cfg, self.tensors, self.prefix, x, step.positions, step.inv_freq,
                                step.act_quant, cfg.num_attention_heads)
        block = swa_cache_roundtrip(be, kv, step.positions, step.inv_freq, step.profile, cfg.qk_rope_head_dim)
        ctx_keys, ctx_valid = step.context[self.stage]
        keys = torch.cat((ctx_keys.to(torch.float32), block.reshape(B, g, D)), dim=1)            # [B, W+γ, D]
        valid = torch.cat((ctx_valid, torch.ones(B, g, dtype=torch.bool, device=x.device)), dim=1)
        keys = keys.repeat_interleave(g, dim=0)
        valid = valid.repeat_interleave(g, dim=0)
        o = attend_with_sink(q, keys, self["attn_sink"], valid, be.acc)
        return output_projection(be, cfg, self.tensors, self.prefix, o, step.positions, step.inv_freq,
                                 step.act_quant)


class DSparkMoE(OwnedTensors):
    """`mtp.{s}.ffn.*`: router, shared expert and the stage's routed experts."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, stage: int) -> None:
        super().__init__(weights, stage_prefix(stage) + "ffn.")
        self.cfg, self.stage_prefix = stage_text_config(cfg), stage_prefix(stage)

    def forward(self, x: Tensor, step: DraftStep) -> Tensor:
        return step.moe(step.backend, self.cfg, self.tensors, self.stage_prefix, x, None, step.act_quant, None, None)


class DSparkStage(nn.Module):
    """One stage: hc-pre → block attention → hc-post → hc-pre → MoE → hc-post (lagged pre)."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, stage: int) -> None:
        super().__init__()
        p = stage_prefix(stage)
        self.stage = stage
        self.attn_norm = RMSNorm(weights, p + "attn_norm.", cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(weights, p + "ffn_norm.", cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(weights, p + "hc_attn_", cfg)
        self.hc_ffn = HyperConnection(weights, p + "hc_ffn_", cfg)
        self.attn = DSparkBlockAttention(weights, cfg, stage)
        self.ffn = DSparkMoE(weights, cfg, stage)

    def forward(self, R: Tensor, carried_pre: Tensor | None, step: DraftStep) -> tuple[Tensor, Tensor]:
        co = self.hc_attn(R, step)
        x = self.hc_attn.sublayer_input(R, carried_pre, self.attn_norm, step)
        R = self.hc_attn.residual_update(R, self.attn(x, step), co, step)
        co_ffn = self.hc_ffn(R, step)
        x = self.hc_ffn.sublayer_input(R, co.pre, self.ffn_norm, step)
        R = self.hc_ffn.residual_update(R, self.ffn(x, step), co_ffn, step)
        return R, co_ffn.pre
