"""The tensor-core dense backend (`runtime/dense_ops.py`) on the H200 (marked `gpu`).

* every runtime linear (`linear_fp8` with/without activation quant, `linear_bf16` BF16/fp32 out,
  the bare product) on `BlockedBf16Gemm` (row blocks, and the opt-in `triton_rows`) is within
  `error_bound` of the exact float64 reference, at the tiny config's and Flash's weight shapes
  (LM head included), for 1, 37 and 300 rows; the worst error / bound ratio is printed;
* a row's result is bit-identical alone and inside a batch (row blocks) at Flash shapes;
* no float64 tensor is created inside the backend (dtype audit of every op) and its peak extra
  memory is far below a weight copy (the BF16 copy is made once at registration, not per call);
* an fp32 (non-BF16-exact) weight refuses to run with TF32 on;
* the tiny checkpoint's runtime forward runs on CUDA on the backend with the input audit on.

Run on the GPU machine: `python -m pytest -q -m gpu -s tests/test_runtime_dense_ops_gpu.py`.
"""
from __future__ import annotations

import pytest
import torch

from backend_helpers import TensorCoreProducts
from reference_weights import tiny_config
from runtime_scenarios import fixed_decode_tokens, run_scenario, runtime_engine, scenario_caches
from test_runtime_dense_ops import DtypeAudit
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.reference import compressor, ops
from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm, error_bound
from sglang_dsv41.runtime.dense_weights import DenseWeightCache

pytestmark = pytest.mark.gpu
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
CUDA = torch.device("cuda")


def _shapes(cfg: DeepseekV41Config) -> dict[str, tuple[int, int]]:
    """[out, in] of the dense weights of one layer and the LM head (spec §2.1 inventory)."""
    t = cfg.text
    H, q, hd = t.hidden_size, t.q_lora_rank, t.head_dim
    return {
        "wq_a": (q, H), "wq_b": (t.num_attention_heads * hd, q), "wkv": (hd, H),
        "wo_a_group": (t.o_lora_rank, t.heads_per_group * hd), "wo_b": (H, t.o_groups * t.o_lora_rank),
        "shared_w1": (t.moe_intermediate_size, H), "shared_w2": (H, t.moe_intermediate_size),
        "gate": (t.n_routed_experts, H), "indexer_wq_b": (t.index_n_heads * t.index_head_dim, q),
        "indexer_wk": (t.index_head_dim, hd), "head": (t.vocab_size, H),
    }


def _fp8_like(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """E4M3 values × a power-of-two scale per 32×32 tile (the loader's values; BF16-exact)."""
    w = torch.randn(n, k, generator=g, device=CUDA) / k**0.5
    pad_n, pad_k = -n % 32, -k % 32
    wp = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n))
    tiles = wp.reshape(wp.shape[0] // 32, 32, wp.shape[1] // 32, 32)
    scale = ops.pow2_ceil(tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-30) / ops.E4M3_MAX)
    return (ops.e4m3(tiles / scale) * scale).reshape(wp.shape)[:n, :k].contiguous()


HELPERS = {   # name: (reference helper, runtime linear on backend `be`, BF16 output)
    "linear_fp8": (lambda x, w: ops.linear_fp8(x, w), lambda be, x, w: be.linear_fp8(x, w), True),
    "linear_fp8_noquant": (lambda x, w: ops.linear_fp8(x, w, act_quant=False),
                           lambda be, x, w: be.linear_fp8(x, w, act_quant=False), True),
    "linear_bf16": (lambda x, w: ops.linear_bf16(x, w), lambda be, x, w: be.linear_bf16(x, w), True),
    "linear_bf16_fp32": (lambda x, w: ops.linear_bf16(x, w, out_fp32=True),
                         lambda be, x, w: be.linear_bf16(x, w, out_fp32=True), False),
    "matmul_fp32_exact": (ops.matmul_fp32_exact, lambda be, x, w: be.matmul(x, w), False),
    "linear_fp32_out": (compressor.linear_fp32_out, lambda be, x, w: be.linear_bf16(x, w, out_fp32=True), False),
}


@pytest.mark.parametrize("rows_mode", ["blocked", "triton"])
@pytest.mark.parametrize("config", ["tiny", "flash"])
def test_every_helper_within_its_bound(config: str, rows_mode: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = tiny_config(vision=False) if config == "tiny" else DeepseekV41Config.from_dict(flash_config_dict())
    g = torch.Generator(device=CUDA).manual_seed(0)
    worst = 0.0
    for name, (n, k) in _shapes(cfg).items():
        w = _fp8_like(n, k, g)
        triton = rows_mode == "triton"          # opt-in: < 129 rows on kernels.bf16_linear
        backend = TensorCoreProducts(BlockedBf16Gemm(DenseWeightCache.from_weights({f"{name}.weight": w}),
                                                     audit_inputs=True, whole_rows=triton, triton_rows=triton))
        for rows in (1, 37, 300):
            x = ops.bf16(torch.randn(rows, k, generator=g, device=CUDA))
            for fn_name, (fn, runtime_fn, bf16_out) in HELPERS.items():
                ref = fn(x, w)
                out = runtime_fn(backend, x, w)
                backend.finish()
                xq = ops.fp8_act_fake_quant(x) if fn_name == "linear_fp8" else x
                bound = error_bound(xq, w, out, ref, bf16_output=bf16_out)
                err = (out.to(F64) - ref.to(F64)).abs()
                ratio = float((err / bound.clamp(min=1e-300)).max())
                worst = max(worst, ratio)
                assert bool((err <= bound).all()), (config, name, rows, fn_name, ratio)
        del w, backend
        torch.cuda.empty_cache()
    print(f"\n[dense_ops {config} {rows_mode}] worst |out - ref| / bound = {worst:.3g}")


def test_rows_do_not_depend_on_the_batch_on_cuda() -> None:
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    g = torch.Generator(device=CUDA).manual_seed(1)
    for name in ("wq_a", "wo_b", "head"):
        n, k = _shapes(cfg)[name]
        w = _fp8_like(n, k, g)
        backend = BlockedBf16Gemm(DenseWeightCache.from_weights({f"{name}.weight": w}))
        x = ops.bf16(torch.randn(300, k, generator=g, device=CUDA))
        full = backend.matmul(x, w)
        for lo, hi in [(0, 1), (7, 8), (3, 70), (200, 300), (10, 140)]:
            assert torch.equal(backend.matmul(x[lo:hi], w), full[lo:hi]), (name, lo, hi)


def test_whole_rows_take_a_bf16_operand_as_is_with_the_copied_bits() -> None:
    """A whole-rows product of a contiguous BF16 activation skips `_fresh`'s copy and gives the bits of the
    copied operand (an fp32 activation of the same values is copied): the cuBLAS choice is the same."""
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    g = torch.Generator(device=CUDA).manual_seed(5)
    for name in ("wkv", "indexer_wq_b", "gate"):
        n, k = _shapes(cfg)[name]
        w = ops.bf16(torch.randn(n, k, generator=g, device=CUDA) / k**0.5)       # BF16-valued: held as BF16
        backend = BlockedBf16Gemm(DenseWeightCache.from_weights({f"{name}.weight": w}), whole_rows=True)
        x = ops.bf16(torch.randn(8193, k, generator=g, device=CUDA)).to(BF16)
        for rows in (x[:8192], x[1:]):
            assert torch.equal(backend.matmul(rows, w), backend.matmul(rows.float(), w)), name


def _peak_extra_bytes(run) -> int:
    """Peak CUDA memory allocated while `run()` executes, above what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_no_float64_and_no_per_call_weight_conversion() -> None:
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    g = torch.Generator(device=CUDA).manual_seed(2)
    n, k = _shapes(cfg)["wo_b"]
    w = _fp8_like(n, k, g)
    dense = BlockedBf16Gemm(DenseWeightCache.from_weights({"wo_b.weight": w}), audit_inputs=True)
    x = ops.bf16(torch.randn(5, k, generator=g, device=CUDA))

    def calls() -> None:
        dense.matmul(ops.fp8_act_fake_quant(x), w)
        dense.matmul(x, w)
        dense.matmul(x[:, : k // 2].contiguous(), w[:, : k // 2])     # a view of the weight
        dense.raise_if_inputs_inexact()

    audit = DtypeAudit()
    with audit:
        calls()
    assert F64 not in audit.dtypes and BF16 in audit.dtypes
    extra = _peak_extra_bytes(calls)
    assert extra < w.numel(), extra                             # < half the BF16 copy: no weight conversion
    exact_audit = DtypeAudit()                                 # the checks see the exact path's copies
    with exact_audit:
        assert _peak_extra_bytes(lambda: ops.matmul_fp32_exact(x, w)) >= 8 * w.numel()
    assert F64 in exact_audit.dtypes


def test_fp32_weight_refuses_tf32() -> None:
    g = torch.Generator(device=CUDA).manual_seed(3)
    w = torch.randn(64, 128, generator=g, device=CUDA)          # not BF16-exact: kept fp32
    cache = DenseWeightCache.from_weights({"odd.weight": w})
    assert cache.fp32_elements == w.numel()
    x = ops.bf16(torch.randn(4, 128, generator=g, device=CUDA))
    backend = BlockedBf16Gemm(cache)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with pytest.raises(RuntimeError, match="TF32"):
            backend.matmul(x, w)
        torch.backends.cuda.matmul.allow_tf32 = False
        out, ref = backend.matmul(x, w), ops.matmul_fp32_exact(x, w)
        assert bool(((out.to(F64) - ref.to(F64)).abs() <= error_bound(x, w, out, ref, False)).all())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def test_tiny_runtime_forward_on_cuda_with_the_input_audit(tiny_checkpoint) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = runtime_engine(tiny_checkpoint, CUDA)
    dense = engine.backend.dense
    assert dense.cache.fp8_elements > 0
    dense.audit_inputs = True
    got = run_scenario(engine, scenario_caches(engine, CUDA), CUDA, fixed_decode_tokens())
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
