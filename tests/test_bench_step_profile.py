"""benchmarks/step_profile.py on CPU: labels from a real (CPU) profiler trace, kernel attribution
through CUPTI correlation ids, graph-replay grouping, alignment and the component roll-up on
synthetic traces (the GPU pass runs from scripts/gpu/speed4.sh)."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmark_loader import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def sp():
    sys.path.insert(0, str(BENCHMARKS))
    return load_benchmark("step_profile.py")


class _Backend:
    def linear_fp8(self, x, weight, act_quant=True):
        return self.bf16(x @ weight.t())

    def bf16(self, x):
        return x.to(torch.bfloat16).float()

    def rms_norm(self, x, weight, eps, round_bf16=True):
        return x * weight


def test_labels_follow_the_runtime_calls_and_are_restored(sp) -> None:
    w = {"layers.2.attn.wq_a.weight": torch.ones(4, 4), "layers.2.attn_norm.weight": torch.ones(4)}
    names = sp.weight_names(w, 2)
    assert sorted(names.values()) == ["attn.wq_a", "attn_norm"]
    be = _Backend()
    module = SimpleNamespace(route=lambda x: x + 1)
    with sp.labels_on(be, names, module):
        trace = sp._trace_of(lambda: (be.linear_fp8(torch.ones(2, 4), w["layers.2.attn.wq_a.weight"]),
                                      be.rms_norm(torch.ones(4), w["layers.2.attn_norm.weight"], 1e-6),
                                      module.route(torch.ones(1))))
    assert "linear_fp8" not in vars(be) and "bf16" not in vars(be) and module.route(1) == 2
    ranges = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    got = {e["name"] for e in ranges}
    assert {"dsv41:linear:attn.wq_a", "dsv41:elementwise:bf16", "dsv41:norm", "dsv41:router"} <= got
    bf16 = next(e for e in ranges if e["name"] == "dsv41:elementwise:bf16")
    assert sp.label_at(ranges, bf16["tid"], bf16["ts"] + bf16["dur"] / 2) == "linear:attn.wq_a"   # linear dominates
    norm = next(e for e in ranges if e["name"] == "dsv41:norm")
    assert sp.label_at(ranges, norm["tid"], norm["ts"]) == "norm"
    assert sp.label_at(ranges, norm["tid"], -1.0) == "unlabelled"


def _ev(cat, name, ts, dur, corr=None, tid=1):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args={} if corr is None else {"correlation": corr})


def test_attribution_replays_alignment_and_components(sp) -> None:
    eager_trace = {"traceEvents": [
        _ev("user_annotation", "dsv41:part:torch", 0, 100), _ev("user_annotation", "dsv41:mhc", 1, 9),
        _ev("user_annotation", "dsv41:linear:attn.wq_a", 10, 20), _ev("user_annotation", "dsv41:part:attention", 100, 50),
        _ev("cuda_driver", "cuLaunchKernel", 2, 1, corr=1), _ev("cuda_runtime", "cudaLaunchKernel", 12, 1, corr=2),
        _ev("cuda_runtime", "cudaLaunchKernel", 40, 1, corr=3), _ev("cuda_driver", "cuLaunchKernel", 110, 1, corr=4),
        _ev("kernel", "mhc_k", 1000, 5, corr=1), _ev("kernel", "gemm", 1010, 30, corr=2),
        _ev("kernel", "glue", 1050, 2, corr=3), _ev("kernel", "attn", 1060, 40, corr=4)]}
    eager = sp.labelled_kernels(eager_trace)
    assert [lab for _, lab, _ in eager] == ["mhc", "linear:attn.wq_a", "part:torch", "part:attention"]
    graph_trace = {"traceEvents": [
        _ev("cuda_runtime", "cudaGraphLaunch", 0, 1, corr=10), _ev("cuda_runtime", "cudaLaunchKernel", 5, 1, corr=11),
        _ev("cuda_runtime", "cudaGraphLaunch", 50, 1, corr=12),
        *[_ev("kernel", n, t0 + t, d, corr=c) for c, t0 in ((10, 0), (12, 500))
          for n, t, d in (("mhc_k", 0, 4), ("gemm", 6, 20), ("glue", 30, 2), ("attn", 34, 30), ("new_k", 70, 2))],
        _ev("kernel", "flush", 200, 50, corr=11)]}
    replays = sp.graph_replays(graph_trace)
    assert [len(r) for r in replays] == [5, 5] and all(e["name"] != "flush" for r in replays for e in r)
    assert sp.busy_span(replays[0]) == (58.0, 72.0)
    s = sp.summarise(eager, replays, fp8_linears=["attn.wq_a"])
    comp = s["by_component"]
    assert comp["dense_fp8"] == 20 and comp["mhc"] == 4 and comp["attention"] == 30 and comp["torch_glue"] == 2
    assert comp["unattributed"] == 2 and comp["launch_gaps"] == pytest.approx(14.0)
    assert s["by_linear"] == {"attn.wq_a": 20} and s["matched_fraction"] == pytest.approx(0.8)
    assert s["eager_device_us"]["part:attention"] == 40 and s["eager_launches"] == 4
    assert s["kernels_by_component"] == {"dense_fp8": 1, "attention": 1, "mhc": 1, "torch_glue": 1, "unattributed": 1}
    assert s["kernels"][:2] == [("mhc_k", "mhc", 4.0), ("gemm", "linear:attn.wq_a", 20.0)] and len(s["kernels"]) == 5


def test_component_names(sp) -> None:
    assert sp.component("linear:ffn.shared_experts.w1", ["ffn.shared_experts.w1"]) == "shared_expert"
    assert sp.component("linear:attn.compressor.wkv", ["attn.wq_a"]) == "dense_bf16"
    assert sp.component("indexer_query") == "indexer" and sp.component("glue:out_proj") == "torch_glue"
    assert sp.component("elementwise:fp8_act_fake_quant") == "elementwise" and sp.component("weird") == "unattributed"
    assert set(sp.COMPONENT_OF[i][1] for i in range(len(sp.COMPONENT_OF))) <= set(sp.COMPONENTS)


def test_prefill_profile_attribution_and_variants(sp, monkeypatch) -> None:
    """benchmarks/prefill_profile.py on CPU: kernels of the indexer / routed-expert parts split by
    name, linears by GEMM and operand passes, medians over passes; a variant's switches are set for
    its duration (all of them) and restored; `before`'s two-launch RoPE gives the fused call's values."""
    pp = load_benchmark("prefill_profile.py")
    assert pp.prefill_component("part:indexer", "_index_scores_kernel") == "indexer_scores"
    assert pp.prefill_component("part:indexer", "_topk_rows_kernel") == "indexer_topk"
    assert pp.prefill_component("part:moe_routed", "_p_matmul_ogs_x") == "moe_experts"
    assert pp.prefill_component("part:moe_routed", "_combine_kernel") == "moe_combine"
    assert pp.prefill_component("part:moe_routed", "radix_sort") == "moe_routing"
    for gemm1 in ("clamped_swiglu_tile", "_matmul_ogs_NNT_bf16xbf16xmxfp4_128x256x128x1_dsv41_clamped_swiglu"):
        assert pp.prefill_component("part:moe_routed", gemm1) == "moe_experts"       # GEMM1, old and new name
    assert pp.prefill_component("linear:attn.indexer.wq_b", "g") == "indexer_query"
    assert pp.prefill_component("linear:attn.compressor.wgate", "g") == "compressor"
    assert pp.prefill_component("linear:attn.wo_b", "g", ["attn.wo_b"]) == "dense_fp8"
    assert pp.prefill_component("elementwise:bf16_rope_tail", "k") == "rope"
    assert pp.prefill_component("indexer_query", "k") == "indexer_query"
    passes = [[("gemm_a", "linear:attn.wo_b", 10.0), ("_quantize_kernel", "linear:attn.wo_b", 2.0),
               ("_index_scores_kernel", "part:indexer", 5.0), ("sort", "part:indexer", 1.0), ("x", "mhc", 3.0)],
              [("gemm_a", "linear:attn.wo_b", 12.0), ("_quantize_kernel", "linear:attn.wo_b", 2.0),
               ("_index_scores_kernel", "part:indexer", 7.0), ("sort", "part:indexer", 1.0)],
              [("gemm_a", "linear:attn.wo_b", 11.0), ("_quantize_kernel", "linear:attn.wo_b", 4.0),
               ("_index_scores_kernel", "part:indexer", 6.0), ("sort", "part:indexer", 1.0), ("x", "mhc", 5.0)]]
    s = pp.summarise_passes(passes, [(30.0, 40.0), (20.0, 22.0), (25.0, 35.0)], ["attn.wo_b"], top=2)
    assert s["by_component"] == dict(dense_fp8=14.0, indexer_scores=6.0, indexer_topk=1.0, mhc=3.0)
    assert s["by_linear"] == {"attn.wo_b": dict(gemm=11.0, operands=2.0, total=13.0)}
    assert (s["busy_us"], s["span_us"], s["gaps_us"]) == (25.0, 35.0, 10.0) and s["kernels_per_pass"] == [5, 4, 5]
    assert [k["kernel"] for k in s["top_kernels"]] == ["gemm_a", "_index_scores_kernel"]
    monkeypatch.setenv("SGLANG_DSV41_INDEXER_TOPK", "fused")
    monkeypatch.delenv("SGLANG_DSV41_ATTN_PREFILL", raising=False)
    be = SimpleNamespace(rope=SimpleNamespace(apply_rope_tail=lambda x, p, f, inverse=False, round_bf16=False:
                                              x + 1 if not round_bf16 else torch.round(x + 1)),
                         fe=SimpleNamespace(round_bf16=torch.round),
                         dense=SimpleNamespace(whole_rows=False, unpadded=False))
    with pp.variant_scope("before", be):               # session 11: two-launch RoPE, packed, torch top-k, blocked
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.OLD and not be.dense.whole_rows and not be.dense.unpadded
        assert torch.equal(be.rope.apply_rope_tail(torch.tensor([0.25]), None, None, round_bf16=True),
                           torch.tensor([1.0]))
        held = be.rope.apply_rope_tail(torch.tensor([1.75]), None, None, round_bf16=True, out_dtype=torch.bfloat16,
                                       round_input=True)          # the runtime's later keywords, as extra launches
        assert held.dtype == torch.bfloat16 and float(held) == 3.0
    assert not isinstance(be.rope, pp.TwoPassRope) and os.environ["SGLANG_DSV41_INDEXER_TOPK"] == "fused"
    assert "SGLANG_DSV41_ATTN_PREFILL" not in os.environ
    with pp.variant_scope("default", be):              # the CUDA serving defaults: workspace, `direct` rows
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.SWITCHES and be.dense.whole_rows and be.dense.unpadded
        assert pp.SWITCHES["SGLANG_DSV41_INDEXER_HEAD_SUM"] == "auto"
    with pp.variant_scope("session34", be):            # the defaults before session 35: the fp64 head sum
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.SWITCHES | {"SGLANG_DSV41_INDEXER_HEAD_SUM": "fp64"}
        assert pp.SWITCHES["SGLANG_DSV41_ATTN_PREFILL"] == "wide" and not isinstance(be.rope, pp.TwoPassRope)
        assert pp.SWITCHES["SGLANG_DSV41_MHC_MIX"] == "tc"
    with pp.variant_scope("session32", be):            # the defaults before session 33
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.SWITCHES | {"SGLANG_DSV41_ATTN_PREFILL": "bf16",
                                                                         "SGLANG_DSV41_INDEXER_PREFILL_KEYS": "packed"}
    with pp.variant_scope("session31", be):            # the defaults before session 32
        assert os.environ["SGLANG_DSV41_ATTN_PREFILL"] == "bf16" and os.environ["SGLANG_DSV41_MHC_MIX"] == "dot"
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.SWITCHES | {"SGLANG_DSV41_MHC_MIX": "dot",
                                                                         "SGLANG_DSV41_ATTN_PREFILL": "bf16",
                                                                         "SGLANG_DSV41_INDEXER_PREFILL_KEYS": "packed"}
    with pp.variant_scope("session12", be):
        assert os.environ["SGLANG_DSV41_ATTN_PREFILL"] == "packed" and not be.dense.whole_rows
    with pp.variant_scope("new", be):
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.NEW and be.dense.whole_rows
    with pp.variant_scope("whole_bf16_rows", be):
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.OLD and be.dense.whole_rows
    assert not be.dense.whole_rows and not be.dense.unpadded and "SGLANG_DSV41_ATTN_PREFILL" not in os.environ
    assert pp.OLD["SGLANG_DSV41_MHC_MIX"] == "rows" == pp.VARIANTS["session12"][0]["SGLANG_DSV41_MHC_MIX"]
    from sglang_dsv41.kernels import moe_mxfp4 as mx
    monkeypatch.delenv(mx.PREFILL_FLAGS_ENV, raising=False)
    mx.prefill_flags.cache_clear()
    with pp.variant_scope("new_moe_block_m64", be):              # the experts' flags are re-read per variant
        assert mx.launch_flags(8192) == {"block_m": 64} and mx.launch_flags(16) == mx.decode_flags()
        assert os.environ["SGLANG_DSV41_MHC_MIX"] == "tc"
    assert mx.launch_flags(8192) == {} and mx.PREFILL_FLAGS_ENV not in os.environ
    with pp.variant_scope("new_mhc_rows", be):
        assert os.environ["SGLANG_DSV41_MHC_MIX"] == "rows" and be.dense.whole_rows
    with pp.variant_scope("flashmla", be):                       # the serving default, FlashMLA prefill attention
        assert {k: os.environ[k] for k in pp.SWITCHES} == pp.SWITCHES | {"SGLANG_DSV41_ATTN_PREFILL": "flashmla"}
        assert be.dense.whole_rows
    assert "SGLANG_DSV41_ATTN_PREFILL" not in os.environ
    assert set(pp.DEFAULT_VARIANTS) <= set(pp.VARIANTS)


def test_fp32_residual_variant_holds_the_cuda_mhc_streams_in_fp32_and_restores() -> None:
    """`fp32_residual`: within the scope the CUDA mHC holds R as fp32 (`TritonMhc.residual_dtype`, read by
    `flash_layer.step_components` and the forward); BF16 again after, also when the scope raises."""
    from sglang_dsv41.runtime import mhc_ops
    pp = load_benchmark("prefill_profile.py")
    be = SimpleNamespace()
    assert mhc_ops.TritonMhc.residual_dtype == torch.bfloat16
    with pp.variant_scope("fp32_residual", be):
        assert mhc_ops.TritonMhc.residual_dtype == torch.float32
        assert mhc_ops.TritonMhc().streams(torch.ones(2, 8), 4).dtype == torch.float32
    assert mhc_ops.TritonMhc.residual_dtype == torch.bfloat16
    with pytest.raises(RuntimeError), pp.variant_scope("fp32_residual", be):
        raise RuntimeError
    assert mhc_ops.TritonMhc.residual_dtype == torch.bfloat16


def test_fp32_activations_variant_drops_bf16_out_and_restores() -> None:
    """`fp32_activations` (session 26's A/B): within the scope the backend's `bf16_out` calls return what a
    `bf16_out=False` call returns, and the CUDA mHC writes its sublayer input as fp32; both restored after."""
    from sglang_dsv41.runtime import mhc_ops
    pp = load_benchmark("prefill_profile.py")

    class Backend:
        def linear_fp8(self, x, w, act_quant=True, bf16_out=False):
            return x.to(torch.bfloat16) if bf16_out else x

        def linear_bf16_grouped(self, x, w, groups, bf16_out=False):
            return self.linear_fp8(x, w, bf16_out=bf16_out)

        def bf16_rope_tail(self, x, positions, inv_freq, inverse=False, bf16_out=False):
            return self.linear_fp8(x, None, bf16_out=bf16_out)

    be, x = Backend(), torch.ones(2, 4)
    def hc_sublayer_input(r, p, w, e, out_dtype=torch.float32, quantised=False):
        return (r.to(out_dtype), r.to(torch.bfloat16)) if quantised else r.to(out_dtype)

    mhc = SimpleNamespace(k=SimpleNamespace(hc_sublayer_input=hc_sublayer_input))
    original, original_pair = mhc_ops.TritonMhc.sublayer_input, mhc_ops.TritonMhc.sublayer_inputs
    assert mhc_ops.TritonMhc.sublayer_input(mhc, x, None, None, 1e-6).dtype == torch.bfloat16   # the default
    pair = mhc_ops.TritonMhc.sublayer_inputs(mhc, x, None, None, 1e-6)
    assert [t.dtype for t in pair] == [torch.bfloat16] * 2
    with pp.variant_scope("fp32_activations", be):
        assert be.linear_fp8(x, None, True, bf16_out=True).dtype == torch.float32
        assert be.linear_bf16_grouped(x, None, 2, bf16_out=True).dtype == torch.float32
        assert be.bf16_rope_tail(x, None, None, inverse=True, bf16_out=True).dtype == torch.float32
        assert mhc_ops.TritonMhc.sublayer_input(mhc, x, None, None, 1e-6).dtype == torch.float32
        pair = mhc_ops.TritonMhc.sublayer_inputs(mhc, x, None, None, 1e-6)
        assert [t.dtype for t in pair] == [torch.float32, torch.bfloat16]       # the quantised copy stays BF16
    assert be.linear_fp8(x, None, bf16_out=True).dtype == torch.bfloat16
    assert be.bf16_rope_tail(x, None, None, bf16_out=True).dtype == torch.bfloat16
    assert mhc_ops.TritonMhc.sublayer_input is original and mhc_ops.TritonMhc.sublayer_inputs is original_pair


def test_variant_agreements(monkeypatch) -> None:
    kv = load_benchmark("kernel_variants.py")
    a = torch.tensor([[3, 1, 2, -1], [5, 6, -1, -1], [-1, -1, -1, -1]])
    b = torch.tensor([[1, 2, 4, -1], [6, 5, -1, -1], [-1, -1, -1, -1]])
    assert kv.selection_agreement(a, b) == pytest.approx((2 / 3 + 1 + 1) / 3)
    want = torch.tensor([1.0, 1.0, -3.0, 0.0]).to(torch.bfloat16)
    got = torch.tensor([1.0, 1.0078125, -3.0, 0.0]).to(torch.bfloat16)      # one ulp at 1.0 (2⁻⁷)
    assert kv.ulp_agreement(got, want) == dict(max_ulps=1.0, equal_fraction=0.75)
    o = torch.tensor([[[4.0, 0.5]]])                                     # scale 4: ulp 2⁻⁵
    assert kv.scale_ulp_agreement(o + torch.tensor([0.0, 2.0 ** -5]), o) == dict(max_scale_ulps=1.0,
                                                                               equal_fraction=0.5)
    monkeypatch.setenv("KERNEL_VARIANTS_MOE_FLAGS", "block_k=256; num_stages=4 ;")
    assert kv.moe_flag_sets() == ("block_k=256", "num_stages=4")
    monkeypatch.setenv("KERNEL_VARIANTS_MOE_FLAGS", "None")
    assert kv.moe_flag_sets() == ()
    monkeypatch.delenv("KERNEL_VARIANTS_MOE_FLAGS")
    assert kv.moe_flag_sets() == kv.MOE_FLAG_SETS
    assert all(kv.MOE_FLAG_SETS) and "moe_routed" in kv.summary_line(1, {"moe_routed": {"default": {"graph_us": 5.0}}})


def test_speed4_summary_reads_what_the_run_wrote_and_records_missing_files(tmp_path) -> None:
    import importlib.util
    path = BENCHMARKS.parent / "scripts" / "gpu" / "speed4_summary.py"
    spec = importlib.util.spec_from_file_location("speed4_summary", path)
    summ = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summ)
    (tmp_path / "gpu_tests.xml").write_text('<testsuite><testcase classname="a" name="ok"/>'
                                            '<testcase classname="a" name="bad"><failure/></testcase></testsuite>')
    (tmp_path / "decode_step_variants.json").write_text(json.dumps({"rows": {"1": {"attention": {
        "one_split": {"graph_us": 150.04}, "decode_splits": {"graph_us": 30.0, "max_ulps": 1.0},
        "decode_splits_h16": {"error": "x" * 500}}}}}))
    (tmp_path / "decode_step_profile_graph.json").write_text(json.dumps({"rows": [
        {"fp8_gemm": "tiered", "tokens": 1, "span_us": 800.0, "busy_us": 700.0, "gaps_us": 100.0, "graph_wall_us": 790.0,
         "kernels_per_replay": [190], "matched_fraction": 1.0, "by_component": {"dense_fp8": 300.0},
         "by_linear": {"attn.wq_b": 40.0}}, {"fp8_gemm": "w8a8_f16", "tokens": 1, "skipped": "over"}]}))
    assert summ.main([str(tmp_path), "1"]) == 0
    got = json.loads((tmp_path / "speed4.json").read_text())
    t = got["tests"]          # scripts/gpu/junit_verdict.py (tests/test_gpu_scripts.py)
    assert (t["total"], t["failed"], t["skipped"], t["rc"], t["pass"]) == (2, ["a::bad"], 0, 1, False)
    assert "FileNotFoundError" in got["decode"]["error"]
    att = got["variants"]["1"]["attention"]
    assert att["one_split"] == {"graph_us": 150.04} and len(att["decode_splits_h16"]["error"]) == 300
    assert got["profile"][0]["components"] == {"dense_fp8": 300.0} and got["profile"][0]["kernels"] == 190
    assert got["profile"][1] == {"fp8_gemm": "w8a8_f16", "N": 1, "skipped": "over"}


def test_prefill_selection_agreement_is_the_set_overlap() -> None:
    pp = load_benchmark("prefill_profile.py")
    a = torch.tensor([[3, 1, 2, -1], [5, 6, -1, -1], [-1, -1, -1, -1]])
    b = torch.tensor([[1, 2, 4, -1], [6, 5, -1, -1], [-1, -1, -1, -1]])
    assert pp.selection_agreement(a, b) == pytest.approx((2 / 3 + 1 + 1) / 3)
    assert pp.selection_agreement(b[2:], a[:1]) == 0.0
    got = pp.agreement({"indexer": a}, {"indexer": a.clone()})
    assert got == {"indexer": dict(selection_overlap=1.0, equal=True)}


def test_speed5_summary_checks_and_missing_files(tmp_path) -> None:
    import importlib.util
    path = BENCHMARKS.parent / "scripts" / "gpu" / "speed5_summary.py"
    spec = importlib.util.spec_from_file_location("speed5_summary", path)
    summ = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summ)
    assert summ.main([str(tmp_path)]) == 0                  # nothing written: errors recorded, all checks false
    got = json.loads((tmp_path / "speed5.json").read_text())
    assert "FileNotFoundError" in got["prefill"]["error"] and not any(got["checks"].values())
    (tmp_path / "gpu_tests.xml").write_text('<testsuite><properties><property name="collected" value="1"/></properties>'
                                            '<testcase classname="a" name="ok"/></testsuite>')
    row = lambda name, agreement: dict(variant=name, tokens_per_s=1e5, wall_us_total=8e4,   # noqa: E731
                                       wall_us={"torch": 5e4, "attention": 3e4}, device_us=7e4, gaps_us=1e3,
                                       by_component={"attention": 3e4, "dense_fp8": 4e4},
                                       by_linear={"attn.wo_b": dict(gemm=900.0, operands=100.0, total=1e3)},
                                       top_kernels=[dict(kernel="k", label="part:attention", us=3e4, count=1)],
                                       agreement=agreement, agreement_with="before")
    rows = [row("before", {}), row("attn_bf16_workspace", {"attention": dict(max_scale_ulps=1.0)}),
            row("indexer_fused_topk", {"indexer": dict(selection_overlap=1.0, equal=True)}),
            row("indexer_fp32_head_sum", {"indexer": dict(selection_overlap=0.995, equal=False)}),
            dict(variant="new", error="boom")]
    sweep = {"plan": dict(us=900.4, config=dict(block_h=32, block_n=32, num_warps=8, num_stages=2, block_d=512),
                          agreement_with_plan=dict(max_scale_ulps=0.0)), "block_n64_s1": dict(error="smem")}
    (tmp_path / "prefill_profile.json").write_text(json.dumps(dict(tokens=8192, layer=2, rows=rows,
                                                                   attention_sweep=sweep)))
    summ.main([str(tmp_path)])                              # pytest's rc unknown: never a pass
    assert json.loads((tmp_path / "speed5.json").read_text())["checks"]["gpu_tests_pass"] is False
    summ.main([str(tmp_path), "0"])
    got = json.loads((tmp_path / "speed5.json").read_text())
    assert got["checks"] == dict(gpu_tests_pass=True, every_variant_profiled=False, workspace_attention_within_bound=True,
                                 fused_topk_same_selection=True, fp32_head_sum_overlap=True)
    before = got["prefill"]["rows"][0]
    assert before["components_ms"] == {"dense_fp8": 40.0, "attention": 30.0} and before["wall_ms"] == 80.0
    assert before["linears_ms"]["attn.wo_b"] == dict(gemm=0.9, operands=0.1, total=1.0)
    assert got["prefill"]["attention_sweep"]["plan"]["us"] == 900 and "block_d" not in got["prefill"][
        "attention_sweep"]["plan"]["config"] and got["prefill"]["attention_sweep"]["block_n64_s1"] == dict(error="smem")
