"""The planner's figure for this runtime's weights (`deploy/runtime_residency.py`) equals the bytes
`runtime_weights` + the dense backend's BF16 copies actually hold (tiny checkpoint, TP 1 and 2);
with Engram host placement (per_rank) the Engram block leaves the GPU figure for the host."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.deploy.memory import ShardLayout, weight_plan
from sglang_dsv41.deploy.runtime_residency import engram_host_shards, runtime_residency, tensor_bytes_at_rest
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.runtime.dense_weights import DenseWeightCache
from sglang_dsv41.runtime.engram_table import StoredEngramTable
from sglang_dsv41.runtime.moe_ops import RoutedExpertsMxfp4
from sglang_dsv41.runtime.tensor_parallel import ShardPlan, TensorParallelError
from sglang_dsv41.runtime.weights import runtime_weights


def held_bytes(weights: dict) -> int:
    """Device bytes of a runtime weight dict as CUDA holds it (MXFP4 experts counted as stored)."""
    total = 0
    for value in weights.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, StoredEngramTable):
            total += value.nbytes
        elif isinstance(value, RoutedExpertsMxfp4):
            total += value.prepared.checkpoint_bytes_per_expert() * value.prepared.n_experts
        else:
            raise TypeError(f"unexpected runtime value {type(value).__name__}")
    return total + 2 * DenseWeightCache.from_weights(weights).bf16_elements


@pytest.mark.parametrize("tp", [1, 2])
def test_planned_bytes_equal_what_the_runtime_holds(tiny_checkpoint, tp: int) -> None:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names()}
    plan = ShardPlan.for_config(cfg.text, 0, tp)
    w = runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=True, dense_fp8=True,
                        expert_ids=list(plan.experts), rows_of=plan.rows_of, cols_of=plan.cols_of)
    assert runtime_residency(cfg, tp).per_rank == held_bytes(w)
    if tp > 1:                                  # the row-parallel wo_b is counted by its columns
        wo_b = w["layers.0.attn.wo_b.weight"]
        assert wo_b.shape[1] * tp == cfg.text.o_groups * cfg.text.o_lora_rank


def test_flash_figures() -> None:
    """Flash: the embedding and head split by vocabulary blocks (fp32 at rest; SGLang's
    vocab-parallel split: 129,280 ids = 8 × 16,160), Engram rows, routed experts, `wo_b` and the
    shared expert split by TP;
    TP sizes the output groups do not divide are refused."""
    from sglang_dsv41.runtime.tensor_parallel import vocab_shard

    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    tp1, tp8 = runtime_residency(cfg, 1), runtime_residency(cfg, 8)
    vocab = sum(tensor_bytes_at_rest(s, 1.0)[1] for s in tensor_inventory(cfg, vision=False, dspark=False)
                if s.name in ("embed.weight", "head.weight"))
    held = vocab_shard(cfg.text.vocab_size, 8, 0)[1] / cfg.text.vocab_size
    assert held == 1 / 8
    assert tp8.by_component["unquantised"] == pytest.approx(tp1.by_component["unquantised"] - vocab * (1 - held),
                                                           rel=1e-5)   # and attn_sink split
    assert tp8.by_component["engram"] == pytest.approx(tp1.by_component["engram"] / 8, rel=1e-6)
    assert tp8.by_component["experts"] == pytest.approx(tp1.by_component["experts"] / 8, rel=1e-6)
    split = ("attn.wq_b.weight", "attn.wo_a.weight",             # by heads / output groups
             "attn.wo_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",   # row / column-parallel
             "shared_experts.w3.weight")
    fp8 = [s for s in tensor_inventory(cfg, vision=False, dspark=False) if s.kind is Kind.FP8]
    assert tp8.by_component["fp8_dense"] == pytest.approx(
        sum(tensor_bytes_at_rest(s, 1 / 8 if s.name.endswith(split) else 1.0)[1] for s in fp8), rel=1e-6)
    assert tp8.per_rank / 2**30 == pytest.approx(60.08, abs=0.01)
    with pytest.raises(TensorParallelError):
        runtime_residency(cfg, 3)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_host_placement_moves_the_engram_block_off_the_gpu(tp: int) -> None:
    """engram_placement="host" (the runtime's per_rank host table): the GPU figure is the device
    figure less the Engram block; each rank pins its own balanced block of rows (+ scales) on the
    host, rank 0 the largest, and the blocks add up to the checkpoint's Engram bytes exactly."""
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    device, host = runtime_residency(cfg, tp), runtime_residency(cfg, tp, "host")
    assert (device.engram_placement, device.engram_host_by_rank, device.host_layout) == ("device", (), None)
    assert (host.engram_placement, host.host_layout, len(host.engram_host_by_rank)) == ("host", "per_rank", tp)
    assert host.by_component == {k: v for k, v in device.by_component.items() if k != "engram"}
    assert host.per_rank == pytest.approx(device.per_rank - device.by_component["engram"], rel=1e-12)
    assert host.host_per_rank == host.engram_host_by_rank[0] == device.by_component["engram"]
    stored = sum(sum(t.nbytes for t in spec.stored()) for spec in tensor_inventory(cfg) if spec.kind is Kind.ENGRAM)
    assert host.host_per_server == stored == weight_plan(cfg, ShardLayout(tp=tp), engram_placement="host").engram_host_per_server
    assert max(host.engram_host_by_rank) - min(host.engram_host_by_rank) <= 2 * 264   # one row per table at most


def test_engram_host_shards_follow_the_runtimes_row_blocks(tiny_checkpoint) -> None:
    """The tiny checkpoint at TP 2: each rank's host bytes are its `ShardPlan.engram_rows` of the
    stored tables (E4M3 rows + UE8M0 scales), read off the checkpoint itself."""
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    with CheckpointReader(tiny_checkpoint) as reader:
        tables = {n: reader.get(n) for n in reader.names() if ".engram.embed." in n}
    assert tables
    for rank, held in enumerate(engram_host_shards(cfg, 2)):
        rows = ShardPlan.for_config(cfg.text, rank, 2).engram_rows
        want = 0
        for name, t in tables.items():
            layer = int(name.split(".")[1])
            want += len(rows[layer]) * (t.numel() // t.shape[0]) * t.element_size()
        assert held == want, rank
    with pytest.raises(ValueError, match="engram placement"):
        runtime_residency(cfg, 2, "peer")


def test_vision_row_equals_the_towers_parameters(tiny_checkpoint) -> None:
    """vision=True adds the bytes `runtime/vision.VisionTower` holds (every tensor an fp32
    parameter, the same on every rank); a checkpoint without a tower, or vision=False, adds none."""
    from sglang_dsv41.runtime.vision import VisionTower

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    tower = VisionTower(cfg)
    held = sum(p.numel() * p.element_size() for p in tower.parameters())
    for tp in (1, 2):
        with_tower, text = runtime_residency(cfg, tp, vision=True), runtime_residency(cfg, tp)
        assert with_tower.by_component["vision"] == held and "vision" not in text.by_component
        assert with_tower.per_rank == text.per_rank + held


def test_dspark_row_equals_what_the_draft_holds(tiny_checkpoint) -> None:
    """dspark=True adds the DSpark draft as `runtime/dspark_weights.dspark_runtime_weights` holds it
    on CUDA (MXFP4 experts, FP8 dense kept, BF16 copies of the dense linears its Triton backend
    registers), whole on every rank; dspark=False, or a checkpoint without stages, adds none."""
    from sglang_dsv41.runtime.dspark_weights import dspark_runtime_weights

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names()}
    draft = dspark_runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=True, dense_fp8=True)
    held = held_bytes(draft)
    assert held > 0
    for tp in (1, 2):
        with_draft, plain = runtime_residency(cfg, tp, dspark=True), runtime_residency(cfg, tp)
        assert with_draft.by_component["dspark"] == held and "dspark" not in plain.by_component
        assert with_draft.per_rank == plain.per_rank + held


def test_planner_adds_the_flash_drafter() -> None:
    """Flash: the drafter is ~14.2B parameters in the card's table (weight_plan) and 7.58 GiB on
    every rank of this runtime; a `*-dspark` config's plan leaves its KV budget after it."""
    from pathlib import Path

    from sglang_dsv41.deploy.plan import _runtime_weights
    from sglang_dsv41.deploy.schema import load_config

    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    with_draft, without = (weight_plan(cfg, ShardLayout(tp=4), dspark=d) for d in (True, False))
    params = sum(c.entries for k, c in with_draft.components.items() if k != "scales") - \
        sum(c.entries for k, c in without.components.items() if k != "scales")
    assert params / 1e9 == pytest.approx(14.2, abs=0.05)
    draft = runtime_residency(cfg, 4, "host", dspark=True).by_component["dspark"]
    assert draft / 2**30 == pytest.approx(7.58, abs=0.01)
    root = Path(__file__).resolve().parents[1] / "configs"
    (spec, note), (base, _) = (_runtime_weights(load_config(root / f"{stem}.yaml"), cfg)
                               for stem in ("h200-tp4-dspark", "h200-tp4"))     # what `plan` budgets KV after
    assert spec is not None and base is not None
    assert spec.per_rank == pytest.approx(base.per_rank + draft, rel=1e-12)
    assert "DSpark draft 7.58 GiB whole on every rank" in note
