"""The planner's figure for this runtime's weights (`deploy/runtime_residency.py`) equals the bytes
`runtime_weights` + the dense backend's BF16 copies actually hold (tiny checkpoint, TP 1 and 2)."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.deploy.runtime_residency import runtime_residency
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.runtime.dense_ops import DenseWeightCache
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
                        expert_ids=list(plan.experts), rows_of=plan.rows_of)
    assert runtime_residency(cfg, tp).per_rank == held_bytes(w)


def test_flash_figures() -> None:
    """Flash: the embedding and head stay whole on every rank (fp32, + a BF16 head copy), Engram
    rows and routed experts split by TP; TP sizes the output groups do not divide are refused."""
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    tp1, tp8 = runtime_residency(cfg, 1), runtime_residency(cfg, 8)
    assert tp8.by_component["unquantised"] == pytest.approx(tp1.by_component["unquantised"], rel=1e-5)   # attn_sink split
    assert tp8.by_component["engram"] == pytest.approx(tp1.by_component["engram"] / 8, rel=1e-6)
    assert tp8.by_component["experts"] == pytest.approx(tp1.by_component["experts"] / 8, rel=1e-6)
    assert tp8.per_rank / 2**30 == pytest.approx(68.01, abs=0.01)
    with pytest.raises(TensorParallelError):
        runtime_residency(cfg, 3)
