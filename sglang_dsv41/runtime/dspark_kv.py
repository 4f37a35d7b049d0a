"""The DSpark draft's context KV: per stage, one read-back kv row per committed target token
(spec `model.md` §4 "Draft context KV").

Invariants:

* Rows are addressed by SGLang's **full token slot** (`req_to_token[req, pos]`, the slot the
  target wrote that token's KV into), so a prefix hit, preemption or radix eviction frees and
  reuses draft rows exactly when the target's are; the store never holds token ids or positions.
* A row holds what the stage's attention reads back for that token: RoPE'd at the token's
  position and passed through the cache profile (`attention_math.swa_cache_roundtrip`); values
  are stored in BF16 when the profile's read-back is BF16-valued (NONE, FP4 — exact) and fp32
  otherwise.
* `window(stage, req_rows, req_to_token, prefix_lens, window)` returns, per request, the rows of
  positions P−W..P−1 (oldest first; positions < 0 invalid), P = the request's committed length —
  the keys every block row of that request attends besides the block itself.
* Only `write_rows` writes; a slot −1 (rejected / padding rows) lands in row 0, SGLang's padding
  slot, which no live request reads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..numerics.profile import CacheProfile

F32, BF16 = torch.float32, torch.bfloat16


class DSparkContextKV:
    """`stages` × [rows, head_dim] kv rows (module doc). Built by the draft pool at start-up,
    or directly by tests."""

    def __init__(self, stages: int, rows: int, head_dim: int, device: torch.device | str,
                 profile: CacheProfile = CacheProfile.NONE) -> None:
        if stages < 1 or rows < 1 or head_dim < 1:
            raise ValueError(f"DSpark context KV needs ≥ 1 stage, row and dim; got {stages}, {rows}, {head_dim}")
        self.profile = profile
        self.dtype = F32 if profile is CacheProfile.FP8 else BF16
        self.kv = [torch.zeros(rows, head_dim, dtype=self.dtype, device=device) for _ in range(stages)]

    @property
    def rows(self) -> int:
        return int(self.kv[0].shape[0])

    @property
    def stages(self) -> int:
        return len(self.kv)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def write_rows(self, stage: int, slots: Tensor, values: Tensor) -> None:
        """kv[stage][slot] = value for every slot ≥ 0 (module doc)."""
        slots = slots.to(device=self.kv[stage].device, dtype=torch.int64).reshape(-1)
        if values.shape != (slots.shape[0], self.kv[stage].shape[1]):
            raise ValueError(f"DSpark context kv: {tuple(values.shape)} values for {slots.shape[0]} slots of width "
                             f"{self.kv[stage].shape[1]}")
        # no host sync (CUDA graphs): a −1 slot writes row 0, SGLang's padding slot, which no live
        # request's window reads (`window` masks positions < 0 and live positions never map to 0)
        self.kv[stage][slots.clamp(min=0)] = values.to(self.dtype)

    def window(self, stage: int, req_rows: Tensor, req_to_token: Tensor, prefix_lens: Tensor,
               window: int) -> tuple[Tensor, Tensor]:
        """(keys [B, W, head_dim] fp32, valid [B, W]) of positions P−W..P−1 per request (module doc)."""
        positions = prefix_lens.to(torch.int64)[:, None] - window + torch.arange(window, device=prefix_lens.device)
        valid = positions >= 0
        slots = req_to_token[req_rows.to(torch.int64)[:, None], positions.clamp(min=0)].to(torch.int64)
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        keys = self.kv[stage][slots].to(F32)
        return torch.where(valid[..., None], keys, 0.0), valid
