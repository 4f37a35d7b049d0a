"""Runtime values of the DSpark draft tensors `mtp.{s}.*` (spec `model.md` §2.2 "DSpark", §2.4).

`dspark_runtime_weights(stored, cfg, device, *, experts_mxfp4, dense_fp8=None)` → {name → value}
for every logical DSpark tensor, by the same rules as the text model's `runtime_weights`
(`runtime/weights.py`): the stored checkpoint is checked first (`checkpoint.loader.check_stored`
with the DSpark inventory: one error naming every missing / mis-typed / mis-shaped tensor); FP8
dense weights stay E4M3 + fp32 tile scales when `dense_fp8` (default: CUDA), routed experts
become the MXFP4 kernel layout when `experts_mxfp4` (CUDA), everything else is the reference
loader's §2.4 value as fp32 on `device`. The DSpark experts are the stage's own
(`dspark_n_routed_experts` per stage). The target's `embed.weight` / `head.weight` are not
loaded here: the draft reads the target's modules (`attach_shared_modules`).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ..checkpoint.loader import check_stored, logical_tensor
from ..checkpoint.names import Kind, tensor_inventory
from ..config import DeepseekV41Config
from .moe_ops import routed_experts_key
from .weights import prepare_layer_experts, stored_fp8_dense

F32 = torch.float32
DSPARK_PREFIX = "mtp."


def require_dspark(cfg: DeepseekV41Config) -> None:
    """Raise unless the checkpoint config declares DSpark stages (spec §1.2, §4)."""
    t = cfg.text
    if t.num_nextn_predict_layers < 1:
        raise ValueError("this checkpoint has no DSpark stages (num_nextn_predict_layers = 0): "
                         "it cannot serve --speculative-algorithm DSPARK")
    if len(t.dspark_target_layer_ids) != t.num_nextn_predict_layers:
        raise ValueError(f"dspark_target_layer_ids {list(t.dspark_target_layer_ids)} does not name one target "
                         f"layer per DSpark stage ({t.num_nextn_predict_layers})")


def dspark_specs(cfg: DeepseekV41Config):
    """The logical DSpark tensors of the inventory, in inventory order."""
    return [s for s in tensor_inventory(cfg, vision=False, dspark=True) if s.name.startswith(DSPARK_PREFIX)]


def dspark_runtime_weights(stored: Mapping[str, Tensor], cfg: DeepseekV41Config, device: torch.device, *,
                           experts_mxfp4: bool, dense_fp8: bool | None = None) -> dict[str, object]:
    """The draft's weights on `device` (module doc). `stored`: the whole checkpoint's stored
    tensors (the draft worker loads the target's checkpoint)."""
    require_dspark(cfg)
    device = torch.device(device)
    if dense_fp8 is None:
        dense_fp8 = device.type == "cuda"
    check_stored(stored.keys(), cfg, vision=False, dspark=True,
                 meta=lambda n: (stored[n].dtype, tuple(stored[n].shape)))
    out: dict[str, object] = {}
    expert_stages: list[str] = []
    for spec in dspark_specs(cfg):
        if spec.kind is Kind.FP4:
            stage = spec.name[: spec.name.index(".ffn.") + 1]
            if stage not in expert_stages:
                expert_stages.append(stage)
            if experts_mxfp4:
                continue
        if dense_fp8 and spec.kind is Kind.FP8:
            kept = stored_fp8_dense(spec, stored.__getitem__, device)
            if kept is not None:
                out.update(kept)
                continue
        out[spec.name] = logical_tensor(spec, stored.__getitem__).to(device=device, dtype=F32).contiguous()
    if experts_mxfp4:
        n = cfg.text.dspark_n_routed_experts
        for stage in expert_stages:
            out[routed_experts_key(stage)] = prepare_layer_experts(stored, stage, n, device)
    return out
