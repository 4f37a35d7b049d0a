"""Deployment numerics both sides pin (spec `model.md` §3.8, §11 item 20)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheProfile(str, enum.Enum):
    """How the KV caches are stored, i.e. what attention reads back (spec §3.8).

    NONE: BF16 caches. FP8: upstream's "v4" layout (nope dims E4M3 per 64, RoPE dims BF16).
    FP4: the "v41" layout (SWA E4M3 per 32; compressed latents FP4). Index keys are FP4 always.
    """

    NONE = "none"
    FP8 = "fp8"
    FP4 = "fp4"


@dataclass(frozen=True)
class NumericsProfile:
    """Pinned deployment numerics: cache storage and FP8 activation quantisation."""

    cache: CacheProfile = CacheProfile.NONE
    act_quant: bool = True

    @classmethod
    def parse(cls, cache: str | CacheProfile = "none", act_quant: bool = True) -> "NumericsProfile":
        """From CLI-style values: cache ∈ {"none", "fp8", "fp4"}."""
        try:
            profile = CacheProfile(cache)
        except ValueError:
            raise ValueError(f"unknown cache profile {cache!r}; expected one of "
                             f"{[p.value for p in CacheProfile]}") from None
        return cls(cache=profile, act_quant=bool(act_quant))
