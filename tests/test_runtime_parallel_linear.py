"""Row- / column-parallel FP8 linears built as SGLang's parallel linear layers
(`runtime/parallel_linear.py`, issue 13 item 4), in one process (no collectives: the ranks'
partials are summed here as SGLang's all-reduce sums them):

* the layers are SGLang's `RowParallelLinear` / `ColumnParallelLinear` with our quant method;
  loading through their `weight_loader`s (SGLang's narrowing by `tp_rank`) gives each rank
  exactly its rows / columns of the stored bytes;
* row-parallel partials of `wo_b` (tiny checkpoint, TP 2) and of a shared expert whose
  intermediate splits on 32-wide blocks (TP 2 and 4) sum to the TP-1 output bit for bit on the
  exact backend, and within fp32 rounding on the serving backend;
* the plan replicates a shared expert whose blocks would split a tile (the tiny one at TP 2);
  misaligned shards and layers run at the wrong TP size raise;
* `wq_b` / `wo_a` are `ColumnParallelLinear`s holding the plan's head / group rows, and the
  embedding / LM head SGLang's `VocabParallelEmbedding` / `ParallelLMHead` (`runtime/vocab_parallel.py`)
  whose loaders give each rank its vocabulary rows (SGLang's `shard_indices`) and whose
  masked lookups sum to TP 1's rows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_dsv41.checkpoint.names import Kind, TensorSpec
from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.runtime.backend import ExactTorchBackend, FastTorchBackend
from sglang_dsv41.runtime.parallel_linear import RowParallelFp8, parallel_fp8_linear
from sglang_dsv41.runtime.tensor_parallel import ShardPlan, TensorParallel, TensorParallelError

WO_B = "layers.0.attn.wo_b.weight"


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names()
                  if any(k in n for k in (".wo_b.", ".shared_experts.", ".wq_b.", ".wo_a.", "embed.", "head."))}
    return cfg, stored


def _loaded(spec: TensorSpec, plan: ShardPlan, stored: dict) -> torch.nn.Module:
    layer = parallel_fp8_linear(spec, plan, keep_fp8=False)
    for leaf in ("weight", "scale"):
        param = getattr(layer, leaf)
        param.weight_loader(param, stored[spec.name.rsplit(".", 1)[0] + "." + leaf])
    layer.process()
    return layer


def _spec(cfg, name: str) -> TensorSpec:
    from sglang_dsv41.checkpoint.names import tensor_inventory

    return next(s for s in tensor_inventory(cfg, vision=False, dspark=False) if s.name == name)


def test_wo_b_is_sglangs_row_parallel_layer_and_loads_its_columns(tiny) -> None:
    from sglang.srt.layers.linear import RowParallelLinear

    cfg, stored = tiny
    spec = _spec(cfg, WO_B)
    for rank in range(2):
        plan = ShardPlan.for_config(cfg.text, rank, 2)
        layer = parallel_fp8_linear(spec, plan, keep_fp8=True)
        assert isinstance(layer, RowParallelLinear) and (layer.tp_rank, layer.tp_size) == (rank, 2)
        layer.weight.weight_loader(layer.weight, stored[WO_B])
        cols = plan.cols_of(WO_B)
        assert torch.equal(layer.weight.data.view(torch.uint8), stored[WO_B][:, cols.start:cols.stop].view(torch.uint8))
        assert len(cols) * 2 == spec.shape[1] and cols.start == rank * len(cols)


@pytest.mark.parametrize("backend", [ExactTorchBackend(), FastTorchBackend()], ids=["exact", "fp32"])
def test_row_parallel_wo_b_partials_sum_to_tp1(tiny, backend) -> None:
    cfg, stored = tiny
    spec = _spec(cfg, WO_B)
    whole = _loaded(spec, ShardPlan.for_config(cfg.text, 0, 1), stored)
    u = backend.bf16(torch.randn(7, spec.shape[1], generator=torch.Generator().manual_seed(0)))
    want = whole.quant_method.apply(whole, u, backend=backend)
    parts = []
    for rank in range(2):
        layer = _loaded(spec, ShardPlan.for_config(cfg.text, rank, 2), stored)
        cols = layer.cols
        parts.append(layer.quant_method.apply(layer, u[:, cols.start:cols.stop], backend=backend))
    assert parts[0].dtype == backend.acc
    got = backend.linear_fp8_finish(parts[0] + parts[1])
    if backend.deterministic:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=2 ** -7, atol=0)      # one BF16 ulp: fp32 sums in another order


def _random_fp8(spec: TensorSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    (w, s) = spec.stored()
    values = (torch.randn(w.shape, generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.randint(120, 128, s.shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return {w.name: values, s.name: scales}


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_shared_expert_sums_to_tp1_bit_for_bit(tiny, tp: int) -> None:
    """A shared expert of 128 intermediate columns (blocks of 64 / 32 per rank): column-parallel
    w1 / w3, row-parallel w2; Σ partials == the TP-1 shared expert on the exact backend."""
    cfg, _ = tiny
    text = dataclasses.replace(cfg.text, moe_intermediate_size=128, num_attention_heads=8, o_groups=8)
    H, I = text.hidden_size, 128
    p = "layers.0.ffn.shared_experts."
    specs = {n: TensorSpec(f"{p}{n}.weight", (H, I) if n == "w2" else (I, H), Kind.FP8, "dense")
             for n in ("w1", "w2", "w3")}
    stored = {k: v for i, s in enumerate(specs.values()) for k, v in _random_fp8(s, i).items()}
    be = ExactTorchBackend()
    x = be.bf16(torch.randn(5, H, generator=torch.Generator().manual_seed(1)))

    def layers(rank: int, size: int) -> list[torch.nn.Module]:
        plan = ShardPlan.for_config(text, rank, size)
        return [_loaded(specs[n], plan, stored) for n in ("w1", "w2", "w3")]

    want, partial = TensorParallel().shared_expert(*layers(0, 1), x, be, True, text.swiglu_limit)
    assert not partial
    comm = type("Comm", (), {"world_size": tp})
    parts = []
    for rank in range(tp):
        plan = ShardPlan.for_config(text, rank, tp)
        assert plan.shared == range(rank * I // tp, (rank + 1) * I // tp)
        comm.rank_in_group = rank
        y, partial = TensorParallel(rank, tp, comm()).shared_expert(*layers(rank, tp), x, be, True, text.swiglu_limit)
        assert partial and y.dtype == torch.float64
        parts.append(y)
    assert torch.equal(be.linear_fp8_finish(sum(parts)), want)


def test_plan_replicates_a_shared_expert_that_would_split_a_tile(tiny) -> None:
    cfg, _ = tiny
    assert cfg.text.moe_intermediate_size == 32                     # 16 per rank at TP 2: replicated
    plan = ShardPlan.for_config(cfg.text, 1, 2)
    assert plan.shared is None
    name = "layers.0.ffn.shared_experts.w2.weight"
    assert plan.cols_of(name) is None and plan.fraction_of(name, (64, 32)) == 1.0
    layer = parallel_fp8_linear(_spec(cfg, name), plan, keep_fp8=False)
    assert (layer.tp_rank, layer.tp_size) == (0, 1)
    assert plan.fraction_of(WO_B, _spec(cfg, WO_B).shape) == 0.5


def test_misaligned_shard_and_wrong_tp_size_raise(tiny) -> None:
    cfg, stored = tiny
    spec = _spec(cfg, WO_B)                                          # 64 input columns
    with pytest.raises(ValueError, match="32-wide FP8 tiles"):
        from sglang_dsv41.runtime.parallel_linear import Dsv41Fp8TileConfig

        RowParallelFp8(64, spec.shape[0], bias=False, params_dtype=torch.float32,
                       quant_config=Dsv41Fp8TileConfig(spec, False), tp_rank=1, tp_size=4)
    layer = _loaded(spec, ShardPlan.for_config(cfg.text, 0, 2), stored)
    with pytest.raises(TensorParallelError, match="built for tp rank 0 of 2"):
        TensorParallel().row_parallel(layer, torch.zeros(1, 32), ExactTorchBackend(), True)


def test_wq_b_and_wo_a_are_column_parallel_by_heads_and_groups(tiny) -> None:
    from sglang.srt.layers.linear import ColumnParallelLinear

    cfg, stored = tiny
    size = cfg.text.o_groups                       # tiny: 2 output groups, one per rank
    for name in ("layers.0.attn.wq_b.weight", "layers.0.attn.wo_a.weight"):
        spec = _spec(cfg, name)
        full = _loaded(spec, ShardPlan.for_config(cfg.text, 0, 1), stored).weight
        for rank in range(size):
            plan = ShardPlan.for_config(cfg.text, rank, size)
            layer = _loaded(spec, plan, stored)
            rows = plan.rows_of(name)
            assert isinstance(layer, ColumnParallelLinear) and (layer.tp_rank, layer.tp_size) == (rank, size)
            assert torch.equal(layer.weight, full[rows.start:rows.stop]), (name, rank)


def test_vocab_layers_are_sglangs_and_load_their_rows(tiny) -> None:
    from sglang.srt.layers import vocab_parallel_embedding as sgl

    from sglang_dsv41.checkpoint.loader import logical_tensor
    from sglang_dsv41.runtime.vocab_parallel import vocab_layer

    cfg, stored = tiny
    V, H = cfg.text.vocab_size, cfg.text.hidden_size
    ids = torch.tensor([0, 5, V // 2 - 1, V // 2, V - 1, 7])
    for name, cls in (("embed.weight", sgl.VocabParallelEmbedding), ("head.weight", sgl.ParallelLMHead)):
        spec = _spec(cfg, name)
        full = logical_tensor(spec, lambda _: stored[name])
        for size in (1, 2):
            rows = []
            for rank in range(size):
                plan = ShardPlan.for_config(cfg.text, rank, size)
                layer = vocab_layer(spec, plan)
                assert isinstance(layer, cls) and layer.tp_size == size
                idx = layer.shard_indices
                assert range(idx.org_vocab_start_index, idx.org_vocab_end_index) == plan.vocab
                layer.weight.weight_loader(layer.weight, stored[name])
                assert [n for n, _ in layer.named_parameters()] == ["weight"]
                assert torch.equal(layer.weight, full[plan.vocab.start:plan.vocab.stop])
                local = ids - plan.vocab.start
                mine = (local >= 0) & (local < len(plan.vocab))
                got = layer.quant_method.embedding(layer, local.clamp(0, len(plan.vocab) - 1))
                rows.append(torch.where(mine[:, None], got, torch.full_like(got, -0.0)))
            assert torch.equal(sum(rows[1:], rows[0]), full[ids]) and rows[0].shape == (len(ids), H)
        with pytest.raises(Exception, match="embed.weight|head.weight"):
            layer.weight.weight_loader(layer.weight, stored[name][:, :H // 2])
