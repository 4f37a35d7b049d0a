"""FP8 dense weights kept as stored: `kernels/fp8_linear.py`, its use by `runtime/dense_ops.py`, and
the loading in `runtime/weights.py` (spec §2.3, §2.4, §3.8).

What is pinned:
* kernel cases (Triton interpreter in a child pytest on CPU; compiled on CUDA): `fp8_linear` is
  within GEMM_BOUND (`dense_ops.error_bound`, K·2⁻²³·S) of the exact float64 product of the
  dequantised weight, for fp32 and bf16 activations, partial tiles and tile scales spread over
  2^-40..2^20; each row alone == the row inside any batch, bit for bit; a tile-row slice of a
  registered weight (what `wo_a[g·r:(g+1)·r]` is) resolves to the same rows and scales and gives
  the same bits as those columns of the whole product (a wrong scale row would not); the
  runtime's linears on the tensor-core products with E4M3 weights are within `error_bound` of the
  reference on the dequantised weights, and non-FP8 weights keep the BF16 path;
* pure torch (main process): the BF16-exactness range of the tile scales (every E4M3 code × 2^s
  is BF16-exact for −124 ≤ s ≤ 119, not outside — checked exhaustively); the cache's FP8 view
  rules (unaligned / strided views, unregistered weights and missing scales raise); the CPU
  backend refuses E4M3 weights; `runtime_weights(dense_fp8=True)` holds every FP8 dense weight as
  the stored E4M3 tensor plus fp32 scales — no fp32 or BF16 copy — with the same dequantised
  value as the CPU path (also `wo_a`), and TP row slices follow the tiles;
* the kernel compiles for sm_90 (Triton's bundled ptxas, no GPU) without register spills;
* GPU (`gpu` marker): Flash shapes within the bound and row invariant; the runtime weights of
  the tiny checkpoint on CUDA hold no fp32/BF16 copy of an FP8 weight and the tiny forward's
  logits stay within the dense bound of the exact CPU path.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sglang_dsv41.checkpoint.codecs import dequantize_fp8_block, ue8m0_to_float
from sglang_dsv41.kernels import fp8_linear as F
from sglang_dsv41.reference import compressor, ops
from sglang_dsv41.runtime.backend import backend_for
from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm, error_bound
from sglang_dsv41.runtime.dense_weights import DenseWeightCache, Fp8Weight, fp8_scale_key, is_dense_linear_weight

from backend_helpers import TensorCoreProducts
from fp8_cases import (BF16, DEVICE, F32, F64, FP8, KERNEL_HERE, bf16_rows, bit_identity_case, check_row_prefixes,
                       check_rows_alone_equal_rows_in_a_batch, check_within_gemm_bound, dequantised, fp8_weight, kernel)
from tp_harness import stored_tensors
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

# ---- kernel cases (interpreter child / CUDA) -----------------------------------------------------

@kernel
@pytest.mark.parametrize("m,n,k,x_dtype", [(1, 64, 96, F32), (5, 96, 512, F32), (33, 40, 300, F32),
                                           (17, 64, 160, BF16)])
def test_kernel_case_within_gemm_bound(m: int, n: int, k: int, x_dtype: torch.dtype) -> None:
    check_within_gemm_bound(F.fp8_linear, m, n, k, x_dtype)


@kernel
def test_kernel_case_rows_alone_equal_rows_in_a_batch() -> None:
    check_rows_alone_equal_rows_in_a_batch(F.fp8_linear)


WIDE = F.Fp8LinearConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)


@kernel
@pytest.mark.parametrize("m,n,k", [(3, 160, 96), (19, 64, 300)])
def test_kernel_case_wide_tiles_within_gemm_bound_and_row_invariant(m: int, n: int, k: int) -> None:
    """BLOCK_N 64 (two 32-row scale tiles per program, a partial last tile at n = 160): each column
    uses its own tile row's scales — a shared scale vector would break the bound."""
    def wide(x, v, s):
        return F.fp8_linear(x, v, s, tiles=WIDE)
    check_within_gemm_bound(wide, m, n, k, F32)
    check_rows_alone_equal_rows_in_a_batch(wide)


@kernel
def test_kernel_case_tile_row_views_hit_the_cache() -> None:
    """wo_a-style group slices: same rows, same scale rows, same bits as the whole product."""
    g = torch.Generator().manual_seed(2)
    values, scales, x = bit_identity_case(6, 128, 192, g, exp_range=(-20, 0))   # distinct scales per tile row
    name = "layers.0.attn.wo_a.weight"
    cache = DenseWeightCache.from_weights({name: values, fp8_scale_key(name): scales})
    backend = BlockedBf16Gemm(cache, audit_inputs=True)
    whole = backend.matmul(x, values)
    for r0, r1 in [(0, 32), (32, 64), (64, 128), (96, 128)]:
        found = cache.lookup(values[r0:r1])
        assert isinstance(found, Fp8Weight) and found.values.data_ptr() == values[r0:r1].data_ptr()
        assert torch.equal(found.scales, scales[r0 // 32:r1 // 32])
        assert torch.equal(backend.matmul(x, values[r0:r1]), whole[:, r0:r1]), (r0, r1)
    backend.raise_if_inputs_inexact()


@kernel
def test_kernel_case_dense_helpers_with_fp8_weights() -> None:
    g = torch.Generator().manual_seed(3)
    values, scales = fp8_weight(64, 256, g)
    w = dequantised(values, scales)
    bf16_weight = ops.bf16(torch.randn(48, 256, generator=g) / 16).to(DEVICE)      # keeps the BF16 path
    weights = {"a.weight": values, "a.scale": scales, "b.weight": bf16_weight}
    cache = DenseWeightCache.from_weights(weights)
    assert cache.fp8_elements == values.numel() and cache.bf16_elements == bf16_weight.numel()
    assert cache.lookup(bf16_weight).dtype == BF16
    backend = TensorCoreProducts(BlockedBf16Gemm(cache, audit_inputs=True))
    x = bf16_rows(9, 256, g) * 4
    for weight, exact_w in [(values, w), (bf16_weight, bf16_weight)]:
        ref = {"linear_fp8": ops.linear_fp8(x, exact_w), "linear_bf16": ops.linear_bf16(x, exact_w),
               "matmul_fp32_exact": ops.matmul_fp32_exact(x, exact_w),
               "linear_fp32_out": compressor.linear_fp32_out(x, exact_w)}
        got = {"linear_fp8": backend.linear_fp8(x, weight), "linear_bf16": backend.linear_bf16(x, weight),
               "matmul_fp32_exact": backend.matmul(x, weight),
               "linear_fp32_out": backend.linear_bf16(x, weight, out_fp32=True)}
        backend.finish()
        for name, out in got.items():
            xq = ops.fp8_act_fake_quant(x) if name == "linear_fp8" else x
            bound = error_bound(xq, exact_w, out, ref[name], bf16_output=name in ("linear_fp8", "linear_bf16"))
            assert bool(((out.to(F64) - ref[name].to(F64)).abs() <= bound).all()), name


# ---- pure torch (main process) ----------------------------------------------------------------------

def test_scale_range_for_bf16_exact_dequantisation() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8).to(F32)            # every finite E4M3 value
    def exact(s: int) -> bool:
        v = codes * 2.0**s if -126 <= s <= 127 else (codes.to(F64) * 2.0**s).to(F32)
        return bool(torch.equal(v.to(BF16).to(F32), v)) and bool(torch.isfinite(v.to(BF16)).all())
    for s in range(F.MIN_EXACT_SCALE_EXPONENT, F.MAX_EXACT_SCALE_EXPONENT + 1, 7):
        assert exact(s) and F.scales_are_bf16_exact(torch.tensor([[2.0**s]]))
    for s in (F.MIN_EXACT_SCALE_EXPONENT, F.MAX_EXACT_SCALE_EXPONENT):
        assert exact(s) and F.scales_are_bf16_exact(torch.tensor([[2.0**s]]))
    for s in (F.MIN_EXACT_SCALE_EXPONENT - 1, F.MAX_EXACT_SCALE_EXPONENT + 1):
        assert not exact(s) and not F.scales_are_bf16_exact(torch.tensor([[2.0**s]]))
    assert not F.scales_are_bf16_exact(torch.tensor([[0.75]]))
    assert not F.scales_are_bf16_exact(torch.tensor([[float("nan")]]))
    assert not F.scales_are_bf16_exact(ue8m0_to_float(torch.zeros(1, 1, dtype=torch.uint8)))   # 2^-127


def test_exact_sum_case_is_exact_in_any_summation_order() -> None:
    """The bit-identity inputs (fp8_cases.exact_sum_case) sum exactly in fp32: forward, reversed and
    pairwise orders all equal the float64 product; neighbouring tile rows have different scales."""
    from fp8_cases import exact_sum_case

    values, scales, x = exact_sum_case(7, 96, 4096, torch.Generator().manual_seed(5), device="cpu")
    w = dequantised(values.cpu(), scales.cpu())
    exact = x.to(F64) @ w.to(F64).t()
    terms = x[:, None, :] * w[None, :, :]                                   # [m, n, k] fp32 products
    assert torch.equal(terms.to(F64), x.to(F64)[:, None, :] * w.to(F64)[None, :, :])
    forward = torch.zeros(7, 96)
    for j in range(0, 4096, 512):
        forward += terms[..., j:j + 512].sum(-1)
    assert torch.equal(forward.to(F64), exact)
    assert torch.equal(terms.flip(-1).cumsum(-1)[..., -1].to(F64), exact)
    assert torch.equal(terms.view(7, 96, 64, 64).sum(-1).sum(-1).to(F64), exact)
    assert bool((scales[1:] != scales[:-1]).all()) and exact.abs().max() > 2 ** 10


def test_fp8_cache_rules_without_the_kernel() -> None:
    g = torch.Generator().manual_seed(4)
    values, scales = fp8_weight(96, 64, g, device="cpu")
    cache = DenseWeightCache.from_weights({"w.weight": values, "w.scale": scales})
    assert cache.resident_bytes() == F.weight_bytes(96, 64) == 96 * 64 + 4 * 3 * 2
    assert "FP8" in cache.describe()
    last = cache.lookup(values[64:96])
    assert isinstance(last, Fp8Weight) and torch.equal(last.scales, scales[2:3])
    for bad in (values[16:48], values[:, :32], values.t()):
        with pytest.raises(ValueError, match="tile boundary"):
            cache.lookup(bad)
    with pytest.raises(KeyError, match="not registered"):
        cache.lookup(values.clone())
    with pytest.raises(KeyError, match="no tile scales"):
        DenseWeightCache.from_weights({"w.weight": values})
    with pytest.raises(ValueError, match="2\\^-124"):
        DenseWeightCache().add_fp8(values, scales * 2.0**-120)
    with pytest.raises(ValueError, match="fp32"):
        DenseWeightCache().add_fp8(values, scales[:2])
    with pytest.raises(ValueError, match="FP8 .* on CPU"):
        backend_for(torch.device("cpu"), {"w.weight": values, "w.scale": scales})
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET") if not KERNEL_HERE else _no_error():
        F.fp8_linear(torch.zeros(1, 64), values, scales)


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_runtime_weights_keep_fp8_dense_weights_as_stored(tiny_checkpoint) -> None:
    from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.weights import runtime_weights, stored_fp8_dense

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    stored = stored_tensors(tiny_checkpoint)
    cpu = torch.device("cpu")
    exact = runtime_weights(stored, cfg, cpu, experts_mxfp4=False)
    kept = runtime_weights(stored, cfg, cpu, experts_mxfp4=False, dense_fp8=True)
    fp8_specs = [s for s in tensor_inventory(cfg, vision=False, dspark=False) if s.kind is Kind.FP8]
    assert any(s.name.endswith("wo_a.weight") for s in fp8_specs)
    for spec in fp8_specs:
        v, s = kept[spec.name], kept[fp8_scale_key(spec.name)]
        assert v.dtype == FP8 and torch.equal(v.view(torch.uint8), stored[spec.name].view(torch.uint8))
        assert s.dtype == F32 and torch.equal(s, ue8m0_to_float(stored[spec.scale_name]))
        assert torch.equal(dequantize_fp8_block(v, stored[spec.scale_name]), exact[spec.name]), spec.name
    assert not any(isinstance(t, torch.Tensor) and t.dtype == FP8 for t in exact.values())
    assert set(kept) - set(exact) == {fp8_scale_key(s.name) for s in fp8_specs}
    cache = DenseWeightCache.from_weights(kept)
    assert cache.fp8_elements == sum(s.shape[0] * s.shape[1] for s in fp8_specs)
    fp8_names = {s.name for s in fp8_specs}
    copied = {n: t for n, t in kept.items() if is_dense_linear_weight(n, t) and t.dtype == F32}
    assert copied and not fp8_names & set(copied)                                   # no copy of an FP8 weight
    assert cache.bf16_elements + cache.fp32_elements == sum(t.numel() for t in copied.values())
    wq_b = next(s for s in fp8_specs if s.name.endswith("attn.wq_b.weight"))
    part = stored_fp8_dense(wq_b, stored.__getitem__, cpu, range(32, 64))
    assert part is not None and torch.equal(part[wq_b.name].view(torch.uint8),
                                            stored[wq_b.name][32:64].view(torch.uint8))
    assert torch.equal(part[fp8_scale_key(wq_b.name)], ue8m0_to_float(stored[wq_b.scale_name])[1:2])
    with pytest.raises(ValueError, match="tiles"):
        stored_fp8_dense(wq_b, stored.__getitem__, cpu, range(16, 48))
    tiny_scale = dict(stored)
    tiny_scale[wq_b.scale_name] = torch.zeros_like(stored[wq_b.scale_name].view(torch.uint8))   # 2^-127
    assert stored_fp8_dense(wq_b, tiny_scale.__getitem__, cpu) is None                       # → dequantised


def test_kernel_compiles_for_hopper_without_spills() -> None:
    if F.INTERPRETED:
        pytest.skip("compiled kernel only")
    cfg = F.DEFAULT_CONFIG
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=False)
    pointers = {"x_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*fp32"}
    kern = F._fp8_linear_kernel
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in kern.arg_names}
    compiled, usage = compile_for_sm90(kern, sig, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert no_spills(usage), usage
    assert "mma" in compiled.asm["ptx"]


if not F.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=10)


# ---- GPU ----------------------------------------------------------------------------------------------

#: FP8 dense shapes of one Flash layer (names.tensor_inventory with presets.flash_config_dict)
FLASH_SHAPES = {"wq_a": (1280, 5120), "wkv": (512, 5120), "wq_b": (32768, 1280), "wo_a": (8192, 4096),
                "wo_b": (5120, 8192), "shared_w1": (2304, 5120), "shared_w2": (5120, 2304),
                "indexer_wq_b": (4096, 1280), "engram_wkv": (25600, 6144)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FLASH_SHAPES))
def test_flash_shapes_within_bound_and_row_invariant_on_gpu(name: str) -> None:
    n, k = FLASH_SHAPES[name]
    g = torch.Generator().manual_seed(n + k)
    values, scales = fp8_weight(n, k, g, device="cuda")
    x = bf16_rows(300, k, g, device="cuda")
    full, worst = check_row_prefixes(F.fp8_linear, x, values, scales, (1, 5, 64, 300))
    if name == "wo_a":
        name_w = "layers.0.attn.wo_a.weight"
        backend = BlockedBf16Gemm(DenseWeightCache.from_weights({name_w: values, fp8_scale_key(name_w): scales}))
        assert torch.equal(backend.matmul(x[:5], values[1024:2048]), full[:5, 1024:2048])
    print(f"\n[fp8_linear {name}] worst |err| / GEMM_BOUND = {worst:.3g}")


@pytest.mark.gpu
def test_tiny_runtime_on_cuda_holds_fp8_weights_only(tiny_checkpoint) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime_scenarios import runtime_engine

    cuda = runtime_engine(tiny_checkpoint, torch.device("cuda"))
    fp8_names = [n for n, t in cuda.weights.items() if isinstance(t, torch.Tensor) and t.dtype == FP8]
    assert fp8_names and all(fp8_scale_key(n) in cuda.weights for n in fp8_names)
    cache = cuda.backend.dense.cache
    assert cache.fp8_elements == sum(cuda.weights[n].numel() for n in fp8_names)
    bf16_copied = sum(t.numel() for n, t in cuda.weights.items() if isinstance(t, torch.Tensor) and t.dtype == F32
                      and t.dim() == 2 and n.endswith(".weight") and not n.endswith("embed.weight"))
    assert cache.bf16_elements + cache.fp32_elements == bf16_copied       # only the BF16-kind weights


@kernel
def test_kernel_case_runtime_forward_with_fp8_weights(tiny_checkpoint, monkeypatch) -> None:
    """The runtime forward (`TorchForward`) on FP8-kept weights (the CUDA loading) with the FP8
    backend: logits of a tiny prompt match the exact CPU path up to the dense bound's size."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime_scenarios import one_shot_logits
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime import forward as fwd
    from sglang_dsv41.runtime.weights import runtime_weights

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    stored = stored_tensors(tiny_checkpoint)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    hasher = EngramHasher.from_config(cfg, token_map)
    dev = torch.device(DEVICE)
    with fwd.fp32_default_dtype():
        exact_w = runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=False)
        fp8_w = runtime_weights(stored, cfg, dev, experts_mxfp4=dev.type == "cuda", dense_fp8=True)
    exact = fwd.TorchForward(cfg, exact_w, hasher)
    backend = None
    if dev.type == "cpu":
        backend = TensorCoreProducts(BlockedBf16Gemm(DenseWeightCache.from_weights(fp8_w), audit_inputs=True))
    fast = fwd.TorchForward(cfg, fp8_w, hasher.to(dev), backend=backend)
    assert fast.backend.dense.cache.fp8_elements > 0
    tokens = list(range(5, 30))
    want = one_shot_logits(exact, torch.device("cpu"), tokens)
    got = one_shot_logits(fast, dev, tokens).cpu()
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-2 * scale, (float((got - want).abs().max()), scale)
