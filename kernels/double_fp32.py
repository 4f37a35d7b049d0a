"""Double-fp32 ("double-float") device arithmetic: float64-grade sums and products from fp32 only
(issue 21: no float64 on the GPU path; Dekker 1971, Knuth TAOCP 4.2.2).

A value is an unevaluated pair (hi, lo) of fp32 with |lo| ≤ ½ulp(hi) after `_fast_two_sum`, so
fp32(hi + lo) == hi. Building blocks are error-free transformations:

* `two_sum(a, b)` → (s, e) with s = fl(a + b), s + e == a + b exactly (no branch, any order);
* `two_prod(a, b)` → (p, e) with p + e == a·b exactly. The split is a bit mask (top 12 significant
  bits / the exact remainder), so every partial product has ≤ 24 bits and is exact in fp32: no
  FMA needed, and FMA contraction by the compiler cannot change any result (each product it
  could fuse is already exact). Exact while no partial product underflows (|a·b| ≥ 2⁻¹⁰⁰ or
  exactly 0) and a·b does not overflow.

Compound operations (`df_*`) carry a relative error ≤ ~8·2⁻⁴⁸ per step. A chain of c steps is
therefore within (8c)·2⁻⁴⁸ of the exact value, against ~c·2⁻⁵³ for the float64 evaluation it
replaces: both round to the same fp32 unless the exact value lies within ~2⁻⁴² relative of an fp32
rounding boundary (probability ≈ 2⁻¹⁸ per element at c ≤ 8). That is the same form of bound the
float64 kernels stated ("rare one-ulp flips"), and what the GPU tests allow. fp32 divisions and
square roots use `div_rn` / `sqrt_rn` (correctly rounded), never the approximate instructions.
Sums: `df_tree_sum` (pairwise, 1-D block) and `exact_sum` (error-free extraction along an axis of
≤ 64 terms; order-independent). Functions: `exp_neg` (exp of a ≤ 0, power of two kept apart) and
`cos_sin` (|a| < 2²⁴), each ≲ 2⁻⁴⁸ relative before the caller's one rounding.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl


def split_constant(v: float) -> tuple[float, float]:
    """Host side: a Python float (double) as (hi, lo) fp32 with hi + lo == v to ~2⁻⁴⁸ relative."""
    hi = float(np.float32(v))
    return hi, float(np.float32(v - hi))


@triton.jit
def two_sum(a, b):
    """(s, e): s = fl(a + b), s + e == a + b exactly (Knuth, six flops, no branch)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@triton.jit
def fast_two_sum(a, b):
    """(s, e) exact, valid when |a| ≥ |b| or a == 0 (normalises a double-fp32 pair)."""
    s = a + b
    e = b - (s - a)
    return s, e


@triton.jit
def _split12(a):
    """a = hi + lo with hi the top 12 significant bits (bit mask) and lo exact (≤ 12 bits)."""
    hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFF000).to(tl.float32, bitcast=True)
    return hi, a - hi


@triton.jit
def two_prod(a, b):
    """(p, e): p = fl(a·b), p + e == a·b exactly (Dekker's product, bit-mask split)."""
    p = a * b
    ah, al = _split12(a)
    bh, bl = _split12(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, e


@triton.jit
def df_add(ah, al, bh, bl):
    """(ah, al) + (bh, bl), normalised."""
    s, e = two_sum(ah, bh)
    e = e + (al + bl)
    return fast_two_sum(s, e)


@triton.jit
def df_add_f(ah, al, b):
    """(ah, al) + b (fp32), normalised."""
    s, e = two_sum(ah, b)
    return fast_two_sum(s, e + al)


@triton.jit
def df_mul_f(ah, al, b):
    """(ah, al) · b (fp32), normalised."""
    p, e = two_prod(ah, b)
    return fast_two_sum(p, e + al * b)


@triton.jit
def df_mul(ah, al, bh, bl):
    """(ah, al) · (bh, bl), normalised."""
    p, e = two_prod(ah, bh)
    return fast_two_sum(p, e + (ah * bl + al * bh))


@triton.jit
def df_div_f(ah, al, b):
    """(ah, al) / b (fp32, nonzero), normalised: one correction step of the rn quotient."""
    q0 = tl.math.div_rn(ah, b)
    p, e = two_prod(q0, b)
    r = ((ah - p) - e) + al
    return fast_two_sum(q0, tl.math.div_rn(r, b))


@triton.jit
def f_div_df(a, bh, bl):
    """a (fp32) / (bh, bl), normalised."""
    q0 = tl.math.div_rn(a, bh)
    p, e = two_prod(q0, bh)
    r = ((a - p) - e) - q0 * bl
    return fast_two_sum(q0, tl.math.div_rn(r, bh))


@triton.jit
def df_div(ah, al, bh, bl):
    """(ah, al) / (bh, bl), normalised."""
    q0 = tl.math.div_rn(ah, bh)
    p, e = two_prod(q0, bh)
    r = (((ah - p) - e) + al) - q0 * bl
    return fast_two_sum(q0, tl.math.div_rn(r, bh))


@triton.jit
def df_rsqrt(ah, al):
    """1 / sqrt((ah, al)) for ah > 0, normalised: sqrt_rn, one Newton correction, then 1/x."""
    s0 = tl.math.sqrt_rn(ah)
    p, e = two_prod(s0, s0)
    s1 = tl.math.div_rn(((ah - p) - e) + al, s0 + s0)
    sh, sl = fast_two_sum(s0, s1)
    return f_div_df(1.0, sh, sl)


@triton.jit
def df_tree_sum(h, l, LOG2_N: tl.constexpr):
    """Σ of a 1-D double-fp32 block of 2^LOG2_N pairs, pairwise (reshape + split per level: fast
    in the interpreter, which runs a custom `tl.reduce` element by element) → shape (1,) pair."""
    for _ in tl.static_range(LOG2_N):
        ha, hb = tl.split(tl.reshape(h, (h.shape[0] // 2, 2)))
        la, lb = tl.split(tl.reshape(l, (l.shape[0] // 2, 2)))
        h, l = df_add(ha, la, hb, lb)
    return h, l


@triton.jit
def _pow2_at_least(v):
    """Smallest power of two ≥ v for fp32 v ≥ 2⁻¹²⁶ (bits: exact powers map to themselves)."""
    bits = v.to(tl.uint32, bitcast=True)
    up = ((bits >> 23) + 1) << 23
    return tl.where((bits & 0x7FFFFF) == 0, bits, up).to(tl.float32, bitcast=True)


@triton.jit
def exact_sum(p, axis: tl.constexpr, N: tl.constexpr):
    """Σ along `axis` (N terms, keep_dims) of fp32 terms p, as a double-fp32 pair: error-free
    extraction in two levels (Rump, Ogita & Oishi 2008, ExtractVector) with native max / sum
    reductions only, so any summation order gives the same bits. Level 1: σ = 2^⌈log2 M⌉·2N ≥
    2N·max|p|, q = (σ + p) − σ is p on the grid of ulp(σ), Σq exact; level 2 likewise on the
    remainders r = p − q with σ₂ = 4N·2⁻²⁴σ; the last remainders (≤ 2⁻²⁴σ₂ each) are summed in
    fp32. Error ≲ 16·N⁴·2⁻⁷²·max|p| (2⁻⁴⁸·max|p| at N = 32). (The terms are exact values, e.g.
    BF16 products: no two_prod error part to carry.)"""
    m = tl.max(tl.abs(p), axis=axis, keep_dims=True)
    sigma = _pow2_at_least(tl.maximum(m, 1e-30)) * (2 * N)
    q = (sigma + p) - sigma
    r = p - q
    sigma2 = sigma * (4 * N * 5.9604644775390625e-08)           # 4N·2⁻²⁴σ, a power of two
    q2 = (sigma2 + r) - sigma2
    s1 = tl.sum(q, axis=axis, keep_dims=True)
    s2 = tl.sum(q2, axis=axis, keep_dims=True)
    s3 = tl.sum(r - q2, axis=axis, keep_dims=True)
    h, l = two_sum(s1, s2)
    return df_add_f(h, l, s3)


# exp in double-fp32 (`exp_neg`): Cody–Waite reduction by ln 2 (three-part constant) and the
# degree-12 Taylor polynomial on |r| ≤ ln2/2 (truncation < 2⁻⁵², coefficients 1/n! as fp32 pairs).
_LN2_A = tl.constexpr(0.693115234375)             # ln 2 = A + B + C + D: A, B, C of 12 significant bits
_LN2_B = tl.constexpr(3.193318843841553e-05)    # (k·A, k·B, k·C exact for |k| < 2^12), D the fp32 rest
_LN2_C = tl.constexpr(1.2994860298931599e-08)
_LN2_D = tl.constexpr(1.6465717678215697e-12)
_INV_FACT3_HI, _INV_FACT3_LO = tl.constexpr(0.1666666716337204), tl.constexpr(-4.967053879312289e-09)
_INV_FACT4_HI, _INV_FACT4_LO = tl.constexpr(0.0416666679084301), tl.constexpr(-1.2417634698280722e-09)
_INV_FACT5_HI, _INV_FACT5_LO = tl.constexpr(0.008333333767950535), tl.constexpr(-4.34617203337595e-10)
_INV_FACT6_HI, _INV_FACT6_LO = tl.constexpr(0.0013888889225199819), tl.constexpr(-3.3631094437103215e-11)
_INV_FACT7_HI, _INV_FACT7_LO = tl.constexpr(0.00019841270113829523), tl.constexpr(-2.725596874933456e-12)
_INV_FACT8_HI, _INV_FACT8_LO = tl.constexpr(2.4801587642286904e-05), tl.constexpr(-3.40699609366682e-13)
_INV_FACT9_HI, _INV_FACT9_LO = tl.constexpr(2.7557318844628753e-06), tl.constexpr(3.793571224297229e-14)
_INV_FACT10_HI, _INV_FACT10_LO = tl.constexpr(2.755731998149713e-07), tl.constexpr(-7.575112209051195e-15)
_INV_FACT11_HI, _INV_FACT11_LO = tl.constexpr(2.5052107943679403e-08), tl.constexpr(4.4176230446483665e-16)
_INV_FACT12_HI, _INV_FACT12_LO = tl.constexpr(2.0876755879584152e-09), tl.constexpr(1.1082839809204342e-16)


@triton.jit
def exp_neg(a):
    """exp(a) for fp32 a ∈ [−200, 0] as (m_h, m_l, k): exp(a) = (m_h + m_l)·2^k, m ∈ [0.7, 1.42]
    (the power of two kept apart so nothing underflows); relative error ≲ 2⁻⁴⁸."""
    k = (a * 1.4426950408889634 + 12582912.0) - 12582912.0        # RNE to an integer (1.5·2^23 shift: any sign)
    r_h = a - k * _LN2_A                                         # exact (Sterbenz; k·A exact)
    r_h, r_l = two_sum(r_h, -(k * _LN2_B))
    r_h, r_l = df_add_f(r_h, r_l, -(k * _LN2_C))
    r_h, r_l = df_add_f(r_h, r_l, -(k * _LN2_D))
    p_h, p_l = df_mul_f(r_h, r_l, tl.full(r_h.shape, _INV_FACT12_HI, tl.float32))
    p_h, p_l = df_add(p_h, p_l, _INV_FACT11_HI, _INV_FACT11_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT10_HI, _INV_FACT10_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT9_HI, _INV_FACT9_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT8_HI, _INV_FACT8_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT7_HI, _INV_FACT7_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT6_HI, _INV_FACT6_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT5_HI, _INV_FACT5_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT4_HI, _INV_FACT4_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add(p_h, p_l, _INV_FACT3_HI, _INV_FACT3_LO)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add_f(p_h, p_l, 0.5)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add_f(p_h, p_l, 1.0)
    p_h, p_l = df_mul(p_h, p_l, r_h, r_l)
    p_h, p_l = df_add_f(p_h, p_l, 1.0)
    return p_h, p_l, k.to(tl.int32)


# cos / sin in double-fp32 (`cos_sin`): Cody–Waite reduction by π/2 held as four fp32 parts
# (n·P_i exact by `two_prod`, |n| < 2^24), then Taylor polynomials in r² to r^19 / r^18 on |r| ≲ π/4
# (truncation < 2⁻⁶⁰), coefficients ±1/n! as fp32 pairs.
_PIO2_1 = tl.constexpr(1.5707963705062866)
_PIO2_2 = tl.constexpr(-4.371138828673793e-08)
_PIO2_3 = tl.constexpr(-1.7151245100058819e-15)
_PIO2_4 = tl.constexpr(1.056299898220315e-23)
_SIN0_HI, _SIN0_LO = tl.constexpr(1.0), tl.constexpr(0.0)
_COS0_HI, _COS0_LO = tl.constexpr(1.0), tl.constexpr(0.0)
_SIN1_HI, _SIN1_LO = tl.constexpr(-0.1666666716337204), tl.constexpr(4.967053879312289e-09)
_COS1_HI, _COS1_LO = tl.constexpr(-0.5), tl.constexpr(0.0)
_SIN2_HI, _SIN2_LO = tl.constexpr(0.008333333767950535), tl.constexpr(-4.34617203337595e-10)
_COS2_HI, _COS2_LO = tl.constexpr(0.0416666679084301), tl.constexpr(-1.2417634698280722e-09)
_SIN3_HI, _SIN3_LO = tl.constexpr(-0.00019841270113829523), tl.constexpr(2.725596874933456e-12)
_COS3_HI, _COS3_LO = tl.constexpr(-0.0013888889225199819), tl.constexpr(3.3631094437103215e-11)
_SIN4_HI, _SIN4_LO = tl.constexpr(2.7557318844628753e-06), tl.constexpr(3.793571224297229e-14)
_COS4_HI, _COS4_LO = tl.constexpr(2.4801587642286904e-05), tl.constexpr(-3.40699609366682e-13)
_SIN5_HI, _SIN5_LO = tl.constexpr(-2.5052107943679403e-08), tl.constexpr(-4.4176230446483665e-16)
_COS5_HI, _COS5_LO = tl.constexpr(-2.755731998149713e-07), tl.constexpr(7.575112209051195e-15)
_SIN6_HI, _SIN6_LO = tl.constexpr(1.6059044372074283e-10), tl.constexpr(-5.352526511562726e-18)
_COS6_HI, _COS6_LO = tl.constexpr(2.0876755879584152e-09), tl.constexpr(1.1082839147459852e-16)
_SIN7_HI, _SIN7_LO = tl.constexpr(-7.647163609812713e-13), tl.constexpr(-1.2200710471178288e-20)
_COS7_HI, _COS7_LO = tl.constexpr(-1.147074536050896e-11), tl.constexpr(-2.372207689231238e-19)
_SIN8_HI, _SIN8_LO = tl.constexpr(2.8114573589663704e-15), tl.constexpr(-1.0462084739763658e-22)
_COS8_HI, _COS8_LO = tl.constexpr(4.7794772561329454e-14), tl.constexpr(7.62544404448643e-22)
_SIN9_HI, _SIN9_LO = tl.constexpr(-8.220635078476521e-18), tl.constexpr(-1.681478096855898e-25)
_COS9_HI, _COS9_LO = tl.constexpr(-1.5619206814541513e-16), tl.constexpr(-1.5404471465941993e-24)

@triton.jit
def cos_sin(a):
    """(cos a, sin a) of fp32 a, |a| < 2^24 (2/π·|a| an exact-integer range), each rounded once to
    fp32 from a double-fp32 value (≲ 2⁻⁴⁹ absolute error after the reduction: relative ≲ 2⁻⁴⁴
    unless a is within 2⁻⁵ of a multiple of π/2)."""
    n = (a * 0.6366197723675814 + 12582912.0) - 12582912.0       # RNE(a·2/π) (1.5·2^23 shift)
    p1, e1 = two_prod(n, tl.full(n.shape, _PIO2_1, tl.float32))
    p2, e2 = two_prod(n, tl.full(n.shape, _PIO2_2, tl.float32))
    p3, e3 = two_prod(n, tl.full(n.shape, _PIO2_3, tl.float32))
    t_h, t_l = two_sum(-(n * _PIO2_4), -e3)                    # the small terms first
    t_h, t_l = df_add_f(t_h, t_l, -p3)
    t_h, t_l = df_add_f(t_h, t_l, -e2)
    t_h, t_l = df_add_f(t_h, t_l, -p2)
    t_h, t_l = df_add_f(t_h, t_l, -e1)
    r_h, r_l = df_add_f(t_h, t_l, a - p1)                      # a − n·P1 exact (Sterbenz)
    r2_h, r2_l = df_mul(r_h, r_l, r_h, r_l)
    s_h = tl.full(n.shape, _SIN9_HI, tl.float32)
    s_l = tl.full(n.shape, _SIN9_LO, tl.float32)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN8_HI, _SIN8_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN7_HI, _SIN7_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN6_HI, _SIN6_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN5_HI, _SIN5_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN4_HI, _SIN4_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN3_HI, _SIN3_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN2_HI, _SIN2_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN1_HI, _SIN1_LO)
    s_h, s_l = df_mul(s_h, s_l, r2_h, r2_l)
    s_h, s_l = df_add(s_h, s_l, _SIN0_HI, _SIN0_LO)
    s_h, s_l = df_mul(s_h, s_l, r_h, r_l)
    c_h = tl.full(n.shape, _COS9_HI, tl.float32)
    c_l = tl.full(n.shape, _COS9_LO, tl.float32)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS8_HI, _COS8_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS7_HI, _COS7_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS6_HI, _COS6_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS5_HI, _COS5_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS4_HI, _COS4_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS3_HI, _COS3_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS2_HI, _COS2_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS1_HI, _COS1_LO)
    c_h, c_l = df_mul(c_h, c_l, r2_h, r2_l)
    c_h, c_l = df_add(c_h, c_l, _COS0_HI, _COS0_LO)
    sr = s_h + s_l
    cr = c_h + c_l
    q = n.to(tl.int32) & 3
    c = tl.where(q == 0, cr, tl.where(q == 1, -sr, tl.where(q == 2, -cr, sr)))
    s = tl.where(q == 0, sr, tl.where(q == 1, cr, tl.where(q == 2, -sr, -cr)))
    return c, s
