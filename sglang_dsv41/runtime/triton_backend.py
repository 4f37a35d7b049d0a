"""The CUDA compute backend, `triton` (spec `model.md` §3, §3.8; the ABC and the CPU backends: `runtime/backend.py`).

Primitives run as one-launch Triton kernels (`kernels.fused_elementwise`, `kernels.rope`, `kernels.swiglu`,
`kernels.engram_gate`, the glue kernels named per method) and dense products on tensor cores
(`dense_ops.BlockedBf16Gemm`).

FP8 dense linears on `triton` (`fp8_gemm`, FP8_GEMMS; spec §3.8, issue 21). Every choice uses the
reference's operands — activations quantised per 1×32 to E4M3 with UE8M0 scales (`wo_a`: BF16, not
quantised), E4M3 weights with their tile scales — and differs only in how the products are summed:
* `w8a8_fold` (the serving default, `backend.fp8_gemm_for`): as `w8a8_f16`, but 1–16 rows on the
  scale-folded BF16 MMA tier (`kernels.fp8_fold`: 128 columns per MMA, exact products, fp32 sums; the same
  bound). Not batch invariant;
* `w8a8_f16` (opt-in): `kernels.fp8_w8a8` at
  every row count — the activation quantisation fused into the GEMM, E4M3 operands widened to
  f16 on the tensor cores (exact products, fp32 sums), split-K at decode summed inside the launch;
  from BF16_GEMM_MIN_ROWS rows its prefill form; `wo_a` one grouped launch. Not batch invariant;
* `tiered` (opt-in): below `kernels.fp8_w8a8.BF16_GEMM_MIN_ROWS` rows
  the `w8a16` kernel, from there the BF16-copy cuBLAS form of `kernels.fp8_w8a8` (prefill);
* `w8a16` (`--enable-deterministic-inference`): `kernels.fp8_linear` at every row count — the
  fake-quantised activations as BF16 times the dequantised tile, one fixed launch configuration
  (row invariant), `wo_a` one launch per group. Bound: dense_ops GEMM_BOUND;
* `fp8_mma` (opt-in): as `w8a8_f16`, but 17–128 rows on Hopper's FP8 MMA (E4M3 `wgmma`, ~14-bit
  sums per 32 products: DeepGEMM block32's accumulation class). Below the end-to-end contract
  (docs/runtime.md "Numerics contract"), hence not the default;
* `w8a8_gemv` (opt-in): as `w8a8_f16`, but 1–4 rows
  on the CUDA-core GEMV tier (`kernels.fp8_gemv`: x quantised once, exact products, fp32 sums; the same bound);
Weights not held as E4M3 tiles (BF16 copies, fp32) go through `matmul` in either mode: on `triton`
by `bf16_gemm_for` — cuBLAS GEMMs: any row count in one GEMM on the activation as given, without a padded
copy (`direct`, the serving default); a padded block up to 128 rows, one GEMM above (`whole`, opt-in); 128-row
blocks (`blocked`, row invariant, with deterministic inference) — or fewer than 129 rows of a BF16 weight on
`kernels.bf16_linear` (`triton`, opt-in).

BF16_OUT: the runtime holds activations in the backend's dtype (fp32 / float64) with BF16 values
where the model rounds. Where a BF16 result feeds only readers that take BF16 (the query heads, the
attention output, `wo_a`'s output: `runtime/attention_math.py`; `wo_b`'s and the shared expert's:
`runtime/tensor_parallel.py`; the mHC sublayer inputs: `runtime/mhc_ops.py`), the call passes
`bf16_out` and `triton` returns a torch.bfloat16 tensor of the same values: at an 8K prefill that
skips the fp32 copies of q and o (1 GB each) and the casts around them. The CPU backends keep their
dtype. Kernels that load an input as fp32 take these BF16 tensors as they are (`_widened_in_kernel`).
"""
from __future__ import annotations

from torch import Tensor

from .backend import BF16, F32, FP8_GEMMS, ComputeBackend, _group_shape
from .moe_ops import SOFTPLUS_THRESHOLD


class TensorCoreProducts:
    """Mixin: dense products on `self.dense` (`dense_ops.BlockedBf16Gemm`), whose input audit
    `finish` reports (raises on an inexact BF16 input) or discards after a failed forward."""

    dense: object

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.dense.matmul(x, weight)

    def finish(self, ok: bool = True) -> None:
        if ok:
            self.dense.raise_if_inputs_inexact()
        else:
            self.dense.discard_audit()


class TritonBackend(TensorCoreProducts, ComputeBackend):
    """CUDA: `kernels.fused_elementwise`, `kernels.rope`, `kernels.swiglu` (one launch per primitive;
    bit-identical or rare one-ulp flips, bounds stated there), the fp32 Engram gate kernel, the tensor-core dense
    products of `dense` (`dense_ops.BlockedBf16Gemm`, GEMM_BOUND) and FP8 linears by `fp8_gemm`
    (module doc). torch reductions outside the primitives run in fp32 (`acc`).
    `device_types=("cpu",)` is for tests under Triton's interpreter."""

    name = "triton"
    acc = F32

    def __init__(self, dense, device_types: tuple[str, ...] = ("cuda",), fp8_gemm: str = "w8a8_f16") -> None:
        from ..kernels import engram_gate as eg
        from ..kernels import fused_elementwise as fe
        from ..kernels import rope, swiglu
        from ..kernels import route_select as rs

        if "cpu" in device_types and not fe.INTERPRETED:
            raise ValueError("TritonBackend on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
        if fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"TritonBackend: fp8_gemm must be one of {FP8_GEMMS}, got {fp8_gemm!r}")
        self.fe, self.rope, self.swiglu, self.rs, self.eg = fe, rope, swiglu, rs, eg
        self.dense, self.device_types = dense, tuple(device_types)
        self.fp8_gemm = fp8_gemm
        self._engram_constants: dict = {}                   # (hasher id, device) → (hasher, token map, constants)

    def _w8a8_operand(self, weight: Tensor, x: Tensor):
        """The E4M3 tiles (`dense_ops.Fp8Weight`) of `weight` when this product runs
        `kernels.fp8_w8a8` (`w8a8_f16`, `fp8_mma`, `w8a8_gemv`, `w8a8_fold`; `tiered` from BF16_GEMM_MIN_ROWS rows of `x`),
        else None (the `w8a16` kernel, or a weight the dense products hold as BF16 / fp32)."""
        from ..kernels.fp8_w8a8 import BF16_GEMM_MIN_ROWS

        rows = x.numel() // max(x.shape[-1], 1)
        if self.fp8_gemm == "w8a16" or (self.fp8_gemm == "tiered" and rows < BF16_GEMM_MIN_ROWS):
            return None
        fp8_operand = getattr(self.dense, "fp8_operand", None)      # test doubles hold no E4M3 tiles
        return None if fp8_operand is None else fp8_operand(weight)

    def linear_fp8(self, x: Tensor, weight: Tensor, act_quant: bool = True, bf16_out: bool = False,
                   x_quantised: bool = False) -> Tensor:
        w = self._w8a8_operand(weight, x)
        if w is None:
            return super().linear_fp8(x, weight, act_quant)
        return self.dense.w8a8(x, w, act_quant=act_quant, groups=1, fp8_mma=self.fp8_gemm == "fp8_mma",
                               gemv=self.fp8_gemm == "w8a8_gemv", fold=self.fp8_gemm == "w8a8_fold",
                               out_dtype=BF16 if bf16_out else F32, x_quantised=x_quantised and act_quant)

    def linear_bf16_grouped(self, x: Tensor, weight: Tensor, groups: int, bf16_out: bool = False,
                            quantise_out: bool = False) -> Tensor:
        _group_shape(x, weight, groups)
        w = self._w8a8_operand(weight, x)
        if w is None:
            return super().linear_bf16_grouped(x, weight, groups, quantise_out=quantise_out)
        return self.dense.w8a8(x, w, act_quant=False, groups=groups, gemv=self.fp8_gemm == "w8a8_gemv",
                               fold=self.fp8_gemm == "w8a8_fold", out_dtype=BF16 if bf16_out else F32,
                               quantise_out=quantise_out)

    def quantised_handoff(self, rows: int) -> bool:
        """True for the fold tier's rows (`w8a8_fold`, ≤ FOLD_CONFIG.block_m): its consumer then multiplies x
        as loaded instead of quantising it in registers (`kernels.fp8_fold` module doc)."""
        from ..kernels.fp8_w8a8 import FOLD_CONFIG

        return self.fp8_gemm == "w8a8_fold" and 0 < rows <= FOLD_CONFIG.block_m

    def engram_gate(self, residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
        return self.eg.engram_gate(residual, keys, q_weight, k_weight, eps)

    def engram_residual(self, residual: Tensor, keys: Tensor, value: Tensor, q_weight: Tensor, k_weight: Tensor,
                        eps: float, image_rows: Tensor | None) -> Tensor:
        """One launch (`kernels.engram_gate.engram_residual`: the gate, then the update's torch bits for that g)."""
        return self.eg.engram_residual(residual, keys, value, q_weight, k_weight, eps, image_rows)[0]

    def bf16(self, x: Tensor) -> Tensor:
        return self.fe.round_bf16(x.to(F32))

    def fp8_act_fake_quant(self, x: Tensor) -> Tensor:
        return self.fe.fp8_act_fake_quant(_widened_in_kernel(x), 32)

    def fp4_fake_quant_e4m3_scale(self, x: Tensor) -> Tensor:
        return self.fe.fp4_fake_quant(_widened_in_kernel(x), 16, "e4m3")

    def fp4_fake_quant_ue8m0_scale(self, x: Tensor) -> Tensor:
        return self.fe.fp4_fake_quant(_widened_in_kernel(x), 32, "ue8m0")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, round_bf16: bool = True) -> Tensor:
        return self.fe.rms_norm(x, weight, eps, round_bf16)

    def rms_norm_pair(self, x: Tensor, split: int, first_weight: Tensor, second_weight: Tensor,
                      eps: float) -> tuple[Tensor, Tensor]:
        from ..kernels.stacked_halves import rms_norm_pair

        return rms_norm_pair(x, split, first_weight, second_weight, eps)

    def clamped_swiglu_halves(self, y: Tensor, limit: float, quantise_out: bool = False) -> Tensor:
        from ..kernels.stacked_halves import clamped_swiglu_halves

        return clamped_swiglu_halves(y, limit, quantise_out)

    def apply_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
        return self.rope.apply_rope_tail(x, positions, inv_freq, inverse)

    def bf16_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                       bf16_out: bool = False, round_input: bool = False, may_overwrite: bool = False) -> Tensor:
        """RoPE and the BF16 rounding(s) in one launch (the kernel's `round_bf16` / `round_input`: the
        same bits as `bf16(apply_rope_tail(bf16(x)))`, tests/test_kernels_fused_elementwise.py), one
        pass over x instead of two or three — at prefill x is q ([T, heads, head_dim], 1 GB in fp32 at
        8K Flash tokens); `bf16_out`: written as BF16 (BF16_OUT, module doc). `may_overwrite` with a
        contiguous BF16 x and `bf16_out`: x rotated in place (the kernel's `in_place`: only the rotated
        tail read and written, 1/8 of q's bytes at Flash; the same values)."""
        in_place = may_overwrite and bf16_out and x.dtype == BF16 and x.is_contiguous()
        return self.rope.apply_rope_tail(x, positions, inv_freq, inverse, round_bf16=True,
                                         out_dtype=BF16 if bf16_out else F32, round_input=round_input,
                                         in_place=in_place)

    def bf16_rope_tail_into(self, x: Tensor, positions: Tensor, inv_freq: Tensor, cache: Tensor, rows: Tensor) -> None:
        """One launch: the rows written at their cache rows by the RoPE kernel (its `into`), no scatter launch."""
        self.rope.apply_rope_tail(x, positions, inv_freq, round_bf16=True, out_dtype=cache.dtype, round_input=True,
                                  into=(cache, rows))

    def clamped_swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        return self.swiglu.clamped_swiglu(gate, up, limit)

    def compressed_entries(self, selection: Tensor, layout, ratio: int) -> Tensor:
        """One launch (`kernels.entry_index`: integer arithmetic, the torch formula's values)."""
        from ..kernels.entry_index import compressed_entry_index

        return compressed_entry_index(selection, layout.token_req, layout.req_rows, layout.req_to_token, ratio)

    def write_packed_entries(self, latent_rows: Tensor, key_rows: Tensor, source, layout, entry_idx: Tensor,
                             latents: Tensor, keys: Tensor) -> None:
        """One launch (`kernels.entry_pack`: the same bytes as the torch encoder; entry −1 writes nothing)."""
        from ..kernels.entry_pack import write_packed_entries

        write_packed_entries(latent_rows, key_rows, (source.latent.offset, source.latent.share),
                             (source.key.offset, source.key.share), source.ratio, entry_idx, latents, keys)

    def swa_window(self, layout, caches, window: int) -> tuple[Tensor, Tensor]:
        """One launch (`kernels.swa_window`: the torch path's integers)."""
        from ..kernels.swa_window import swa_window

        return swa_window(layout.positions, layout.token_req, layout.req_rows, layout.req_to_token,
                          caches.swa_slot_of, layout.out_slots, window)

    def engram_ring_rows(self, hasher, ids: Tensor, layout, ring) -> list[Tensor]:
        """Two launches (`kernels.engram_rows`: the torch path's rows and ring, integer arithmetic); the
        hash constants stacked on the ids' device once per hasher."""
        from ..kernels.engram_rows import advance_ring, engram_ring_rows
        from .engram_rows import hash_constants

        key = (id(hasher), ids.device)
        consts = self._engram_constants.get(key)
        if consts is None or consts[0] is not hasher:
            consts = self._engram_constants[key] = (hasher, hasher.token_map.to(ids.device),
                                                    *(c.to(ids.device) for c in hash_constants(hasher)))
        rows = engram_ring_rows(ids, layout.positions, layout.token_req, layout.starts, layout.prefix_lens,
                                layout.req_rows, ring.ids, *consts[1:], heads=hasher.n_heads,
                                pad_id=hasher.pad_token_id, image_id=hasher.image_token_id)
        advance_ring(ids, layout.starts, layout.extend_lens, layout.prefix_lens, layout.req_rows, layout.out_slots,
                     ring.ids, ring.end, live_only=layout.static)
        return list(rows.unbind(0))

    def pair_latents(self, a: Tensor, s: Tensor, layout, caches, source: int, norm_weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """One launch (`kernels.pair_state.pair_latents`: the torch path's values, exp correctly rounded)."""
        from ..kernels.pair_state import pair_latents

        return pair_latents(a, s, layout.positions, layout.token_req, layout.prefix_lens, layout.req_rows,
                            layout.out_slots, caches.pair_kv[source], caches.pair_score[source], norm_weight, eps)

    def store_pending_pairs(self, a: Tensor, s: Tensor, layout, caches, source: int) -> None:
        """One launch (`kernels.pair_state.store_pending_pairs`: the torch path's ring)."""
        from ..kernels.pair_state import store_pending_pairs

        store_pending_pairs(a, s, layout.positions, layout.out_slots, layout.starts, layout.extend_lens,
                            layout.req_rows, caches.pair_kv[source], caches.pair_score[source],
                            caches.pair_position[source])

    def route_select(self, scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        return self.rs.route_select(scores, bias, top_k, renorm_eps, bias_vl, image_rows)

    def route_logits(self, logits: Tensor, bias: Tensor, top_k: int, renorm_eps: float, routed_scale: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One launch (`kernels.route_select.route_logits`: torch's CUDA fp32 softplus and sqrt bits)."""
        return self.rs.route_logits(logits, bias, top_k, renorm_eps, routed_scale, SOFTPLUS_THRESHOLD, bias_vl,
                                    image_rows)



def _widened_in_kernel(x: Tensor) -> Tensor:
    """x for a kernel that loads its input as fp32: BF16 (BF16_OUT) as is — widening is exact — and
    any other dtype as fp32."""
    return x if x.dtype in (F32, BF16) else x.to(F32)


__all__ = ["TensorCoreProducts", "TritonBackend"]
