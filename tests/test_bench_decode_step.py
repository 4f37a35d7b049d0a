"""`benchmarks/decode_step.py` logic on CPU shapes (tiny config; no timing assertions).

The layer generator writes every stored tensor of the layer in the checkpoint's formats (checked
against the inventory independently here); the loaded layer holds the reference loader's values;
the packed caches hold, at every entry index of the layer's kv source, entries that decode
(through `kv_layout`'s independent reader) to the BF16 copies, and nothing outside the source's
columns; the byte accounting matches the inventory and the kernels' own per-query byte formulas
(288 B latent / 68 B key per packed entry at Flash); one decode point (N = 1, 3) runs the torch
work, the routed experts and the eager whole step on CPU and yields a well-formed row; the
routed term equals the reference MoE's; the CUDA-graph fallback (capture alone, exclude, graph
the rest) is exercised with a stand-in capture; without CUDA the script refuses to run.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmark_loader import load_benchmark
from reference_weights import tiny_config

from sglang_dsv41.checkpoint.loader import logical_tensor, stored_problem
from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.kernels.indexer import score_bytes_per_query
from sglang_dsv41.kernels.sparse_attention import bytes_read_per_query
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.reference import moe as ref_moe
from sglang_dsv41.reference.ops import bf16
from sglang_dsv41.runtime.kv_layout import CompressedRowLayout, PackedSourceRows
from sglang_dsv41.runtime.parallel_linear import is_model_linear



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_step.py")


@pytest.fixture(scope="module")
def setup(bench):
    cfg = tiny_config(vision=False)
    roles = cfg.text.layer_roles()
    layer = next(r.layer for r in roles if r.runs_indexer and r.computes_latents and not r.engram)
    return cfg, layer, bench.build_layer(cfg, layer, torch.device("cpu"), seed=0)


def test_stored_layer_is_in_the_checkpoint_formats(bench, setup) -> None:
    cfg, layer, _ = setup
    stored = bench.stored_layer(cfg, layer, torch.device("cpu"), seed=0)
    specs = [s for s in tensor_inventory(cfg, vision=False, dspark=False) if s.name.startswith(f"layers.{layer}.")]
    want = {st.name: st for s in specs for st in s.stored()}
    assert stored.keys() == want.keys()
    for name, st in want.items():
        assert stored_problem(st, stored[name].dtype, tuple(stored[name].shape)) is None
    kinds = {s.kind for s in specs}
    assert {Kind.FP8, Kind.FP4, Kind.BF16, Kind.FP32} <= kinds
    for s in specs:
        if s.kind is Kind.FP8:
            assert stored[s.name].dtype == torch.float8_e4m3fn
        if s.kind is Kind.FP4:
            assert stored[s.name].dtype == torch.uint8 and stored[s.scale_name].dtype == torch.float8_e8m0fnu
        assert torch.isfinite(logical_tensor(s, stored.__getitem__)).all()


def test_built_layer_values_and_bytes(bench, setup) -> None:
    cfg, layer, built = setup
    stored = bench.stored_layer(cfg, layer, torch.device("cpu"), seed=0)
    specs = [s for s in tensor_inventory(cfg, vision=False, dspark=False) if s.name.startswith(f"layers.{layer}.")]
    tensors = {k for k, v in built.weights.items() if isinstance(v, torch.Tensor)}
    assert tensors == {s.name for s in specs}                      # CPU: experts dequantised too
    linears = {k: v for k, v in built.weights.items() if k not in tensors}   # the runtime's layers, same storage
    assert linears.keys() == {s.name.removesuffix(".weight") for s in specs if is_model_linear(s)}
    assert all(m.weight.data_ptr() == built.weights[k + ".weight"].data_ptr() for k, m in linears.items())
    for s in specs:
        assert torch.equal(built.weights[s.name], logical_tensor(s, stored.__getitem__).float())
    per_group: dict[str, int] = {}
    for s in specs:
        per_group[s.group] = per_group.get(s.group, 0) + sum(st.nbytes for st in s.stored())
    assert built.stored_bytes == per_group
    one_expert = [s for s in specs if ".ffn.experts.0." in s.name]
    assert built.expert_bytes == sum(st.nbytes for s in one_expert for st in s.stored())
    dense_fp32 = sum(4 * s.numel for s in specs if s.kind is not Kind.FP4)
    assert built.held_dense_bytes == dense_fp32


def test_step_bytes(bench, setup) -> None:
    _, _, built = setup
    t = built.text
    N, n = 3, 10
    b = bench.step_bytes(built, N, n_visible=n, distinct_experts=5)
    assert b["moe_routed"] == dict(current=5 * built.expert_bytes, design=5 * built.expert_bytes)
    k = min(t.index_topk, n)
    attention = dict(num_heads=t.num_attention_heads, head_dim=t.head_dim, window=t.sliding_window,
                     topk=t.index_topk, valid_keys=t.sliding_window + k, slot_bytes=8, valid_comp_keys=k)
    assert b["attention"]["current"] == N * bytes_read_per_query(**attention, packed_comp=True)
    assert b["attention_bf16"]["current"] == N * bytes_read_per_query(**attention, packed_comp=False)
    assert b["attention_flashmla"] == b["attention_gather"] == b["attention"]      # the decode opt-ins' bytes
    scores = dict(n_visible=n, num_entries=n, hi=t.index_n_heads, di=t.index_head_dim, slot_bytes=8, q_bytes=4)
    assert b["indexer"]["current"] == N * score_bytes_per_query(**scores, packed_keys=True)
    assert b["indexer_bf16"]["current"] == N * score_bytes_per_query(**scores, packed_keys=False)
    assert b["indexer"]["design"] == b["indexer"]["current"]                 # packed keys are the design
    for c in ("attention", "attention_bf16", "indexer_bf16", "torch"):
        assert b[c]["design"] < b[c]["current"]


def test_step_bytes_flash_packed_entry_sizes(bench) -> None:
    """At Flash a packed latent costs 288 B instead of 1024, a packed key 68 B instead of 256."""
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    t = cfg.text
    layer = bench.Layer(cfg, t.layer_roles()[2], {}, {"dense": 1}, 4, 0, torch.zeros(1))
    N, n = 4, 4096
    b = bench.step_bytes(layer, N, n_visible=n, distinct_experts=1)
    assert b["attention_bf16"]["current"] - b["attention"]["current"] == N * t.index_topk * (1024 - 288)
    assert b["indexer_bf16"]["current"] - b["indexer"]["current"] == N * n * (256 - 68)


@pytest.mark.parametrize("ratio", [1, 2])
def test_packed_caches(bench, setup, ratio: int) -> None:
    cfg, _, built = setup
    if built.role.ratio != ratio:      # make_caches reads only the config and the role
        role = next(r for r in cfg.text.layer_roles() if r.ratio == ratio and r.computes_latents)
        built = bench.Layer(cfg, role, {}, {}, 0, 0, torch.zeros(1))
    requests, C = 2, 16
    caches = bench.make_caches(built, requests, C, torch.device("cpu"), bf16_copies=True)
    layout = CompressedRowLayout.from_config(cfg.text)
    src = layout.source(built.role.kv_source)
    r, S = src.ratio, requests * C
    assert caches.swa.shape == (S, cfg.text.head_dim) and caches.swa.dtype == torch.bfloat16
    lat, key = caches.packed_latents, caches.packed_keys
    assert lat.rows.shape == (S, layout.latent_row_stride) and key.rows.shape == (S, layout.key_row_stride)
    assert lat.rows.dtype == key.rows.dtype == torch.uint8 and (lat.part, key.part) == ("latent", "key")
    assert (lat.offset, lat.share, lat.ratio) == (src.latent.offset, src.latent.share, r)
    assert (key.offset, key.share, key.ratio) == (src.key.offset, src.key.share, r)
    for packed, cols in ((lat, src.latent), (key, src.key)):
        outside = torch.ones(packed.rows.shape[1], dtype=torch.bool)
        outside[cols.offset: cols.offset + cols.share] = False
        assert not packed.rows[:, outside].any()                           # other sources untouched
    reader = PackedSourceRows(lat.rows, key.rows, src, layout)
    e = torch.arange(S // r)
    slot = e * r + r - 1
    assert torch.equal(reader.latents(e), caches.latents[slot].float())
    assert torch.equal(reader.keys(e), caches.keys[slot].float())
    assert reader.latents(e).abs().amax(dim=1).min() > 0                  # every entry was written
    assert not caches.latents[(torch.arange(S) % r) != r - 1].any()       # copies only at completing slots
    plain = bench.make_caches(built, requests, C, torch.device("cpu"))
    assert plain.latents is None and plain.keys is None
    assert torch.equal(plain.packed_latents.rows, lat.rows) and torch.equal(plain.packed_keys.rows, key.rows)
    if r > 1:
        with pytest.raises(ValueError, match="multiple of the compress ratio"):
            bench.make_caches(built, 1, 2 * r + 1, torch.device("cpu"))


@pytest.mark.parametrize("N", [1, 3])
def test_decode_point_on_cpu(bench, setup, N: int) -> None:
    cfg, layer, built = setup
    caches = bench.make_caches(built, N, 16, torch.device("cpu"))
    errors: list[str] = []
    pos = torch.full((N,), 15, dtype=torch.long)
    row = bench.run_point(built, caches, torch.arange(N), pos, cap_s=0.01, copy_gbs=None, errors=errors)
    assert errors == []
    assert row["tokens"] == N and row["visible_entries"] == 16 // built.role.ratio
    for c in ("torch", "moe_routed"):
        assert row[c]["median_us"] > 0 and row[c]["reps"] >= 1 and set(row[c]["bytes"]) == {"current", "design"}
    assert "attention" not in row and "indexer" not in row           # Triton kernels: CUDA only
    assert row["layer_us_sum"] == row["torch"]["median_us"] + row["moe_routed"]["median_us"]
    assert row["eager"]["parts"] == ["torch", "moe_routed"] and row["layer_us_eager"] == row["eager"]["median_us"] > 0
    assert row["eager"]["bytes"]["current"] == row["torch"]["bytes"]["current"] + row["moe_routed"]["bytes"]["current"]
    assert row["layer_us_graph"] is None and "CUDA" in row["graph"]["skipped"] and row["graph_excluded"] == {}
    assert bench.decode_row_problems(row) == []
    json.dumps(row)                                                   # the JSON document holds rows as they are
    queries = bench.queries(built, caches, torch.arange(N), pos)
    W = cfg.text.sliding_window
    assert torch.equal(queries["swa_slots"][-1], torch.where(torch.arange(16 - W, 16) >= 0,
                                                             (N - 1) * 16 + torch.arange(16 - W, 16), -1))


def test_wall_budget_skips_parts(bench, setup) -> None:
    _, _, built = setup
    caches = bench.make_caches(built, 1, 16, torch.device("cpu"))
    errors: list[str] = []
    skipped: list[str] = []
    row = bench.run_point(built, caches, torch.arange(1), torch.tensor([15]), cap_s=0.01, copy_gbs=None,
                          errors=errors, skipped=skipped, deadline=0.0)
    assert errors == [] and skipped == ["N=1 torch", "N=1 moe_routed"]
    assert row["torch"] == dict(skipped=bench.BUDGET_NOTE) and row["layer_us_sum"] == 0
    assert row["layer_us_eager"] is None and row["eager"] == dict(skipped="no component of the step ran")
    assert bench.decode_row_problems(row) == []


def test_decode_row_problems_finds_malformed_rows(bench) -> None:
    good = dict(tokens=1, distinct_experts=1, visible_entries=1, layer_us_sum=1.0,
                eager=dict(parts=["torch"], median_us=2.0, reps=1, bytes={}), graph=dict(error="x"),
                layer_us_eager=2.0, layer_us_graph=None, graph_excluded={})
    assert bench.decode_row_problems(good) == []
    assert bench.decode_row_problems(bench.failed_row(8, "RuntimeError: x")) == []
    assert bench.decode_row_problems({k: v for k, v in good.items() if k != "layer_us_graph"}) == [
        "missing key layer_us_graph"]
    assert bench.decode_row_problems(good | dict(layer_us_eager=3.0)) == ["layer_us_eager is not eager.median_us"]
    assert bench.decode_row_problems(good | dict(torch=dict(median_us=1.0))) == ["torch: timing without reps/bytes"]
    bad_graph = good | dict(graph=dict(median_us=1.0, reps=1, bytes={}, parts=["a"], excluded={"a": "e"}),
                            layer_us_graph=1.0)
    assert bench.decode_row_problems(bad_graph) == ["a part is both graphed and excluded"]


def test_graph_fallback_excludes_parts_that_cannot_be_captured(bench, monkeypatch) -> None:
    """`graph_of` on CPU with a stand-in capture that fails whenever part "b" is inside."""
    calls: list[list[str]] = []
    parts = {name: (lambda name=name: name) for name in ("a", "b", "c")}

    def capture(fns, warmup_calls=bench.GRAPH_WARMUP_CALLS):
        names = [fn() for fn in fns]
        calls.append(names)
        if "b" in names:
            raise RuntimeError("operation not permitted when stream is capturing")
        return ("graph", tuple(names))
    timing = sys.modules[bench.graph_of.__module__]      # graph_of looks the capture up in step_timing.py
    monkeypatch.setattr(timing, "capture_graph", capture)
    monkeypatch.setattr(timing, "settle_after_failed_capture", lambda: None)
    graph, excluded = bench.graph_of(parts)
    assert graph == ("graph", ("a", "c")) and list(excluded) == ["b"]
    assert "RuntimeError: operation not permitted" in excluded["b"]
    assert calls == [["a", "b", "c"], ["a"], ["b"], ["c"], ["a", "c"]]
    assert bench.graph_of({"a": parts["a"], "c": parts["c"]}) == (("graph", ("a", "c")), {})
    with pytest.raises(RuntimeError, match="no part of the step can be captured"):
        bench.graph_of({"b": parts["b"]})

    def only_alone(fns, warmup_calls=bench.GRAPH_WARMUP_CALLS):
        if len(fns) > 1:
            raise RuntimeError("out of memory")
        return "graph"
    monkeypatch.setattr(timing, "capture_graph", only_alone)
    with pytest.raises(RuntimeError, match="captures alone but the whole step does not: RuntimeError: out of memory"):
        bench.graph_of(parts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_capture_refuses_without_cuda(bench) -> None:
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        bench.capture_graph([lambda: None])


def test_routed_component_is_the_reference_routed_term(bench, setup) -> None:
    cfg, layer, built = setup
    t, w, p = cfg.text, built.weights, f"layers.{layer}."
    x = bf16(torch.randn(5, t.hidden_size, generator=torch.Generator().manual_seed(4)))
    routing = ref_moe.route(x, w[p + "ffn.gate.weight"], w[p + "ffn.gate.bias"], t.num_experts_per_tok)
    routed = bench.moe_routed(built, x, routing)
    shared = ref_moe.shared_expert(x, w[p + "ffn.shared_experts.w1.weight"], w[p + "ffn.shared_experts.w2.weight"],
                                   w[p + "ffn.shared_experts.w3.weight"], t.swiglu_limit, True)
    want = ref_moe.moe_sublayer(t, w, p, x, image_rows=None, act_quant=True)
    assert torch.equal(bf16(shared + routed), want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_cuda(bench) -> None:
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--quick"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="stops at the no-GPU refusal")
def test_prefill_tokens_is_parsed_and_checked(bench, capsys) -> None:
    """`--prefill-tokens` (a short prompt's prefill) parses before the CUDA check; 0 is refused by argparse."""
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick", "--prefill-tokens", "1024"])
    with pytest.raises(SystemExit) as exc:
        bench.main(["--prefill-tokens", "0"])
    assert exc.value.code == 2 and "must be ≥ 1" in capsys.readouterr().err


def test_plot_eager_vs_graph(bench, tmp_path) -> None:
    pytest.importorskip("matplotlib")                    # on the GPU machine; absent on the CPU box
    timing = lambda us, frac: dict(median_us=us, reps=3, bytes={}, fraction_of_copy_bw=dict(current=frac))  # noqa: E731
    rows = [dict(tokens=n, torch=timing(20000.0, 0.01), indexer=timing(1000.0, 0.1), attention=timing(100.0, 0.2),
                 moe_routed=timing(2000.0, 0.3), eager=timing(25000.0 * n, 0.05), graph=timing(5000.0 * n, 0.2))
            for n in (1, 8)]
    rows.append(bench.failed_row(64, "RuntimeError: x"))
    bench.plot(rows, tmp_path / "p.png", "CPU")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_profile_labels_cover_the_torch_work(bench, setup) -> None:
    """`--profile`'s labels (benchmarks/step_profile.py) on the CPU torch work: every runtime call it
    wraps is reached with the layer's own weight tensors (named linears), the grouped `wo_a`'s
    per-group slices count to `wo_a`, and everything is restored afterwards."""
    import flash_layer as fl
    import step_profile as sp
    cfg, _, built = setup
    t = cfg.text
    R = bf16(torch.randn(1, t.hc_mult, t.hidden_size, generator=torch.Generator().manual_seed(3)))
    names = sp.weight_names(built.weights, built.role.layer)
    with sp.labels_on(built.backend, names, fl):
        trace = sp._trace_of(lambda: fl.torch_work(built, R, torch.tensor([15])))
    assert fl.mhc_for.__module__ != sp.__name__ and not {"linear_fp8", "rms_norm"} & set(vars(built.backend))
    ranges = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation" and e["name"].startswith(sp.PREFIX)]
    labels = {e["name"][len(sp.PREFIX):] for e in ranges}
    want = {"mhc", "compressor", "indexer_query", "router", "shared_expert", "linear:attn.wq_a", "linear:attn.wq_b",
            "linear:attn.wkv", "linear:attn.wo_a", "linear:attn.wo_b", "linear:attn.indexer.wq_b",
            "linear:ffn.shared_experts.w1", "linear:ffn.shared_experts.w2", "linear:ffn.shared_experts.w3"}
    assert want <= labels, want - labels
    for r in ranges:       # unnamed products (wo_a's group slices) sit inside a named linear
        if r["name"].endswith("linear:?"):
            assert sp.label_at(ranges, r["tid"], r["ts"] + r["dur"] / 2).startswith("linear:attn."), r
    assert {sp.component(lab) for lab in labels} <= set(sp.COMPONENTS) - {"unattributed"}
    import prefill_profile as pp                 # `--profile-prefill`'s components of the same labels
    comps = {pp.prefill_component(lab, "k", [n for n in names.values() if n.startswith("attn.w")]) for lab in labels}
    assert comps <= set(pp.PREFILL_COMPONENTS) - {"unattributed"}
    assert {"dense_fp8", "compressor", "indexer_query", "router", "shared_expert", "mhc", "norms", "rope"} <= comps


def test_prefill_profile_flow_on_a_tiny_cpu_layer(bench, setup, tmp_path) -> None:
    """`--profile-prefill`'s flow (benchmarks/prefill_profile.py) on the tiny CPU layer: every variant
    builds its parts under its switches, runs the labelled passes and the timed ones and lands in the
    JSON (no kernels on CPU: walls only; the components come from the H200 run)."""
    import json

    import prefill_profile as pp
    _, _, built = setup
    errors: list[str] = []
    pp.write_prefill_profile(built, tmp_path, "cpu", 16, bench.STEP_PARTS, ("before", "new"), errors, repeats=1)
    assert [e for e in errors if not e.startswith("prefill profile plot")] == []
    got = json.loads((tmp_path / "prefill_profile.json").read_text())
    assert [r["variant"] for r in got["rows"]] == ["before", "new"] and got["tokens"] == 16
    for r in got["rows"]:
        assert r["parts"] == ["torch", "moe_routed"] and set(r["wall_us"]) == {"torch", "moe_routed"}
        assert r["tokens_per_s"] > 0 and r["passes"] == 1 and r["agreement_with"] == "before"
        assert r["tokens_per_s_chained"] > 0 and r["wall_us_chained"] > 0 and r["host_us_chained"] > 0
        profiled = r["host_profile"]                       # one chained pass under cProfile: our files named
        assert profiled["profiled_wall_ms"] > 0 and any(k.startswith("sglang_dsv41/") for k in profiled["self_ms_by_package"])
    assert got["rows"][1]["env"] == pp.SWITCHES | pp.NEW and "not in layer" in got["engram"]


def test_the_layer_router_spreads_like_uniform_routing(bench) -> None:
    """The benchmark layer's router (its BF16 gate weight and FP32 bias rules, Flash widths) spreads random
    O(1) inputs over about as many experts as uniform routing: ≥ 95 % of the expectation at 8 / 64 / 256
    tokens (docs/performance.md "Session 35"); with session 34's bias (0.3 · randn) it did not."""
    import flash_layer as fl
    from sglang_dsv41.runtime.routing_spread import distinct_experts, route_topk, uniform_distinct

    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    t = cfg.text
    specs = {s.name: s for s in tensor_inventory(cfg, vision=False, dspark=False)}
    weight, bias = specs["layers.2.ffn.gate.weight"], specs["layers.2.ffn.gate.bias"]
    assert weight.kind is Kind.BF16 and bias.kind is Kind.FP32
    g = torch.Generator().manual_seed(0)
    w = fl._bf16_value(weight.shape, g, "cpu")

    def spread(b: torch.Tensor, n: int, draws: int = 8) -> float:        # mean distinct experts over draws
        return sum(distinct_experts(route_topk(torch.randn(n, t.hidden_size, generator=g), w, b,
                                               t.num_experts_per_tok)) for _ in range(draws)) / draws

    b = fl._fp32_value(bias, bias.shape, g, "cpu")
    assert float(b.std()) == pytest.approx(fl.ROUTER_BIAS_STD, rel=0.2)
    for n in (8, 64, 256):
        assert spread(b, n) >= 0.95 * uniform_distinct(n, t.n_routed_experts, t.num_experts_per_tok), n
    assert spread(0.3 * torch.randn(bias.shape, generator=g), 64) < 0.6 * uniform_distinct(64, t.n_routed_experts,
                                                                                            t.num_experts_per_tok)
