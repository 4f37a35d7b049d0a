"""The DSpark draft of a V4.1 checkpoint — no SGLang objects (spec `model.md` §4).

`DSparkDraft(cfg, weights, …)` owns every `mtp.*` tensor through its modules: the main
projection (`mtp.0.main_proj` / `main_norm`), the stages (`runtime/dspark_stages.py`), the last
stage's `norm`, and the Markov / confidence heads (`runtime/dspark_heads.py`, on the one stage
that holds them). The target's embedding and LM head are passed in per call, never copied.

* `context_rows(features, positions)` — per stage, the stored kv of committed target tokens from
  their features [T, n·H] (the stream-mean attention inputs of `dspark_target_layer_ids`,
  concatenated layer-major, as SGLang's LogitsProcessor packs aux hidden states):
  main_x = RMSNorm_main_norm(main_proj · features), kv_s = read-back(RoPE(RMSNorm(wkv_s · main_x))).
* `block_hidden(embed_weight, ids, positions, windows)` — the stage stack on B blocks of γ rows;
  returns the collapsed pre-norm hidden x [B·γ, H] (BF16 values): Σ_j pre_j R_j with the last
  stage's ffn pre (V4.1 has no hc_head). No weight depends on γ: B comes from the windows and
  γ = rows / B, so the block is whatever the server drafts (`--speculative-dspark-block-size`),
  not necessarily the checkpoint's `dspark_block_size` (the block the draft was trained for).
* `base_logits(x, head_weight)` = head · RMSNorm_norm(x), fp32 (no Markov bias).
* `confidence(x [B, γ, H], prev [B, γ])` — c_k = sigmoid(proj([x_k ; markov_w1[prev_k]]) / T_sts).

The implementations are picked once from the weights' device, as the target's (`backend_for`,
`mhc_for`, `moe_for`); `deterministic` picks the exact CPU backend (bit-identical to the
reference, tests) or the fp32 one.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..config import DeepseekV41Config
from ..numerics.profile import NumericsProfile
from ..numerics.rope import layer_inv_freq
from .backend import ComputeBackend, backend_for
from .dspark_heads import ConfidenceHead, MarkovHead
from .dspark_stages import DraftStep, DSparkStage, context_kv_rows, stage_prefix
from .dspark_weights import require_dspark
from .layers import OwnedTensors, RMSNorm
from .mhc_ops import mhc_for
from .moe_ops import moe_for
from .parallel_linear import linear_values, with_parallel_linears
from .quant_methods import apply_linear
from .tensor_parallel import SINGLE

F32 = torch.float32


def head_stage_prefix(cfg: DeepseekV41Config, weights: Mapping[str, object]) -> str:
    """The one stage holding `markov_head.*` / `confidence_head.*` (spec §2.2); zero or several raise."""
    owners = [stage_prefix(s) for s in range(cfg.text.num_nextn_predict_layers)
              if stage_prefix(s) + "markov_head.embed.weight" in weights]
    if len(owners) != 1:
        raise KeyError(f"expected exactly one DSpark stage with markov_head/confidence_head tensors, found {owners}")
    return owners[0]


class DSparkDraft(nn.Module):
    """The draft's modules and math (module doc). `weights`: `dspark_runtime_weights` values."""

    def __init__(self, cfg: DeepseekV41Config, weights: Mapping[str, object],
                 numerics: NumericsProfile = NumericsProfile(), deterministic: bool = True,
                 backend: ComputeBackend | None = None) -> None:
        super().__init__()
        require_dspark(cfg)
        self.cfg, self.text, self.numerics = cfg, cfg.text, numerics
        t = self.text
        S = t.num_nextn_predict_layers
        # every linear of the stages (and main_proj) as its SGLang layer (`runtime/parallel_linear.py`)
        weights = with_parallel_linears(weights, cfg, SINGLE.plan(t), dspark=True)
        self.main_proj = weights["mtp.0.main_proj"]
        self.main_norm = RMSNorm(weights, "mtp.0.main_norm.", t.rms_norm_eps)
        self.stages = nn.ModuleList(DSparkStage(weights, t, s) for s in range(S))
        self.norm = RMSNorm(weights, stage_prefix(S - 1) + "norm.", t.rms_norm_eps)
        prefix = head_stage_prefix(cfg, weights)
        self.markov_head = MarkovHead(weights, prefix)
        self.confidence_head = ConfidenceHead(weights, prefix)
        owned = {n: v for m in self.modules() if isinstance(m, OwnedTensors) for n, v in m.tensors.items()}
        owned["mtp.0.main_proj"] = self.main_proj
        unowned = sorted(set(weights) - set(owned))
        if unowned:
            raise ValueError(f"{len(unowned)} DSpark weight(s) no module owns, e.g. {unowned[:4]}")
        device = self.main_norm["weight"].device
        self.backend = backend_for(device, linear_values(owned), deterministic) if backend is None else backend
        self.mhc = mhc_for(device, self.backend.acc, deterministic)
        self.moe = moe_for(device)
        self.markov_head.backend = self.backend
        self.confidence_head.acc = self.backend.acc
        #: RoPE of every stage: the ratio-0 one (base rope_theta, no YaRN), made once on the device
        self.inv_freq = layer_inv_freq(t, 0).to(device)

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    # ---- draft context KV ----------------------------------------------------------------------
    def main_projection(self, features: Tensor) -> Tensor:
        """main_x [T, H] of target features [T, n·H] (layer-major concatenation)."""
        t = self.text
        width = len(t.dspark_target_layer_ids) * t.hidden_size
        if features.dim() != 2 or features.shape[1] != width:
            raise ValueError(f"DSpark target features have shape {tuple(features.shape)}, expected [T, {width}]")
        x = self.backend.bf16(features.to(F32))
        y = apply_linear(self.main_proj, x, self.backend, act_quant=self.numerics.act_quant)
        return self.main_norm(y, self.backend)

    def context_rows(self, features: Tensor, positions: Tensor) -> list[Tensor]:
        """Per stage [T, head_dim]: the stored kv of T committed tokens at `positions`."""
        with self._audited():
            main_x = self.main_projection(features)
            pos = positions.to(device=main_x.device, dtype=torch.int64)
            return [context_kv_rows(self.backend, self.text, stage.attn.tensors, s, main_x, pos, self.inv_freq,
                                    self.numerics.cache, self.numerics.act_quant)
                    for s, stage in enumerate(self.stages)]

    # ---- block forward -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _audited(self) -> Iterator[None]:
        """Report the backend's per-forward audit (`ComputeBackend.finish`) after a call."""
        try:
            yield
        except BaseException:
            self.backend.finish(ok=False)
            raise
        self.backend.finish()

    def block_hidden(self, embed_weight: Tensor | Callable[[Tensor], Tensor], ids: Tensor, positions: Tensor,
                     windows: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """Collapsed hidden [B·γ, H] of B blocks: `ids` / `positions` [B·γ] (block-major),
        `windows[s]` = (keys [B, W, D], valid [B, W]) of stage s's context (module doc); B is the
        windows' row count and γ = len(ids) / B (any γ ≥ 1).
        `embed_weight`: the target's embedding weight, or its vocabulary-parallel module (ids → rows)."""
        t, N = self.text, ids.shape[0]
        if len(windows) != len(self.stages):
            raise ValueError(f"DSpark block forward: {len(windows)} context windows for {len(self.stages)} stages")
        B = windows[0][0].shape[0]
        if any(keys.shape[0] != B or valid.shape[0] != B for keys, valid in windows):
            raise ValueError("DSpark block forward: the stages' context windows hold different request counts")
        if positions.shape[0] != N or (N % B if B else N) or (B and N < B):
            raise ValueError(f"DSpark block forward: {N} ids / {positions.shape[0]} positions are not "
                             f"{B} blocks of γ ≥ 1 rows")
        if N == 0:
            return torch.zeros(0, t.hidden_size, dtype=F32, device=self.device)
        with self._audited():
            return self._block_hidden(embed_weight, ids.to(device=self.device, dtype=torch.int64),
                                      positions.to(device=self.device, dtype=torch.int64), windows, N // B)

    def _block_hidden(self, embed_weight: Tensor | Callable[[Tensor], Tensor], ids: Tensor, positions: Tensor,
                      windows: Sequence[tuple[Tensor, Tensor]], g: int) -> Tensor:
        t = self.text
        step = DraftStep(self.backend, self.mhc, self.moe, self.numerics.act_quant, self.numerics.cache, self.inv_freq,
                         positions, g, list(windows))
        rows = embed_weight[ids] if isinstance(embed_weight, Tensor) else embed_weight(ids)
        R = self.mhc.streams(rows, t.hc_mult)
        carried: Tensor | None = None
        for stage in self.stages:
            R, carried = stage(R, carried, step)
        assert carried is not None
        return self.mhc.collapse(R, carried)

    def final_norm(self, hidden: Tensor) -> Tensor:
        """RMSNorm_norm(hidden) (last stage's `norm`), the LM head's input."""
        with self._audited():
            return self.norm(hidden, self.backend)

    def base_logits(self, hidden: Tensor, head_weight: Tensor) -> Tensor:
        """head · RMSNorm_norm(hidden) → fp32 [N, V] (no Markov bias) on the draft's backend
        (CPU; on CUDA the head belongs to the target's dense cache: `DeepseekV41ForCausalLMDSpark`
        multiplies through the target's LM-head method)."""
        h = self.final_norm(hidden)
        with self._audited():
            return self.backend.matmul(h, head_weight)

    def confidence(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """[B, γ] confidences of hidden [B, γ, H] and prev tokens [B, γ] (module doc)."""
        head = self.confidence_head
        return head.apply_sts(head(hidden, self.markov_head.get_prev_embeddings(prev_tokens)))
