"""The CUDA compute backend (`runtime.triton_backend.TritonBackend`) under the numerics contract (issue 13
item 5; issue 21: W8A8 FP8 linears, no float64 on the GPU path).

The backend runs on FP8 weights as the CUDA server loads them (`runtime_weights(..., dense_fp8=True)`:
E4M3 tiles + power-of-two scales) in every FP8 mode (`backend.FP8_GEMMS`): `w8a8_fold` (serving
default: `kernels.fp8_w8a8` at every row count, its scale-folded tier `kernels.fp8_fold` for ≤ 16
rows), `w8a8_f16` (the same without the folded tier), `tiered` (the `w8a16` kernel below the
prefill row count, the BF16-copy cuBLAS form of `kernels.fp8_w8a8` from there), `w8a16`
(`--enable-deterministic-inference`), `fp8_mma` (opt-in: its mid row tier on Hopper's FP8 MMA),
`w8a8_gemv` (opt-in: the CUDA-core tier `kernels.fp8_gemv` for ≤ 4 rows). Pinned:

* kernel cases (TRITON_INTERPRET child on CPU machines, compiled on CUDA):
  - every sublayer piece — projections, output projection (grouped `wo_a`), ratio-2 pair
    latents, router, shared expert, Engram update — within the CPU contract's bound
    (`test_runtime_numerics_contract.SUBLAYER_ULPS` BF16 ulps of the row's largest reference
    magnitude) of the reference on the dequantised weights, and the router picks its experts;
  - `w8a8_f16` and `fp8_mma` run every FP8 linear through `fp8_w8a8_linear` at every row count
    (`wo_a`: one grouped launch with act_quant=False; `fp8_mma` passes fp8_mma=True); `tiered`
    calls it from the prefill row count only; `w8a16` never calls it;
  - a static decode step takes its Engram rows and ring advance from `kernels.engram_rows`, with the
    torch path's hidden states and request state bit for bit;
  - the CUDA mHC (`mhc_ops.TritonMhc`, R held as BF16) in the serving forward: a prefill and a decode
    step give the logits and DSpark captures of the same forward with R held as fp32, bit for bit;
  - no float64 tensor is created by those pieces, nor by a whole forward on the backend
    (`Float64Watch`, a torch dispatch mode: every op's outputs are checked). Under the interpreter
    the model runs on CPU tensors, so attention, mHC and the routed experts are the fp32 CPU
    implementations there; the CUDA-only ones are covered by the GPU test below;
* `fp8_gemm_for`: deterministic → w8a16, serving → tiered, SGLANG_DSV41_FP8_GEMM overrides, a bad
  value raises;
* GPU (`gpu`): the CUDA forward as the server builds it (deterministic off) creates no float64
  tensor (float64 inside Triton kernels is not a torch tensor: the compile checks of
  tests/test_kernels_mhc.py pin `.f64`-free PTX there; docs/runtime.md lists the kernels that
  still evaluate in float64), and on the tiny checkpoint,
  teacher-forced on the reference's greedy tokens, meets the end-to-end contract
  (`MIN_TOP1_AGREEMENT`, `LOGIT_BOUND`; fp8_mma: `FP8_MMA_MIN_TOP1_AGREEMENT`), also with the
  serving default's BF16 prefill workspace taken by every batch; the measured values are printed.
"""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sglang_dsv41.kernels import fp8_w8a8 as W
from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.numerics.rope import layer_inv_freq
from sglang_dsv41.reference import attention as RA
from sglang_dsv41.reference import compressor as RC
from sglang_dsv41.reference import engram as RE
from sglang_dsv41.reference import moe as RM
from sglang_dsv41.reference import ops
from sglang_dsv41.runtime import attention_math as M
from sglang_dsv41.runtime import backend as B
from sglang_dsv41.runtime import moe_ops
from sglang_dsv41.runtime import triton_backend as TB
from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm
from sglang_dsv41.runtime.dense_weights import DenseWeightCache
from sglang_dsv41.runtime.engram_gate import engram_update
from runtime_values import with_linear_layers
from test_runtime_numerics_contract import LOGIT_BOUND, MIN_TOP1_AGREEMENT, within_ulps

#: `fp8_mma` (opt-in) is held to a looser end-to-end agreement than the contract's: measured on the
#: H200 at 98.92 % top-1 over the scenario prompts (session 7, as `w8a8`; docs/runtime.md
#: "Numerics contract"), the reason it is not the serving default; its worst |Δlogit| 0.095 (session 7)
#: and 0.102 (session 11) sit just above the contract's LOGIT_BOUND, so it has a looser one too.
FP8_MMA_MIN_TOP1_AGREEMENT = 0.98
FP8_MMA_LOGIT_BOUND = 0.15
#: The FlashMLA prefill (opt-in, SGLANG_DSV41_ATTN_PREFILL=flashmla) rounds the softmax weights to
#: BF16: on the H200 (session 17, index lists padded to 128) 98.56 % top-1 (4 of 278 near ties) with
#: max |Δlogit| 0.082 ≤ LOGIT_BOUND — below the contract's top-1 bar, so it is held to the opt-in bar.
FLASHMLA_MIN_TOP1_AGREEMENT = 0.98

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = FE.INTERPRETED and W.INTERPRETED
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
CPU = torch.device("cpu")
kernel = pytest.mark.skipif(not (INTERPRETED or torch.cuda.is_available()),
                            reason="runs in the TRITON_INTERPRET child (or on CUDA)")
GREEDY_STEPS = 16


class Float64Watch(TorchDispatchMode):
    """Records every op whose outputs include a float64 tensor, with the innermost repository
    frame (`path:line`) that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_flatten(out)[0]):
            self.seen.append((str(func), _repo_frame()))
        return out

    def sources(self) -> set[str]:
        return {where.split(":")[0] for _, where in self.seen}


def _repo_frame() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / "tests") and path.name != "_python_dispatch.py":
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "outside the repository"


@pytest.fixture(scope="module")
def weights(tiny_checkpoint):
    """(config, dequantised CPU weights = the reference's, FP8-kept weights on DEVICE — routed
    experts MXFP4 on CUDA, as the CUDA MoE needs them —, hasher)."""
    from sglang_dsv41.checkpoint.reader import CheckpointReader
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.forward import fp32_default_dtype
    from sglang_dsv41.runtime.weights import runtime_weights

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {name: reader.get(name) for name in reader.names()}
    with fp32_default_dtype():
        exact = runtime_weights(stored, cfg, CPU, experts_mxfp4=False)
        fp8 = runtime_weights(stored, cfg, DEVICE, experts_mxfp4=DEVICE.type == "cuda", dense_fp8=True)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return cfg, exact, fp8, EngramHasher.from_config(cfg, token_map)


def triton_backend(fp8_weights, fp8_gemm: str) -> TB.TritonBackend:
    dense = BlockedBf16Gemm(DenseWeightCache.from_weights(fp8_weights), audit_inputs=True)
    assert dense.cache.fp8_elements > 0
    return TB.TritonBackend(dense, device_types=(DEVICE.type,), fp8_gemm=fp8_gemm)


def _bf16(*shape, seed: int) -> torch.Tensor:
    return ops.bf16(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def piece_inputs(cfg, exact) -> dict:
    """Inputs of the sublayer pieces (made outside any float64 watch: the RoPE tables are built in
    float64 once, at load)."""
    t = cfg.text
    role = next(r for r in t.layer_roles() if r.ratio == 2 and r.computes_latents)
    g = f"layers.{t.engram_layer_ids[0]}.engram."
    table = exact[g + "embed.weight"]
    rows = torch.randint(0, table.shape[0], (7, exact[g + "wkv.weight"].shape[1] // table.shape[1]),
                         generator=torch.Generator().manual_seed(3))
    return dict(p=f"layers.{role.layer}.attn.", inv=layer_inv_freq(t, role.ratio), pos=torch.arange(12),
                x=_bf16(12, t.hidden_size, seed=1), o=_bf16(12, t.num_attention_heads, t.head_dim, seed=2),
                f="layers.0.ffn.", sh="layers.0.ffn.shared_experts.", g=g, rows=rows, table_rows=table[rows],
                R=_bf16(7, t.hc_mult, t.hidden_size, seed=4))


def backend_pieces(be: B.ComputeBackend, cfg, w, i: dict) -> dict[str, torch.Tensor]:
    """Each sublayer piece (module doc) on the backend, on DEVICE (the linears as the runtime's
    layers over `w`'s tensors)."""
    t, p, f, sh, g = cfg.text, i["p"], i["f"], i["sh"], i["g"]
    w = with_linear_layers(w, cfg)
    x, pos, inv = (i[k].to(DEVICE) for k in ("x", "pos", "inv"))
    out = dict(enumerate(M.project_q_kv(be, t, w, p, x, pos, inv, True, t.num_attention_heads)))
    out = {f"project_q_kv[{k}]": v for k, v in out.items()}
    out["output_projection"] = M.output_projection(be, t, w, p, i["o"].to(DEVICE), pos, inv, True)
    a, s = M.pair_scores(be, w, p, x)
    out["pair_latents"] = M.pair_latents(be, a[0::2], s[0::2], a[1::2], s[1::2],
                                         w[p + "compressor.norm.weight"], t.rms_norm_eps)
    r = moe_ops.route(be, x, w[f + "gate"], w[f + "gate.bias"], t.num_experts_per_tok)
    out["route.experts"], out["route.weights"] = r.experts.sort(dim=-1).values, r.weights
    out["shared_expert"] = moe_ops.shared_expert(be, x, w[sh + "w1"], w[sh + "w2"], w[sh + "w3"],
                                                 t.swiglu_limit, True)
    out["engram_update"] = engram_update(be, i["R"].to(DEVICE), i["table_rows"].to(DEVICE), w[g + "wkv"],
                                         w[g + "q_weight"], w[g + "k_weight"], t.rms_norm_eps, True, None)
    return out


def reference_pieces(cfg, w, i: dict) -> dict[str, torch.Tensor]:
    t, p, f, sh, g, x, pos, inv = (cfg.text, i["p"], i["f"], i["sh"], i["g"], i["x"], i["pos"], i["inv"])
    out = {f"project_q_kv[{k}]": v for k, v in enumerate(RA.project_q_kv(t, w, p, x, pos, inv, True))}
    out["output_projection"] = RA.output_projection(t, w, p, i["o"], pos, inv, True)
    out["pair_latents"] = RC.ratio2_latents(t, w, p, x, pos, None)[0]
    r = RM.route(x, w[f + "gate.weight"], w[f + "gate.bias"], t.num_experts_per_tok)
    out["route.experts"], out["route.weights"] = r.experts.sort(dim=-1).values, r.weights
    out["shared_expert"] = RM.shared_expert(x, w[sh + "w1.weight"], w[sh + "w2.weight"], w[sh + "w3.weight"],
                                            t.swiglu_limit, True)
    table = w[g + "embed.weight"]
    out["engram_update"] = RE.engram_residual_update(i["R"], i["rows"], table, w[g + "wkv.weight"], w[g + "q_weight"],
                                                     w[g + "k_weight"], t.rms_norm_eps)
    return out


@kernel
@pytest.mark.parametrize("fp8_gemm", B.FP8_GEMMS)
def test_kernel_case_sublayers_within_the_contract_without_float64(weights, fp8_gemm: str, monkeypatch) -> None:
    cfg, exact, fp8, _ = weights
    be = triton_backend(fp8, fp8_gemm)
    calls: list[tuple[int, bool, bool, bool, bool]] = []
    rows: list[int] = []
    kernel_fn = W.fp8_w8a8_linear
    monkeypatch.setattr(W, "fp8_w8a8_linear", lambda x, v, s, **kw: rows.append(x.shape[0]) or calls.append(
        (kw["groups"], kw["act_quant"], kw.get("fp8_mma", False), kw.get("gemv", False), kw.get("fold", False)))
        or kernel_fn(x, v, s, **kw))
    inputs = piece_inputs(cfg, exact)
    with Float64Watch() as watch:
        got = backend_pieces(be, cfg, fp8, inputs)
    be.finish()
    assert not watch.seen, watch.seen[:5]
    want = reference_pieces(cfg, exact, inputs)
    assert got.keys() == want.keys()
    for name, value in got.items():
        value = value.cpu()
        if name == "route.experts":
            assert torch.equal(value, want[name]), name
        else:
            assert within_ulps(value.float(), want[name].float()), (name, float((value - want[name]).abs().max()))
    groups = cfg.text.o_groups
    if fp8_gemm == "w8a16":
        assert not calls
    elif fp8_gemm == "tiered":                                  # the prefill form only
        assert all(r >= W.BF16_GEMM_MIN_ROWS for r in rows), rows
    else:                                                       # wq_a wkv wq_b wo_b 3 shared engram; wo_a grouped
        mma, gemv, fold = fp8_gemm == "fp8_mma", fp8_gemm == "w8a8_gemv", fp8_gemm == "w8a8_fold"
        assert (groups, False, False, gemv, fold) in calls and calls.count((1, True, mma, gemv, fold)) >= 8, calls


@kernel
def test_kernel_case_quantised_handoff_keeps_the_output_projection_bits(weights, monkeypatch) -> None:
    """`w8a8_fold` at ≤ 16 rows: `wo_a` writes `wo_b`'s x quantised and `wo_b` multiplies it as loaded
    (`quantised_handoff`) — the bits of the hand-off off, where `wo_b` quantises it itself; the other
    modes never ask for it."""
    cfg, exact, fp8, _ = weights
    be = triton_backend(fp8, "w8a8_fold")
    assert be.quantised_handoff(1) and be.quantised_handoff(16) and not be.quantised_handoff(17)
    assert not triton_backend(fp8, "w8a8_f16").quantised_handoff(1) and not B.FastTorchBackend().quantised_handoff(1)
    i = piece_inputs(cfg, exact)
    w = with_linear_layers(fp8, cfg)
    o, pos, inv = (i[k].to(DEVICE) for k in ("o", "pos", "inv"))
    calls: list[tuple[bool, bool]] = []
    kernel_fn = W.fp8_w8a8_linear
    monkeypatch.setattr(W, "fp8_w8a8_linear", lambda x, v, s, **kw: calls.append(
        (kw["quantise_out"], kw["x_quantised"])) or kernel_fn(x, v, s, **kw))
    on = M.output_projection(be, cfg.text, w, i["p"], o, pos, inv, True)
    assert calls == [(True, False), (False, True)], calls
    monkeypatch.setattr(be, "quantised_handoff", lambda rows: False)
    off = M.output_projection(be, cfg.text, w, i["p"], o, pos, inv, True)
    assert calls[2:] == [(False, False)] * 2 and torch.equal(on, off)


@kernel
def test_kernel_case_forward_with_the_quantised_handoff_keeps_its_bits(weights, monkeypatch) -> None:
    """A 12-token prefill on the serving mode (`w8a8_fold`; attention / mHC / routed experts: the CPU fp32
    implementations under the interpreter): each layer hands its four FP8 readers quantised activations —
    the mHC sublayer inputs to `wq_a | wkv` and the shared `w1 | w3`, `wo_a` to `wo_b`, the SwiGLU to `w2`
    (`quantised_handoff`) — and the logits equal those of the same forward with the hand-off off, bit for bit."""
    from runtime_scenarios import one_shot_logits
    from sglang_dsv41.runtime.forward import TorchForward

    cfg, _, fp8, hasher = weights
    fast = TorchForward(cfg, fp8, hasher.to(DEVICE), backend=triton_backend(fp8, "w8a8_fold"))
    flags: list[bool] = []
    real = W.fp8_w8a8_linear
    monkeypatch.setattr(W, "fp8_w8a8_linear", lambda *a, **kw: flags.append(kw.get("x_quantised", False))
                        or real(*a, **kw))
    tokens = list(range(5, 17))
    on = one_shot_logits(fast, DEVICE, tokens).cpu()
    assert sum(flags) == 4 * cfg.text.num_hidden_layers, (sum(flags), len(flags))
    monkeypatch.setattr(fast.backend, "quantised_handoff", lambda rows: False)
    flags.clear()
    off = one_shot_logits(fast, DEVICE, tokens).cpu()
    assert not any(flags) and torch.equal(on, off)


def _dtype_recording(real, seen: list):
    """`real(R, *args)`, recording (R's dtype, the result's dtype)."""
    def call(R, *args):
        out = real(R, *args)
        seen.append((R.dtype, out.dtype))
        return out
    return call


@kernel
def test_kernel_case_forward_with_bf16_residual_streams_keeps_its_bits(weights, monkeypatch) -> None:
    """The CUDA mHC (`mhc_ops.TritonMhc`: R held as BF16, spec §3.2's BF16 values) in the serving forward
    (`w8a8_fold`; the Engram layers on `kernels.engram_gate.engram_residual`): an 11-token prefill, then one
    decode step, with the DSpark capture of two layers (`stream_mean`) — the logits and captures equal,
    bit for bit, those of the same forward with R held as fp32; every residual update and Engram update
    took and wrote R in its dtype."""
    from runtime_scenarios import prefill_then_decode
    from sglang_dsv41.runtime import mhc_ops
    from sglang_dsv41.runtime.forward import TorchForward

    cfg, _, fp8, hasher = weights
    fast = TorchForward(cfg, fp8, hasher.to(DEVICE), backend=triton_backend(fp8, "w8a8_fold"))
    fast.mhc = mhc_ops.TritonMhc(deterministic=False)
    fast.set_capture_layers([0, cfg.text.num_hidden_layers - 1])
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    for owner, name in ((fast.mhc, "residual_update"), (fast.backend, "engram_residual")):
        monkeypatch.setattr(owner, name, _dtype_recording(getattr(owner, name), seen))
    tokens = list(range(5, 17))

    held_bf16 = prefill_then_decode(fast, DEVICE, tokens)
    assert fast.mhc.residual_dtype == torch.bfloat16 and len(seen) > 2 * cfg.text.num_hidden_layers
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}, set(seen)
    seen.clear()
    monkeypatch.setattr(fast.mhc, "residual_dtype", torch.float32)
    held_fp32 = prefill_then_decode(fast, DEVICE, tokens)
    assert set(seen) == {(torch.float32, torch.float32)}, set(seen)
    assert all(torch.equal(a, b) for a, b in zip(held_bf16, held_fp32)) and len(held_bf16) == 6


@kernel
def test_kernel_case_forward_on_the_backend_creates_no_float64(weights) -> None:
    """A whole prefill + decode on the serving backend (`tiered`; attention / mHC / routed experts: the CPU
    fp32 implementations under the interpreter) creates no float64 tensor; its logits stay
    within the contract's logit bound of the exact CPU path on this prompt."""
    from runtime_scenarios import greedy_generate, one_shot_logits
    from sglang_dsv41.runtime.forward import TorchForward

    cfg, exact, fp8, hasher = weights
    reference = TorchForward(cfg, exact, hasher)
    fast = TorchForward(cfg, fp8, hasher.to(DEVICE), backend=triton_backend(fp8, "tiered"))
    tokens = list(range(5, 22))
    with Float64Watch() as watch:
        got = one_shot_logits(fast, DEVICE, tokens).cpu()
        greedy_generate(fast, DEVICE, tokens[:6], 2)     # a prefill, then one decode step
    assert not watch.seen, watch.seen[:5]
    want = one_shot_logits(reference, CPU, tokens)
    assert float((got - want).abs().max()) <= LOGIT_BOUND, float((got - want).abs().max())


@kernel
def test_kernel_case_static_decode_engram_rows_on_the_kernels(weights, monkeypatch) -> None:
    """A graphed decode step's layout (static: value checks off; two live requests, one CUDA-graph padding
    request) takes the Engram rows and the ring's advance from `kernels.engram_rows` (two launches): the
    same hidden states, Engram ring and pair ring as the torch path (`ComputeBackend.engram_ring_rows`)."""
    from sglang_dsv41.kernels import engram_rows as ER
    from sglang_dsv41.runtime.batch import static_decode_layout
    from sglang_dsv41.runtime.cache import RuntimeCaches
    from sglang_dsv41.runtime.forward import TorchForward

    cfg, _, fp8, hasher = weights
    fast = TorchForward(cfg, fp8, hasher.to(DEVICE), backend=triton_backend(fp8, "w8a8_fold"))
    t, g, page, ctx = cfg.text, torch.Generator().manual_seed(9), 64, 40
    caches = RuntimeCaches.allocate(t, page + 2 * 64, 4, device=DEVICE, page_size=page)
    for rows in (caches.latent_rows, caches.key_rows):
        rows.copy_(torch.randint(0, 120, rows.shape, generator=g).to(torch.uint8))
    for swa in caches.swa:
        swa.copy_(torch.randn(swa.shape, generator=g).to(swa.dtype))
    ring = caches.engram_history
    ring.ids.copy_(torch.randint(3, 900, ring.ids.shape, generator=g).to(torch.int32))
    ring.end.fill_(ctx - 1)
    table = torch.zeros(4, ctx, dtype=torch.int32)
    table[1:3] = (page + torch.arange(2 * ctx, dtype=torch.int32)).view(2, ctx)
    rows, seq = torch.tensor([1, 2, 0]), torch.tensor([ctx, ctx - 1, 1])
    out = torch.stack([table[1, ctx - 1], table[2, ctx - 2], torch.tensor(0, dtype=torch.int32)]).long()
    layout = static_decode_layout(*(x.to(DEVICE) for x in (rows, seq, seq - 1, out, table)))
    ids = torch.tensor([17, 301, 5], device=DEVICE)
    before = [x.clone() for x in (ring.ids, ring.end, *caches.pair_kv.values(), *caches.pair_position.values())]
    launches: list[str] = []
    real = ER.engram_ring_rows
    monkeypatch.setattr(ER, "engram_ring_rows", lambda *a, **kw: launches.append("rows") or real(*a, **kw))
    fused = fast.hidden_states(ids, layout, caches).cpu()
    after = [x.clone() for x in (ring.ids, ring.end, *caches.pair_kv.values(), *caches.pair_position.values())]
    assert launches == ["rows"] and not torch.equal(after[0], before[0])
    for x, held in zip((ring.ids, ring.end, *caches.pair_kv.values(), *caches.pair_position.values()), before):
        x.copy_(held)
    monkeypatch.setattr(fast.backend, "engram_ring_rows", lambda *a: B.ComputeBackend.engram_ring_rows(fast.backend, *a))
    torch_path = fast.hidden_states(ids, layout, caches).cpu()
    assert launches == ["rows"] and torch.equal(fused, torch_path)
    for x, want in zip((ring.ids, ring.end, *caches.pair_kv.values(), *caches.pair_position.values()), after):
        assert torch.equal(x, want)


@kernel
@pytest.mark.parametrize("fp8_gemm", ["tiered", "w8a8_f16", "w8a8_gemv", "w8a8_fold"])
def test_kernel_case_which_row_counts_run_the_w8a8_module(weights, fp8_gemm: str, monkeypatch) -> None:
    """`w8a8_f16`: `fp8_w8a8_linear` at decode (split-K tier), mid and prefill row counts; `w8a8_gemv`:
    the same, with the single row on the CUDA-core GEMV; `w8a8_fold`: the single row on the scale-folded
    tier; `tiered`: at the prefill row count only
    (the `w8a16` kernel below). All within the contract's per-sublayer bound of the w8a16 backend's
    result (the same operands summed another way)."""
    from sglang_dsv41.kernels import fp8_fold, fp8_gemv

    cfg, exact, fp8, _ = weights
    calls: list[int] = []
    kernel_fn, gemv_kernel, gemv_rows = W.fp8_w8a8_linear, fp8_gemv._gemv_kernel, []
    monkeypatch.setattr(W, "fp8_w8a8_linear", lambda x, v, s, **kw: calls.append(x.shape[0]) or kernel_fn(x, v, s, **kw))
    monkeypatch.setattr(fp8_gemv, "_gemv_kernel", _RecordingLaunch(gemv_kernel, gemv_rows))
    fold_rows: list[int] = []
    monkeypatch.setattr(fp8_fold, "_fold_kernel", _RecordingLaunch(fp8_fold._fold_kernel, fold_rows))
    be, w8a16 = triton_backend(fp8, fp8_gemm), triton_backend(fp8, "w8a16")
    name = next(n for n in fp8 if n.endswith("attn.wq_a.weight"))
    wo_a = next(n for n in fp8 if n.endswith("attn.wo_a.weight"))
    groups = cfg.text.o_groups
    for rows in (1, 20, W.BF16_GEMM_MIN_ROWS):
        x = _bf16(rows, cfg.text.hidden_size, seed=rows).to(DEVICE)
        got, want = be.linear_fp8(x, fp8[name]), w8a16.linear_fp8(x, fp8[name])
        assert within_ulps(got.float().cpu(), want.float().cpu()), rows
        # BF16_OUT: the w8a8 module's result held as BF16 (same values); other paths keep fp32
        held = be.linear_fp8(x.to(torch.bfloat16), fp8[name], bf16_out=True)
        module = fp8_gemm != "tiered" or rows >= W.BF16_GEMM_MIN_ROWS
        assert held.dtype == (torch.bfloat16 if module else torch.float32) and torch.equal(held.float(), got), rows
        o = _bf16(rows, groups * fp8[wo_a].shape[1], seed=rows + 1).to(DEVICE)
        grouped = be.linear_bf16_grouped(o, fp8[wo_a], groups)
        held = be.linear_bf16_grouped(o.to(torch.bfloat16), fp8[wo_a], groups, bf16_out=True)
        assert held.dtype == (torch.bfloat16 if module else torch.float32) and torch.equal(held.float(), grouped), rows
    each = [1, 20, W.BF16_GEMM_MIN_ROWS] if fp8_gemm != "tiered" else [W.BF16_GEMM_MIN_ROWS]
    assert calls == [r for r in each for _ in range(4)], calls
    assert gemv_rows == ([1] * 4 if fp8_gemm == "w8a8_gemv" else []), gemv_rows
    assert fold_rows == ([1] * 4 if fp8_gemm == "w8a8_fold" else []), fold_rows


class _RecordingLaunch:
    """Stands in for `fp8_gemv._gemv_kernel` / `fp8_fold._fold_kernel`: records the rows (M) of each launch, then launches."""

    def __init__(self, kern, rows: list[int]) -> None:
        self.kern, self.rows = kern, rows

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.rows.append(int(args[6]))               # M
            return self.kern[grid](*args, **kwargs)
        return launch


@kernel
def test_kernel_case_row_parallel_partials_sum_within_the_contract(weights) -> None:
    """TP 2 row-parallel `wo_b` (`TensorParallel.row_parallel`): each rank's partial on its 32-wide
    column block (`linear_fp8_partial`: the W8A16 kernel, fp32, not rounded) summed and rounded
    once is within the contract's per-sublayer bound of the whole linear."""
    from sglang_dsv41.runtime.dense_weights import fp8_scale_key

    cfg, _, fp8, _ = weights
    name = "layers.0.attn.wo_b.weight"
    values, scales = fp8[name], fp8[fp8_scale_key(name)]
    half = values.shape[1] // 2
    shards = {}
    for r in range(2):
        shards[f"r{r}.weight"] = values[:, r * half:(r + 1) * half].contiguous()
        shards[f"r{r}.scale"] = scales[:, r * half // 32:(r + 1) * half // 32].contiguous()
    sharded = TB.TritonBackend(BlockedBf16Gemm(DenseWeightCache.from_weights(shards, lambda n, v: n.endswith(".weight"))),
                              device_types=(DEVICE.type,), fp8_gemm="tiered")
    x = _bf16(12, values.shape[1], seed=5).to(DEVICE)
    parts = [sharded.linear_fp8_partial(x[:, r * half:(r + 1) * half], shards[f"r{r}.weight"]) for r in range(2)]
    assert all(part.dtype == torch.float32 for part in parts)
    got = sharded.linear_fp8_finish(parts[0] + parts[1])
    want = triton_backend(fp8, "w8a16").linear_fp8(x, values)
    assert within_ulps(got.float().cpu(), want.float().cpu()), float((got - want).abs().max())


def test_fp8_gemm_choice(monkeypatch) -> None:
    monkeypatch.delenv(B.FP8_GEMM_ENV, raising=False)
    assert B.fp8_gemm_for(deterministic=True) == "w8a16"
    assert B.fp8_gemm_for(deterministic=False) == "w8a8_fold"
    monkeypatch.setenv(B.FP8_GEMM_ENV, "W8A16")
    assert B.fp8_gemm_for(deterministic=False) == "w8a16"
    monkeypatch.setenv(B.FP8_GEMM_ENV, "fp8")
    with pytest.raises(ValueError, match="SGLANG_DSV41_FP8_GEMM"):
        B.fp8_gemm_for(deterministic=False)
    if INTERPRETED:
        with pytest.raises(ValueError, match="fp8_gemm must be one of"):
            TB.TritonBackend(B.ExactTorchBackend(), device_types=("cpu",), fp8_gemm="fp8")


def test_grouped_linear_default_is_the_per_group_loop_and_checks_shapes() -> None:
    be = B.FastTorchBackend()
    x, w = _bf16(3, 4 * 64, seed=5), _bf16(4 * 32, 64, seed=6)
    want = torch.cat([be.linear_bf16(x[:, g * 64:(g + 1) * 64], w[g * 32:(g + 1) * 32]) for g in range(4)], dim=1)
    assert torch.equal(be.linear_bf16_grouped(x, w, 4), want)
    with pytest.raises(ValueError, match="do not form 3 groups"):
        be.linear_bf16_grouped(x, w, 3)


if not INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        from triton_checks import run_kernel_cases_in_interpreter

        run_kernel_cases_in_interpreter(__file__, min_passed=16, exact=True)


# ---- GPU: the CUDA forward as the server builds it ---------------------------------------------

@pytest.mark.gpu
def test_gpu_cuda_forward_creates_no_float64_tensor(tiny_checkpoint) -> None:
    from runtime_scenarios import greedy_generate, runtime_engine

    engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
    assert isinstance(engine.backend, TB.TritonBackend) and engine.backend.fp8_gemm == "w8a8_fold"
    with Float64Watch() as watch:
        greedy_generate(engine, DEVICE, list(range(5, 60)), 4)
    print(f"\nfloat64 on the CUDA forward, by source: {sorted(watch.sources()) or 'none'}")
    assert not watch.seen, watch.seen[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_gemm", B.FP8_GEMMS)
def test_gpu_teacher_forced_contract(tiny_checkpoint, fp8_gemm: str, monkeypatch) -> None:
    from runtime_scenarios import measure_contract, runtime_engine
    from sglang_dsv41.reference.model import ReferenceModel

    monkeypatch.setenv(B.FP8_GEMM_ENV, fp8_gemm)
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
    assert engine.backend.fp8_gemm == fp8_gemm
    m = measure_contract(engine, DEVICE, reference, GREEDY_STEPS)
    print("\n" + m.summary(f"CUDA {fp8_gemm}"))
    assert m.top1 >= (FP8_MMA_MIN_TOP1_AGREEMENT if fp8_gemm == "fp8_mma" else MIN_TOP1_AGREEMENT)
    assert m.worst_logit_diff <= (FP8_MMA_LOGIT_BOUND if fp8_gemm == "fp8_mma" else LOGIT_BOUND), m.worst_logit_diff


@pytest.mark.gpu
@pytest.mark.parametrize("bf16_gemm", ["triton", "whole"])
def test_gpu_teacher_forced_contract_with_a_bf16_gemm_opt_in(tiny_checkpoint, bf16_gemm: str, monkeypatch) -> None:
    """The serving default with the BF16-weight products of an opt-in (SGLANG_DSV41_BF16_GEMM: `triton`, or
    `whole`, the default before session 35: docs/performance.md "Session 35") keeps the contract."""
    from runtime_scenarios import measure_contract, runtime_engine
    from sglang_dsv41.reference.model import ReferenceModel

    monkeypatch.setenv(B.BF16_GEMM_ENV, bf16_gemm)
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
    dense = engine.backend.dense
    assert dense.whole_rows and not dense.unpadded and dense.triton_rows == (bf16_gemm == "triton")
    m = measure_contract(engine, DEVICE, reference, GREEDY_STEPS)
    print("\n" + m.summary(f"CUDA {bf16_gemm} BF16 products"))
    assert m.top1 >= MIN_TOP1_AGREEMENT
    assert m.worst_logit_diff <= LOGIT_BOUND, m.worst_logit_diff


@pytest.mark.gpu
@pytest.mark.parametrize("prefill,head_sum", [(None, None), ("bf16", None), ("heads", None), (None, "fp64")],
                         ids=["default", "bf16", "heads", "fp64_head_sum"])
def test_gpu_teacher_forced_contract_with_the_prefill_opt_ins(tiny_checkpoint, monkeypatch, prefill,
                                                              head_sum) -> None:
    """The session-12 prefill opt-ins as the serving default, with no variable set: the BF16 workspace
    of decoded compressed entries (its size rule lowered to one query so every eager forward here
    takes it, launched with `plan_prefill_config`) and BF16-weight products in one GEMM keep the
    end-to-end contract — read by `kernels.sparse_attention_prefill` (`wide`, the default since session 33),
    and by `sparse_attention` (`bf16`, the default before), and by the heads layout (`heads`, opt-in, session 45).
    The same size rule puts every eager forward on
    the default's (`auto`) fp32 indexer head sum; `fp64_head_sum`: the exact head sum everywhere, the default
    before session 35 (docs/performance.md "Session 35")."""
    from runtime_scenarios import measure_contract, runtime_engine
    from sglang_dsv41.reference.model import ReferenceModel
    from sglang_dsv41.runtime import attention_ops
    from sglang_dsv41.runtime import attention_prefill as AP

    monkeypatch.delenv(AP.PREFILL_ENV, raising=False)
    if prefill is not None:
        monkeypatch.setenv(AP.PREFILL_ENV, prefill)
    monkeypatch.delenv(attention_ops.INDEXER_HEAD_SUM_ENV, raising=False)
    if head_sum is not None:
        monkeypatch.setenv(attention_ops.INDEXER_HEAD_SUM_ENV, head_sum)
    monkeypatch.delenv(B.BF16_GEMM_ENV, raising=False)
    monkeypatch.setattr(AP, "PREFILL_MIN_QUERIES", 1)
    attention_ops.kernel_ops.cache_clear()           # the kernel ops read their switches when made
    try:
        reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
        engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
        assert engine.attention_ops.prefill == (prefill or "wide") and engine.backend.dense.unpadded
        assert engine.attention_ops.head_sum == (head_sum or "auto")
        assert engine.attention_ops.head_sum_exact(1) == (head_sum == "fp64")
        m = measure_contract(engine, DEVICE, reference, GREEDY_STEPS)
    finally:
        attention_ops.kernel_ops.cache_clear()
    print("\n" + m.summary(f"CUDA w8a8_f16 + {prefill or 'wide'} prefill workspace on every batch, "
                           f"{head_sum or 'auto'} head sum"))
    assert m.top1 >= MIN_TOP1_AGREEMENT
    assert m.worst_logit_diff <= LOGIT_BOUND, m.worst_logit_diff


def _flashmla_contract(tiny_checkpoint, choice: str) -> None:
    """The teacher-forced contract with a FlashMLA opt-in planned (`choice` "prefill" or "decode", set by
    the caller's environment): the tiny model's 4 heads × 96 planned `padded` to 64 × 512 at start-up,
    every launch counted, held to the FlashMLA opt-in bar (P rounded to BF16: `flashmla_bound`)."""
    from runtime_scenarios import measure_contract, runtime_engine
    from sglang_dsv41.reference.model import ReferenceModel
    from sglang_dsv41.runtime import attention_ops

    attention_ops.kernel_ops.cache_clear()           # the kernel ops read their switches when made
    try:
        reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
        engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
        ops = engine.attention_ops
        assert getattr(ops, choice) == "flashmla" and ops.flashmla_plan.mode == "padded", ops.description
        launches = []
        kernel = ops.flashmla_kernel

        def counted(q, *args):
            launches.append(q.shape[0])
            return kernel(q, *args)
        ops.flashmla_kernel = counted
        m = measure_contract(engine, DEVICE, reference, GREEDY_STEPS)
    finally:
        attention_ops.kernel_ops.cache_clear()
    print("\n" + m.summary(f"CUDA w8a8_f16 + FlashMLA {choice} ({len(launches)} launches)"))
    assert launches, f"no batch took the FlashMLA {choice}"
    assert m.top1 >= FLASHMLA_MIN_TOP1_AGREEMENT
    assert m.worst_logit_diff <= LOGIT_BOUND, m.worst_logit_diff


@pytest.mark.gpu
def test_gpu_teacher_forced_contract_with_the_flashmla_prefill(tiny_checkpoint, monkeypatch) -> None:
    """SGLANG_DSV41_ATTN_PREFILL=flashmla (`runtime/attention_flashmla.py`): every eager batch with a
    compressed layer takes the workspace (size rule lowered to one query) and its attention is ONE
    `flash_mla_sparse_fwd` launch; the end-to-end contract holds at the opt-in bar."""
    from sglang_dsv41.runtime import attention_prefill as AP

    monkeypatch.setenv(AP.PREFILL_ENV, "flashmla")
    monkeypatch.setattr(AP, "PREFILL_MIN_QUERIES", 1)
    _flashmla_contract(tiny_checkpoint, "prefill")


@pytest.mark.gpu
def test_gpu_teacher_forced_contract_with_the_flashmla_decode(tiny_checkpoint, monkeypatch) -> None:
    """SGLANG_DSV41_ATTN_DECODE=flashmla (`attention_flashmla.decode_attend`): every batch without the
    prefill workspace runs its attention as ONE `flash_mla_sparse_fwd` launch over the gathered keys
    (`kernels.key_gather`); the end-to-end contract holds at the opt-in bar."""
    from sglang_dsv41.runtime import attention_ops

    monkeypatch.setenv(attention_ops.ATTENTION_DECODE_ENV, "flashmla")
    _flashmla_contract(tiny_checkpoint, "decode")


@pytest.mark.gpu
def test_gpu_teacher_forced_contract_with_the_wide_decode(tiny_checkpoint, monkeypatch) -> None:
    """SGLANG_DSV41_ATTN_DECODE=wide: every batch without the prefill workspace runs the `wide` kernel over
    BF16 rows with its key tiles split (`sparse_attention_prefill.plan_decode`; every launch counted, one
    with more than one split at least); the end-to-end contract holds at the serving bar."""
    from runtime_scenarios import measure_contract, runtime_engine
    from sglang_dsv41.reference.model import ReferenceModel
    from sglang_dsv41.runtime import attention_ops

    monkeypatch.setenv(attention_ops.ATTENTION_DECODE_ENV, "wide")
    attention_ops.kernel_ops.cache_clear()           # the kernel ops read their switches when made
    try:
        reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
        engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
        ops = engine.attention_ops
        assert ops.decode == "wide", ops.description
        wide = ops._wide_kernel()
        splits: list[int] = []

        class Counted:
            plan_decode = staticmethod(wide.plan_decode)

            @staticmethod
            def prefill_sink_attention(*args, config=None, **kwargs):
                splits.append(config.num_splits if config is not None else 0)
                return wide.prefill_sink_attention(*args, config=config, **kwargs)
        ops._wide = Counted
        m = measure_contract(engine, DEVICE, reference, GREEDY_STEPS)
    finally:
        attention_ops.kernel_ops.cache_clear()
    print("\n" + m.summary(f"CUDA w8a8_f16 + wide decode ({len(splits)} launches, splits {sorted(set(splits))})"))
    assert splits and max(splits) > 1, splits
    assert m.top1 >= MIN_TOP1_AGREEMENT
    assert m.worst_logit_diff <= LOGIT_BOUND, m.worst_logit_diff
