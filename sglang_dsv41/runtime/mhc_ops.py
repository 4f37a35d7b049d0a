"""The mHC hyper-connection ops of the runtime, one implementation per device (spec `model.md` §3.2).

`mhc_for(device)` picks, once per model:

| device | implementation |
|---|---|
| CPU  | `TorchMhc`: the §3.2 formulas in torch, rounded as the reference (reductions and transcendentals in float64 rounded once to fp32, the elementwise steps fp32) |
| CUDA | `TritonMhc`: `kernels.mhc` (fused Triton, fp32: 2 launches for the coefficients, 1 per other op) |

Each implementation declares the dtype it holds the residual streams R in (`residual_dtype`; R⁰ by
`streams`): fp32 on CPU, torch.bfloat16 on CUDA. R holds BF16 values (§3.2: the embedding is BF16, every
residual update and the Engram update round to BF16), so either dtype holds it exactly; BF16 halves the bytes of
every pass over R. The stream ops give the same bits from both; the compiled `dot` / `fused` / `tc` coefficients
differ in the last bits, within their bound (`kernels/mhc.py`).

CUDA's partial-dot kernel of the coefficients (`kernels.mhc.MIX_KERNELS`: `dot`, `rows`, `fused`, `tc`):
SGLANG_DSV41_MHC_MIX (MIX_CHOICES), read when a `TritonMhc` is built. `auto` (the serving
default) picks per call by token count (`mix_for_tokens`: `fused` — one launch,
`kernels/mhc_decode.py` — at 1..FUSED_MAX_TOKENS (0: never, an opt-in), `tc` (split-BF16×3 tensor-core dots;
`dot` before session 32) from MIX_DOT_MIN_TOKENS on, `rows` below; docs/performance.md). `fused` uses int32 arrival counters that every launch leaves
zero: a `TritonMhc` allocates them once per device outside CUDA-graph capture (inside a capture
without them, a zeroed buffer is allocated in the graph per call). A call's token count is fixed
within a CUDA graph (one graph per batch size), so the choice is captured with it. The
kernels' coefficients differ in the last bits, so `auto` is not batch invariant: deterministic
mode pins DETERMINISTIC_MIX (`auto` with it raises). The coefficient kernel after `dot` / `rows`:
SGLANG_DSV41_MHC_COEFF (COEFF_CHOICES = `kernels.mhc.COEFF_KERNELS`, default `tile`;
`registers` is opt-in; either is batch invariant).

Both are tested against `reference.mhc` (tests/test_runtime_mhc.py, tests/test_kernels_mhc.py):
CPU bit-identical (`Fp32TorchMhc`: the numerics contract); CUDA within the bounds stated in
`kernels/mhc.py` (coefficients within 2⁻¹⁴, the sublayer input within one BF16 ulp, stream sums
bit-identical).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..numerics.rounding import bf16, fp8_act_fake_quant, fp32_scalar

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
MHC_MIX_ENV = "SGLANG_DSV41_MHC_MIX"
#: SGLANG_DSV41_MHC_MIX values: `auto` (per call, `mix_for_tokens`) or one kernel of
#: `kernels.mhc.MIX_KERNELS` for every call
MIX_CHOICES = ("auto", "dot", "rows", "fused", "tc")
#: `auto`: `tc` from this many tokens on, `rows` below (the threshold fit to the H200 sweeps of benchmarks/mhc_mix.py
#: and benchmarks/mhc_decode.py for `dot`, docs/performance.md "mHC kernel by token count" and "Session 21"; `tc`
#: replaced `dot` above it after the 8K prefill of "Session 32": mHC 4.5 → 2.0 ms)
MIX_DOT_MIN_TOKENS = 1024
#: `auto`: `fused` at 1..this many tokens; 0 = never, `fused` being the opt-in SGLANG_DSV41_MHC_MIX=fused
#: (docs/performance.md, "Session 21": `rows` measured faster at every decode size)
FUSED_MAX_TOKENS = 0
MHC_COEFF_ENV = "SGLANG_DSV41_MHC_COEFF"
#: SGLANG_DSV41_MHC_COEFF values (`kernels.mhc.COEFF_KERNELS`); the first is the default
COEFF_CHOICES = ("tile", "registers")
#: the `fused` kernel's persistent counters cover calls of up to this many tokens (decode graph sizes)
FUSED_COUNTER_TOKENS = 256
#: the one partial-dot kernel of deterministic mode (batch invariant: its bits never depend on T)
DETERMINISTIC_MIX = "dot"


def mix_for_tokens(tokens: int) -> str:
    """`auto`'s partial-dot kernel for a call of `tokens` rows: `fused` at 1..FUSED_MAX_TOKENS,
    `tc` at ≥ MIX_DOT_MIN_TOKENS, else `rows`."""
    if 1 <= tokens <= FUSED_MAX_TOKENS:
        return "fused"
    return "tc" if tokens >= MIX_DOT_MIN_TOKENS else "rows"


def mix_choice(mix: str | None = None, deterministic: bool = False) -> str:
    """`mix` when given, else SGLANG_DSV41_MHC_MIX, else `auto` (DETERMINISTIC_MIX when
    `deterministic`); an unknown value, or `auto` with `deterministic`, raises."""
    if mix is None:
        from .backend import kernel_choice

        chosen = kernel_choice(MHC_MIX_ENV, MIX_CHOICES, DETERMINISTIC_MIX if deterministic else "auto")
    elif mix in MIX_CHOICES:
        chosen = mix
    else:
        raise ValueError(f"mHC partial-dot kernel {mix!r}: expected one of {MIX_CHOICES}")
    if chosen == "auto" and deterministic:
        raise ValueError(f"{MHC_MIX_ENV}=auto picks the kernel by batch size (not batch invariant): "
                         "not with --enable-deterministic-inference")
    return chosen


@dataclass(frozen=True)
class HcCoefficients:
    """pre [T, hc] (carried to the next hyper-connection), post [T, hc], comb [T, hc, hc] with
    comb[t, j, k] = weight of input stream j in output stream k (fp32)."""

    pre: Tensor
    post: Tensor
    comb: Tensor


class ResidualStreams:
    """The dtype an mHC implementation holds R [T, hc, H] in (module doc; spec `model.md` §3.2)."""

    #: R's dtype: exact either way, R holding BF16 values
    residual_dtype: torch.dtype = F32

    def streams(self, rows: Tensor, hc: int) -> Tensor:
        """R⁰ [T, hc, H] in `residual_dtype`: rows [T, H] (BF16 values: the embedding) on every stream."""
        T, H = rows.shape
        return rows.unsqueeze(1).expand(T, hc, H).to(self.residual_dtype).contiguous()


class TorchMhc(ResidualStreams):
    """CPU: the §3.2 formulas; the coefficients' reductions and transcendentals and the
    sublayer-input norm evaluated in `acc` (float64: rounded once, bit-identical to the
    reference), every other coefficient step fp32 (upstream's `hc_split_sinkhorn_kernel` order),
    stream sums fp32 in a fixed order (post·y first, then j = 0, 1, …)."""

    name = "torch"

    def __init__(self, acc: torch.dtype = F64) -> None:
        self.acc = acc

    def coefficients(self, residual: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *,
                     rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> HcCoefficients:
        T, hc, H = residual.shape
        if fn.shape != (hc * (2 + hc), hc * H):
            raise ValueError(f"hc fn has shape {tuple(fn.shape)}, expected {(hc * (2 + hc), hc * H)}")
        if sinkhorn_iters < 1:
            raise ValueError(f"Sinkhorn needs at least one iteration, got {sinkhorn_iters}")
        acc, e32 = self.acc, fp32_scalar(hc_eps)

        def once(v: Tensor) -> Tensor:          # a reduction / transcendental in `acc`, to fp32
            return v.to(F32)

        def rsum(m: Tensor, dim: int) -> Tensor:
            return once(m.to(acc).sum(dim=dim, keepdim=True))

        x = residual.to(acc).reshape(T, hc * H)
        mix = once(x @ fn.to(acc).t()) * once(torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + rms_eps))
        a, b = scale.to(F32), base.to(F32)
        z = mix * torch.cat([a[0].expand(hc), a[1].expand(hc), a[2].expand(hc * hc)]) + b
        pre = once(torch.sigmoid(z[:, :hc].to(acc))) + e32
        post = 2.0 * once(torch.sigmoid(z[:, hc:2 * hc].to(acc)))
        c = z[:, 2 * hc:].reshape(T, hc, hc)
        ex = once(torch.exp((c - c.amax(dim=-1, keepdim=True)).to(acc)))
        m = ex / rsum(ex, -1) + e32
        m = m / (rsum(m, -2) + e32)
        for _ in range(sinkhorn_iters - 1):
            m = m / (rsum(m, -1) + e32)
            m = m / (rsum(m, -2) + e32)
        return HcCoefficients(pre=pre, post=post, comb=m)

    def weighted_sum(self, residual: Tensor, pre: Tensor) -> Tensor:
        r, p = residual.to(F32), pre.to(F32)
        acc = p[:, 0, None] * r[:, 0]
        for j in range(1, r.shape[1]):
            acc = acc + p[:, j, None] * r[:, j]
        return bf16(acc)

    def sublayer_input(self, residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                       rms_eps: float) -> Tensor:
        x = residual[:, 0, :].to(F32) if carried_pre is None else self.weighted_sum(residual, carried_pre)
        xd = x.to(self.acc)
        return bf16((xd * torch.rsqrt(xd.pow(2).mean(dim=-1, keepdim=True) + rms_eps)
                     * norm_weight.to(self.acc)).to(F32))

    def sublayer_inputs(self, residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                        rms_eps: float) -> tuple[Tensor, Tensor]:
        """(`sublayer_input`, its values quantised per 1×32): the hand-off to the sublayer's FP8 linears
        (`ComputeBackend.quantised_handoff`)."""
        x = self.sublayer_input(residual, carried_pre, norm_weight, rms_eps)
        return x, fp8_act_fake_quant(x)

    def residual_update(self, residual: Tensor, sublayer_out: Tensor, co: HcCoefficients) -> Tensor:
        r, comb, y = residual.to(F32), co.comb.to(F32), sublayer_out.to(F32)
        out = []
        for k in range(r.shape[1]):
            acc = co.post[:, k, None] * y
            for j in range(r.shape[1]):
                acc = acc + comb[:, j, k, None] * r[:, j]
            out.append(acc)
        return bf16(torch.stack(out, dim=1))

    def collapse(self, residual: Tensor, last_pre: Tensor) -> Tensor:
        return self.weighted_sum(residual, last_pre)


class Fp32TorchMhc(TorchMhc):
    """CPU serving path: `TorchMhc` in fp32 with the stream sums as one batched product each
    (summation order free: within the numerics contract, not bit-identical)."""

    def __init__(self) -> None:
        super().__init__(F32)

    def weighted_sum(self, residual: Tensor, pre: Tensor) -> Tensor:
        return bf16(torch.bmm(pre.to(F32).unsqueeze(1), residual.to(F32)).squeeze(1))

    def residual_update(self, residual: Tensor, sublayer_out: Tensor, co: HcCoefficients) -> Tensor:
        mixed = torch.bmm(co.comb.to(F32).transpose(1, 2), residual.to(F32))          # [T, hc(k), H]
        return bf16(torch.addcmul(mixed, co.post.to(F32).unsqueeze(-1), sublayer_out.to(F32).unsqueeze(1)))


class TritonMhc(ResidualStreams):
    """CUDA: the fused kernels of `kernels.mhc` (bounds stated there), R held as torch.bfloat16 (each
    kernel widens it to fp32 as it loads it; the residual update writes R's dtype); `mix` (MIX_CHOICES,
    module doc) picks the coefficients' partial-dot kernel, `coeff` (COEFF_CHOICES, else
    SGLANG_DSV41_MHC_COEFF) the coefficient kernel after it."""

    name = "triton"
    residual_dtype = BF16

    def __init__(self, mix: str | None = None, deterministic: bool = False, coeff: str | None = None) -> None:
        from ..kernels import mhc as kernels   # Triton is imported only where the kernels run
        from .backend import kernel_choice

        self.k = kernels
        self.mix = mix_choice(mix, deterministic)
        if coeff is not None and coeff not in COEFF_CHOICES:
            raise ValueError(f"mHC coefficient kernel {coeff!r}: expected one of {COEFF_CHOICES}")
        self.coeff = coeff or kernel_choice(MHC_COEFF_ENV, COEFF_CHOICES)
        self._counters: dict[torch.device, Tensor] = {}

    def counters_for(self, tokens: int, device: torch.device) -> Tensor | None:
        """The `fused` kernel's arrival counters on `device` (FUSED_COUNTER_TOKENS tokens' worth or more,
        allocated on first use outside CUDA-graph capture); None when capturing without them or
        when `tokens` needs more (the kernel wrapper then zeroes a buffer per call)."""
        from ..kernels import mhc_decode

        have = self._counters.get(device)
        if have is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is None:
            have = self._counters[device] = mhc_decode.fused_counters(max(FUSED_MAX_TOKENS, FUSED_COUNTER_TOKENS),
                                                                      device)
        return have if have.numel() >= mhc_decode.fused_blocks(tokens) else None

    def mix_for(self, tokens: int) -> str:
        """The partial-dot kernel a call of `tokens` rows runs."""
        return mix_for_tokens(tokens) if self.mix == "auto" else self.mix

    def coefficients(self, residual: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *,
                     rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> HcCoefficients:
        tokens = residual.shape[0]
        mix = self.mix_for(tokens)
        counters = self.counters_for(tokens, residual.device) if mix == "fused" else None
        return HcCoefficients(*self.k.hc_coefficients(residual, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps,
                                                      sinkhorn_iters=sinkhorn_iters, mix=mix, counters=counters,
                                                      coeff=self.coeff))

    def sublayer_input(self, residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                       rms_eps: float) -> Tensor:
        """As torch.bfloat16 (`runtime/triton_backend.py` BF16_OUT): every reader — the sublayer's linears, the
        router, the routed experts — takes BF16, so no fp32 copy is written."""
        return self.k.hc_sublayer_input(residual, carried_pre, norm_weight, rms_eps, out_dtype=torch.bfloat16)

    def sublayer_inputs(self, residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                        rms_eps: float) -> tuple[Tensor, Tensor]:
        """One launch: (`sublayer_input`, its values quantised per 1×32 as BF16)."""
        return self.k.hc_sublayer_input(residual, carried_pre, norm_weight, rms_eps, out_dtype=torch.bfloat16,
                                        quantised=True)

    def residual_update(self, residual: Tensor, sublayer_out: Tensor, co: HcCoefficients) -> Tensor:
        return self.k.hc_residual_update(residual, sublayer_out, co.post, co.comb)

    def collapse(self, residual: Tensor, last_pre: Tensor) -> Tensor:
        return self.k.hc_collapse(residual, last_pre)


def stream_mean(residual: Tensor) -> Tensor:
    """bf16(mean over the hc streams) [T, H], summed in fp32 in stream order (the DSpark target
    feature, spec `model.md` §4: the attention input of a captured layer). Same on every device and
    for R in fp32 or BF16 (each stream widened exactly as it is added)."""
    acc = residual[:, 0].to(F32)
    for j in range(1, residual.shape[1]):
        acc = acc + residual[:, j]
    return bf16(acc / residual.shape[1])


def mhc_for(device: torch.device, acc: torch.dtype = F64, deterministic: bool = False) -> TorchMhc | TritonMhc:
    """CPU → `TorchMhc` evaluating in `acc` (batch invariant either way); CUDA → `TritonMhc`
    (`deterministic`: one partial-dot kernel at every batch size); any other device raises."""
    if device.type == "cpu":
        return TorchMhc() if acc == F64 else Fp32TorchMhc()
    if device.type == "cuda":
        return TritonMhc(deterministic=deterministic)
    raise ValueError(f"no mHC implementation for device '{device}' (CPU → torch, CUDA → Triton kernels)")
