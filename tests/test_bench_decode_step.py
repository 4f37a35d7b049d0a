"""`benchmarks/decode_step.py` logic on CPU shapes (tiny config; no timing assertions).

The layer generator writes every stored tensor of the layer in the checkpoint's formats (checked
against the inventory independently here); the loaded layer holds the reference loader's values;
the byte accounting matches the inventory; one decode point (N = 1, 3) runs the torch work and
the routed experts on CPU, and the routed term equals the reference MoE's; without CUDA the
script refuses to run.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from reference_weights import tiny_config

from sglang_dsv41.checkpoint.loader import logical_tensor, stored_problem
from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
from sglang_dsv41.reference import moe as ref_moe
from sglang_dsv41.reference.ops import bf16

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


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
    assert built.weights.keys() == {s.name for s in specs}          # CPU: experts dequantised too
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
    b = bench.step_bytes(built, 3, n_visible=10, distinct_experts=5)
    assert b["moe_routed"] == dict(current=5 * built.expert_bytes, design=5 * built.expert_bytes)
    valid = t.sliding_window + min(t.index_topk, 10)
    assert b["attention"]["current"] == 3 * (t.num_attention_heads * t.head_dim * 2 + valid * t.head_dim * 2
                                             + (t.sliding_window + t.index_topk) * 4)
    for c in ("attention", "indexer", "torch"):
        assert b[c]["design"] < b[c]["current"]


@pytest.mark.parametrize("N", [1, 3])
def test_decode_point_on_cpu(bench, setup, N: int) -> None:
    cfg, layer, built = setup
    caches = bench.make_caches(built, N, 16, torch.device("cpu"))
    assert caches.swa.shape == (N * 16, cfg.text.head_dim) and caches.keys.shape == (N * 16, cfg.text.index_head_dim)
    errors: list[str] = []
    pos = torch.full((N,), 15, dtype=torch.long)
    row = bench.run_point(built, caches, torch.arange(N), pos, cap_s=0.01, copy_gbs=None, errors=errors)
    assert errors == []
    assert row["tokens"] == N and row["visible_entries"] == 16 // built.role.ratio
    for c in ("torch", "moe_routed"):
        assert row[c]["median_us"] > 0 and row[c]["reps"] >= 1 and set(row[c]["bytes"]) == {"current", "design"}
    assert "attention" not in row and "indexer" not in row           # Triton kernels: CUDA only
    queries = bench.queries(built, caches, torch.arange(N), pos)
    W = cfg.text.sliding_window
    assert torch.equal(queries["swa_slots"][-1], torch.where(torch.arange(16 - W, 16) >= 0,
                                                             (N - 1) * 16 + torch.arange(16 - W, 16), -1))


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
