"""Launch flags of the routed-expert GEMMs (`kernels/moe_mxfp4.py`: `triton_kernels.matmul_ogs` on MXFP4
weights): the opt-flag constraints set per call at decode and at prefill sizes (issue 21; opt-in until
measured, docs/performance.md "Session 11", "Session 13", "Session 25").

* `SGLANG_DSV41_MOE_DECODE_FLAGS` ("block_k=256,num_stages=4"): calls of ≤ DECODE_FLAG_MAX_TOKENS tokens;
  `SGLANG_DSV41_MOE_PREFILL_FLAGS`: larger calls. Keys: DECODE_FLAG_KEYS.
* `split_k=S` (S ≥ 2): at one token each GEMM runs only 108 / 120 programs on the H200's 132 SMs
  (46 % / 44 % of copy bandwidth, session 23's profile). triton_kernels' kernel walks the K tiles of
  S splits (the Hopper value and scale pointers advance by S tiles) and its reduce step sums the fp32
  partials and applies the fused activation, but its host code refuses the constraint for MX weights
  (`can_use_split_k = … and not w_has_mx` in `matmul_ogs`). Inside `decode_flags_scope` with a split
  the refusal is lifted for that call only (`mx_split_k_allowed`). The sums stay fp32 (another order:
  inside the routed-expert bound of `moe_mxfp4.routed_error_bound`; the GPU tests check it).
"""
from __future__ import annotations

import contextlib
import inspect
import os
from functools import lru_cache
from typing import Callable

from torch import Tensor
from triton_kernels import matmul_ogs as _ogs
from triton_kernels.matmul_ogs_details import opt_flags as _opt_flags

#: triton_kernels opt-flag constraints the switches may set (Hopper MXFP4: no TMA, so no `is_persistent`)
DECODE_FLAG_KEYS = ("block_m", "block_k", "num_stages", "epilogue_subtile", "split_k")
DECODE_FLAGS_ENV = "SGLANG_DSV41_MOE_DECODE_FLAGS"
#: calls with at most this many tokens take the decode flags
DECODE_FLAG_MAX_TOKENS = 16
#: the same constraints for calls of more tokens (prefill; opt-in, docs/performance.md "Session 13")
PREFILL_FLAGS_ENV = "SGLANG_DSV41_MOE_PREFILL_FLAGS"
#: the largest split the flags take (each split adds an fp32 partial of the GEMM's output)
MAX_SPLIT_K = 8
#: the function `matmul_ogs` asks for its launch flags, and its parameter that refuses split-K on MX weights
OPT_FLAGS_FN, SPLIT_K_PARAM = "make_opt_flags", "can_use_split_k"


def parse_decode_flags(text: str, env: str = DECODE_FLAGS_ENV) -> dict[str, int]:
    """"block_k=256,num_stages=4" → {"block_k": 256, "num_stages": 4}; "" → {}; an unknown key, a
    non-positive / non-integer value or a split above MAX_SPLIT_K raises ValueError (naming `env`)."""
    flags: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in DECODE_FLAG_KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"{env}: bad item {item!r} (expected key=positive int, key in "
                             f"{DECODE_FLAG_KEYS})")
        flags[key] = int(value)
    if flags.get("split_k", 1) > MAX_SPLIT_K:
        raise ValueError(f"{env}: split_k={flags['split_k']} above {MAX_SPLIT_K}")
    return flags


@lru_cache(maxsize=1)
def decode_flags() -> dict[str, int]:
    """The decode flags SGLANG_DSV41_MOE_DECODE_FLAGS names (read once; {} = triton_kernels' own)."""
    return parse_decode_flags(os.environ.get(DECODE_FLAGS_ENV, ""))


@lru_cache(maxsize=1)
def prefill_flags() -> dict[str, int]:
    """The flags SGLANG_DSV41_MOE_PREFILL_FLAGS names for calls of more than DECODE_FLAG_MAX_TOKENS
    tokens (read once; `prefill_flags.cache_clear()` re-reads; {} = triton_kernels' own)."""
    return parse_decode_flags(os.environ.get(PREFILL_FLAGS_ENV, ""), PREFILL_FLAGS_ENV)


def launch_flags(tokens: int) -> dict[str, int]:
    """The opt-flag constraints of a call of `tokens` tokens: decode flags up to
    DECODE_FLAG_MAX_TOKENS, else the prefill flags."""
    return decode_flags() if tokens <= DECODE_FLAG_MAX_TOKENS else prefill_flags()


@contextlib.contextmanager
def mx_split_k_allowed():
    """Inside: `matmul_ogs` asks `make_opt_flags` with can_use_split_k=True (module doc), so a split-K
    constraint applies to MX weights; the module attribute is restored on exit (also after an
    exception). Fails loudly when triton_kernels no longer has that function or parameter."""
    original = getattr(_ogs, OPT_FLAGS_FN, None)
    if original is None or SPLIT_K_PARAM not in inspect.signature(original).parameters:
        raise RuntimeError(f"triton_kernels.matmul_ogs.{OPT_FLAGS_FN}({SPLIT_K_PARAM}=…) is gone: the MXFP4 "
                           f"split-K flag cannot be applied (SGLANG_DSV41_MOE_DECODE_FLAGS split_k)")
    signature = inspect.signature(original)

    def allowing(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments[SPLIT_K_PARAM] = True
        return original(*bound.args, **bound.kwargs)

    setattr(_ogs, OPT_FLAGS_FN, allowing)
    try:
        yield
    finally:
        setattr(_ogs, OPT_FLAGS_FN, original)


@contextlib.contextmanager
def decode_flags_scope(flags: dict[str, int]):
    """triton_kernels' opt-flag constraints set to `flags` inside (process-global; reset on exit,
    also after an exception); with split_k > 1 also `mx_split_k_allowed`; nothing for {}."""
    if not flags:
        yield
        return
    with contextlib.ExitStack() as stack:
        if flags.get("split_k", 1) > 1:
            stack.enter_context(mx_split_k_allowed())
        _opt_flags.update_opt_flags_constraints(dict(flags))
        try:
            yield
        finally:
            _opt_flags.reset_opt_flags_constraints()


def with_decode_flags(flags: dict[str, int], fn: Callable[[], Tensor]) -> Tensor:
    """fn() inside `decode_flags_scope(flags)`."""
    with decode_flags_scope(flags):
        return fn()


__all__ = ["DECODE_FLAG_KEYS", "DECODE_FLAG_MAX_TOKENS", "DECODE_FLAGS_ENV", "MAX_SPLIT_K", "PREFILL_FLAGS_ENV",
           "decode_flags", "decode_flags_scope", "launch_flags", "mx_split_k_allowed", "parse_decode_flags",
           "prefill_flags", "with_decode_flags"]
