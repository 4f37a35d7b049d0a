"""The HiCache host tier (L2) in `sglang-dsv41 plan`: tokens and host bytes per rank and per node
for `--hicache-ratio` / `--hicache-size` (docs/hicache.md "Sizing"; runtime/hicache_stack.py).

Each TP rank holds two host pools of the SAME slot count (`hicache_stack.host_slots`): the global
KV rows (`RuntimePool.row_bytes`: latent row + index-key row, the FULL component's buffers) and the
SWA rows of every layer (`RuntimePool.swa_token_bytes`, the SWA component's buffers). So one host
token costs `row_bytes + swa_token_bytes` (tiny 192 + 1,536 = 1,728 B; Flash 896 + 40,960 = 41,856 B):

* `--hicache-size G` (GB, 10⁹ B, per rank): `G·10⁹ // bytes_per_token` tokens;
* else `--hicache-ratio r` (SGLang's default 2): `r ×` the rank's full-pool device tokens.

SGLang adds one page to each host pool; the planner leaves it out. The L3 storage tier is not
sized here (it lives on disk or in the Mooncake store, not in host memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..runtime.requirements import flag_value

#: SGLang 0.5.17's `--hicache-ratio` default
DEFAULT_RATIO = 2.0


@dataclass(frozen=True)
class HostTier:
    setting: str              # the flag that sized it, as given
    full_row_bytes: int       # host bytes of one token's global rows (the FULL host pool)
    swa_row_bytes: int        # host bytes of one token's SWA rows, every layer (the SWA host pool)
    tokens_per_rank: int
    ranks_per_node: int

    @property
    def bytes_per_token(self) -> int:
        return self.full_row_bytes + self.swa_row_bytes

    @property
    def bytes_per_rank(self) -> int:
        return self.tokens_per_rank * self.bytes_per_token

    @property
    def bytes_per_node(self) -> int:
        return self.bytes_per_rank * self.ranks_per_node

    def to_dict(self) -> dict:
        return {"setting": self.setting, "full_row_bytes": self.full_row_bytes, "swa_row_bytes": self.swa_row_bytes,
                "bytes_per_token": self.bytes_per_token, "tokens_per_rank": self.tokens_per_rank,
                "bytes_per_rank": self.bytes_per_rank, "ranks_per_node": self.ranks_per_node,
                "bytes_per_node": self.bytes_per_node}


def hicache_setting(extra_args: Sequence[str], ratio: float | None, size_gb: float | None
                    ) -> tuple[float | None, float | None]:
    """(ratio, size GB) of the host tier: the `plan` flags, else the config's
    `--enable-hierarchical-cache` extra args (ratio defaults to SGLang's); (None, None) without HiCache."""
    if ratio is None and size_gb is None:
        args = list(extra_args)
        if "--enable-hierarchical-cache" not in args:
            return None, None
        r, s = flag_value(args, ("--hicache-ratio",)), flag_value(args, ("--hicache-size",))
        ratio, size_gb = float(r) if r else None, float(s) if s else None
    if size_gb is not None and size_gb < 0 or ratio is not None and ratio <= 0:
        raise ValueError(f"--hicache-size must be ≥ 0 and --hicache-ratio > 0 (got {size_gb}, {ratio})")
    if not size_gb and ratio is None:
        ratio = DEFAULT_RATIO
    return ratio, size_gb


def host_tier(full_row_bytes: int, swa_row_bytes: int, device_tokens: int, page: int, ranks_per_node: int,
              ratio: float | None, size_gb: float | None) -> HostTier:
    """The host tier `hicache_stack.host_slots` allocates for one rank (module docstring)."""
    per_token = full_row_bytes + swa_row_bytes
    if size_gb:
        tokens, setting = int(size_gb * 1e9 // per_token), f"--hicache-size {size_gb:g}"
    else:
        tokens, setting = int(device_tokens * ratio), f"--hicache-ratio {ratio:g}"
    if tokens < page:
        raise ValueError(f"the HiCache host tier holds {tokens} tokens (< one page) with {setting}: raise it")
    return HostTier(setting=setting, full_row_bytes=full_row_bytes, swa_row_bytes=swa_row_bytes,
                    tokens_per_rank=tokens, ranks_per_node=ranks_per_node)
