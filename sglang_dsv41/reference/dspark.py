"""DSpark speculative draft head (spec `model.md` §4, tensors §2.2 `mtp.{s}.*`, fields §1.2).

The draft is `num_nextn_predict_layers` extra decoder stages (weights `mtp.{s}.`) that
propose γ = `dspark_block_size` tokens per round from the target's own features.

Invariants (spec §4):

* **Draft context KV.** For every committed target token t (position t) the target captures
  a_ℓ(t) = mean over the hc streams of the residual entering layer ℓ ∈ dspark_target_layer_ids;
  main_x(t) = RMSNorm_{mtp.0.main_norm}(mtp.0.main_proj · [a_ℓ₀; a_ℓ₁; a_ℓ₂]) (FP8 linear);
  for each stage s: kv_s(t) = RMSNorm_{mtp.s.attn.kv_norm}(mtp.s.attn.wkv · main_x(t)) with
  RoPE (base `rope_theta`, **no YaRN**) at position t, stored in stage s's SWA cache (read back
  through the request's cache profile). The stages never run over context tokens.
* **Block forward** (`run_stages`): rows [anchor, noise×(γ−1)] at positions P..P+γ−1,
  P = committed length; every stage is a full SWA-only decoder layer whose block rows attend
  the last min(P, sliding_window) context kv of that stage **plus all γ block rows**
  (bidirectional), with the stage's attn sink; lagged-pre mHC; final collapse with the last
  pre → RMSNorm_{norm} → target LM head `head.weight` = base_logits.
* **Markov bias.** Draft step k (sequential, k = 0..γ−1) uses prev_k (prev_0 = anchor,
  prev_k = d_{k−1}): logits_k = base_logits_k + markov_w2 · markov_w1[prev_k] (fp32);
  d_k = argmax (greedy) or a sample of softmax(logits_k / temperature).
* **Confidence.** c_k = sigmoid(proj([x_k ; markov_w1[prev_k]]) / T_sts) in fp32, x_k the
  collapsed (pre-norm) hidden of row k; `proj` has no bias; T_sts = 1 by default.
* Markov/confidence tensors live on one stage (the inventory puts them on the last; upstream
  maps them from whichever stage holds them): `dspark_head_prefix` finds that stage and
  refuses zero or several.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..config import TextConfig
from .attention import attend_with_sink, layer_inv_freq, output_projection, project_kv, project_q_kv
from .mhc import hc_coefficients, hc_collapse, hc_residual_update, hc_sublayer_input
from .moe import moe_sublayer
from .ops import F32, CacheProfile, bf16, linear_fp8, matmul_fp32_exact, rms_norm, swa_cache_roundtrip


# ---- weights ------------------------------------------------------------------------------

def _get(w: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in w:
        raise KeyError(f"DSpark weight '{name}' missing from the weights mapping")
    return w[name]


def stage_prefix(stage: int) -> str:
    """Weight prefix of DSpark stage `stage` (checkpoint names `mtp.{s}.*`, spec §2.2)."""
    return f"mtp.{stage}."


def dspark_head_prefix(cfg: TextConfig, w: Mapping[str, Tensor]) -> str:
    """Prefix of the one stage holding `markov_head.*` and `confidence_head.*` (spec §2.2)."""
    owners = [stage_prefix(s) for s in range(cfg.num_nextn_predict_layers)
              if stage_prefix(s) + "markov_head.embed.weight" in w]
    if len(owners) != 1:
        raise KeyError(f"expected exactly one DSpark stage with markov_head/confidence_head tensors, found {owners}")
    return owners[0]


def _require_dspark(cfg: TextConfig) -> None:
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("this checkpoint has no DSpark stages (num_nextn_predict_layers = 0)")


def draft_rope_inv_freq(cfg: TextConfig) -> Tensor:
    """DSpark RoPE = a ratio-0 layer's: base `rope_theta`, YaRN never applied (spec §4, §8 item 6)."""
    return layer_inv_freq(cfg, 0)


# ---- draft context KV ---------------------------------------------------------------------

def main_projection(cfg: TextConfig, w: Mapping[str, Tensor], features: Tensor, *, act_quant: bool) -> Tensor:
    """main_x = RMSNorm_{main_norm}(main_proj · [a_ℓ₀; a_ℓ₁; …]) for features [T, n_targets, H] → [T, H].

    The per-layer features are concatenated in `dspark_target_layer_ids` order (layer-major).
    """
    _require_dspark(cfg)
    n = len(cfg.dspark_target_layer_ids)
    if features.dim() != 3 or features.shape[1:] != (n, cfg.hidden_size):
        raise ValueError(f"DSpark features have shape {tuple(features.shape)}, expected [T, {n}, {cfg.hidden_size}]")
    x = bf16(features.to(F32)).reshape(features.shape[0], n * cfg.hidden_size)
    y = linear_fp8(x, _get(w, "mtp.0.main_proj.weight"), act_quant)
    return rms_norm(y, _get(w, "mtp.0.main_norm.weight"), cfg.rms_norm_eps)


def stage_context_kv(cfg: TextConfig, w: Mapping[str, Tensor], stage: int, main_x: Tensor,
                     positions: Tensor, *, profile: CacheProfile, act_quant: bool) -> Tensor:
    """Stage `stage`'s cached kv [T, head_dim] for context tokens: read-back of
    RoPE(RMSNorm_{kv_norm}(wkv · main_x), positions) with base RoPE and no YaRN — the same kv
    path as an attention layer (normalise, then rotate and store as the cache layout does)."""
    inv_freq = draft_rope_inv_freq(cfg).to(main_x.device)
    kv = project_kv(cfg, w, stage_prefix(stage) + "attn.", main_x, positions, inv_freq, act_quant)
    return swa_cache_roundtrip(kv, positions, inv_freq, profile, cfg.qk_rope_head_dim)


def context_kv_from_features(cfg: TextConfig, w: Mapping[str, Tensor], features: Tensor, positions: Tensor,
                             *, profile: CacheProfile, act_quant: bool) -> list[Tensor]:
    """Per-stage context kv ([T, head_dim] each) for T committed tokens (spec §4 "Draft context KV")."""
    main_x = main_projection(cfg, w, features, act_quant=act_quant)
    return [stage_context_kv(cfg, w, s, main_x, positions, profile=profile, act_quant=act_quant)
            for s in range(cfg.num_nextn_predict_layers)]


@dataclass
class DraftContext:
    """One request's draft context KV: stage s → [P, head_dim] read-back kv of positions 0..P−1.

    Grows only by `append` of committed tokens' kv (in position order); `clone` deep-copies.
    """

    kv: list[Tensor] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: TextConfig, device: torch.device | str = "cpu") -> "DraftContext":
        _require_dspark(cfg)
        return cls([torch.zeros(0, cfg.head_dim, dtype=F32, device=device)
                     for _ in range(cfg.num_nextn_predict_layers)])

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[0]) if self.kv else 0

    def append(self, stage_kv: Sequence[Tensor]) -> None:
        if len(stage_kv) != len(self.kv):
            raise ValueError(f"got kv for {len(stage_kv)} stages, the draft has {len(self.kv)}")
        n = {int(t.shape[0]) for t in stage_kv}
        if len(n) != 1:
            raise ValueError(f"per-stage kv row counts differ: {sorted(n)}")
        self.kv = [torch.cat((old, new.to(old.dtype)), dim=0) for old, new in zip(self.kv, stage_kv)]

    def commit_features(self, cfg: TextConfig, w: Mapping[str, Tensor], features: Tensor, *,
                        profile: CacheProfile, act_quant: bool) -> None:
        """Append the kv of the next T committed tokens (positions length..length+T−1)."""
        positions = torch.arange(self.length, self.length + features.shape[0], device=features.device)
        self.append(context_kv_from_features(cfg, w, features, positions, profile=profile, act_quant=act_quant))

    def clone(self) -> "DraftContext":
        return DraftContext([t.clone() for t in self.kv])


# ---- the stage stack (block forward) ------------------------------------------------------

def block_token_ids(cfg: TextConfig, anchor: int) -> list[int]:
    """Block rows: [anchor, noise × (γ − 1)] (spec §4, `sample_from_anchor`)."""
    return [int(anchor)] + [cfg.dspark_noise_token_id] * (cfg.dspark_block_size - 1)


def stage_attention(cfg: TextConfig, w: Mapping[str, Tensor], stage: int, x: Tensor, positions: Tensor,
                    context_kv: Tensor, *, profile: CacheProfile, act_quant: bool) -> Tensor:
    """SWA-only attention of one stage over a block (spec §4 "Block forward").

    x [γ, H] (after attn-hc combine + attn_norm); context_kv [C, head_dim] = the stage's cached
    kv of the last C = min(P, window) context positions. Every block row attends the same key
    set: those C entries plus the (cache-read-back) kv of **all** γ block rows, bidirectionally,
    with the stage's attn sink. Returns [γ, H] BF16-valued (after wo_b).
    """
    prefix = stage_prefix(stage) + "attn."
    inv_freq = draft_rope_inv_freq(cfg).to(x.device)
    _, q, kv = project_q_kv(cfg, w, prefix, x, positions, inv_freq, act_quant)
    block_kv = swa_cache_roundtrip(kv, positions, inv_freq, profile, cfg.qk_rope_head_dim)
    keys = torch.cat((context_kv.to(F32), block_kv), dim=0)
    keys = keys.unsqueeze(0).expand(x.shape[0], *keys.shape)
    o = attend_with_sink(q, keys, _get(w, prefix + "attn_sink"))
    return output_projection(cfg, w, prefix, o, positions, inv_freq, act_quant)


def _hc(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, R: Tensor):
    return hc_coefficients(R, _get(w, prefix + "fn"), _get(w, prefix + "base"), _get(w, prefix + "scale"),
                           rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)


@dataclass(frozen=True)
class BlockOutput:
    """Draft block result: `hidden` [γ, H] = final collapse Σ_j pre_j R_j (pre-norm, BF16 values),
    `base_logits` [γ, V] fp32 = head(RMSNorm_{norm}(hidden)) (no Markov bias yet)."""

    hidden: Tensor
    base_logits: Tensor


def run_stages(cfg: TextConfig, w: Mapping[str, Tensor], context: "DraftContext", token_ids: Tensor,
               *, profile: CacheProfile, act_quant: bool) -> BlockOutput:
    """The DSpark stage stack on block rows `token_ids` [γ] at positions P..P+γ−1, P = context.length.

    Embedding = the target's `embed.weight` broadcast to the hc streams; per stage: attn-hc →
    SWA-only block attention → ffn-hc → MoE (dspark experts, top-k, no vl bias); lagged pre
    (the draft's first combine reads stream 0, like the main model's first); final collapse
    with the last pre → RMSNorm of the last stage's `norm` → target head `head.weight`.
    """
    _require_dspark(cfg)
    S, P = cfg.num_nextn_predict_layers, context.length
    if len(context.kv) != S:
        raise ValueError(f"draft context has {len(context.kv)} stages, the config {S}")
    ids = token_ids.to(torch.int64).reshape(-1)
    emb = _get(w, "embed.weight")
    ids = ids.to(emb.device)
    g = ids.shape[0]
    positions = torch.arange(P, P + g, device=emb.device)
    R = bf16(emb[ids].to(F32)).unsqueeze(1).expand(g, cfg.hc_mult, cfg.hidden_size).contiguous()
    window_start = P - min(P, cfg.sliding_window)
    carried: Tensor | None = None
    for s in range(S):
        p = stage_prefix(s)
        co = _hc(cfg, w, p + "hc_attn_", R)
        x = hc_sublayer_input(R, carried, _get(w, p + "attn_norm.weight"), cfg.rms_norm_eps)
        y = stage_attention(cfg, w, s, x, positions, context.kv[s][window_start:P],
                            profile=profile, act_quant=act_quant)
        R, carried = hc_residual_update(R, y, co), co.pre
        co = _hc(cfg, w, p + "hc_ffn_", R)
        x = hc_sublayer_input(R, carried, _get(w, p + "ffn_norm.weight"), cfg.rms_norm_eps)
        y = moe_sublayer(cfg, w, p, x, image_rows=None, act_quant=act_quant,
                         n_experts=cfg.dspark_n_routed_experts, top_k=cfg.dspark_num_experts_per_tok)
        R, carried = hc_residual_update(R, y, co), co.pre
    assert carried is not None
    hidden = hc_collapse(R, carried)
    h = rms_norm(hidden, _get(w, stage_prefix(S - 1) + "norm.weight"), cfg.rms_norm_eps)
    return BlockOutput(hidden=hidden, base_logits=matmul_fp32_exact(h, _get(w, "head.weight")))


def draft_block_forward(cfg: TextConfig, w: Mapping[str, Tensor], context: "DraftContext", anchor: int,
                        *, profile: CacheProfile, act_quant: bool) -> BlockOutput:
    """Block forward of spec §4: rows [anchor, noise × (γ−1)] at positions P..P+γ−1."""
    if context.length < 1:
        raise ValueError("the draft block needs at least one committed context token")
    ids = torch.tensor(block_token_ids(cfg, anchor), dtype=torch.int64)
    return run_stages(cfg, w, context, ids, profile=profile, act_quant=act_quant)


# ---- Markov bias, confidence, sequential drafting -----------------------------------------

def markov_bias(cfg: TextConfig, w: Mapping[str, Tensor], prev_token: int) -> Tensor:
    """markov_w2 · markov_w1[prev] → [V] fp32 (BF16 weights; the correctly rounded fp32 dot
    product `ops.matmul_fp32_exact`, unrounded to BF16; spec §4)."""
    p = dspark_head_prefix(cfg, w) + "markov_head."
    w1, w2 = _get(w, p + "embed.weight"), _get(w, p + "head.weight")
    if not 0 <= prev_token < w1.shape[0]:
        raise ValueError(f"token {prev_token} outside the Markov table of {w1.shape[0]} rows")
    return matmul_fp32_exact(w1[prev_token].unsqueeze(0), w2).squeeze(0)


def confidence(cfg: TextConfig, w: Mapping[str, Tensor], hidden: Tensor, prev_tokens: Sequence[int],
               sts_temperature: float = 1.0) -> Tensor:
    """c_k = sigmoid(proj([x_k ; markov_w1[prev_k]]) / T_sts) → [γ] fp32 in (0, 1) (spec §4);
    proj is fp32, its dot product correctly rounded to fp32 (`ops.matmul_fp32_exact`)."""
    if sts_temperature <= 0:
        raise ValueError(f"confidence temperature must be positive, got {sts_temperature}")
    p = dspark_head_prefix(cfg, w)
    w1 = _get(w, p + "markov_head.embed.weight")
    proj = _get(w, p + "confidence_head.proj.weight").to(F32)
    if hidden.dim() != 2 or hidden.shape[0] != len(prev_tokens):
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match {len(prev_tokens)} previous tokens")
    prev = torch.tensor([int(t) for t in prev_tokens], dtype=torch.long, device=hidden.device)
    feats = torch.cat((hidden.to(F32), w1[prev].to(F32)), dim=-1)
    if feats.shape[1] != proj.shape[1]:
        raise ValueError(f"confidence proj expects {proj.shape[1]} inputs, got {feats.shape[1]}")
    return torch.sigmoid(matmul_fp32_exact(feats, proj).squeeze(-1) / sts_temperature)


@dataclass(frozen=True)
class DraftProposal:
    """γ draft tokens with what verification needs.

    `logits` [γ, V] fp32 = base logits + Markov bias; `probs` [γ, V] = softmax(logits/T), the
    distribution each d_k was drawn from (None for greedy drafts); `prev_tokens` = prev_k;
    `confidence` [γ].
    """

    tokens: tuple[int, ...]
    logits: Tensor
    probs: Tensor | None
    prev_tokens: tuple[int, ...]
    confidence: Tensor


def propose_drafts(cfg: TextConfig, w: Mapping[str, Tensor], hidden: Tensor, base_logits: Tensor, anchor: int,
                   *, greedy: bool, temperature: float = 1.0, generator: torch.Generator | None = None,
                   sts_temperature: float = 1.0) -> DraftProposal:
    """Sequential drafting over the block's rows (spec §4 "Markov bias"): step k adds the Markov
    bias of prev_k (anchor, then the previous draft) to base_logits_k and picks d_k."""
    gamma = base_logits.shape[0]
    if hidden.shape[0] != gamma:
        raise ValueError(f"hidden has {hidden.shape[0]} rows, base_logits {gamma}")
    if not greedy and (temperature <= 0 or generator is None):
        raise ValueError("sampled drafts need a positive temperature and a torch.Generator")
    prev = int(anchor)
    tokens: list[int] = []
    prevs: list[int] = []
    rows: list[Tensor] = []
    probs: list[Tensor] = []
    for k in range(gamma):
        logits_k = base_logits[k].to(F32) + markov_bias(cfg, w, prev)
        if greedy:
            d = int(torch.argmax(logits_k))
        else:
            q = torch.softmax(logits_k / temperature, dim=-1)
            d = int(torch.multinomial(q, 1, generator=generator).item())
            probs.append(q)
        prevs.append(prev)
        rows.append(logits_k)
        tokens.append(d)
        prev = d
    return DraftProposal(tokens=tuple(tokens), logits=torch.stack(rows),
                         probs=None if greedy else torch.stack(probs), prev_tokens=tuple(prevs),
                         confidence=confidence(cfg, w, hidden, prevs, sts_temperature))
