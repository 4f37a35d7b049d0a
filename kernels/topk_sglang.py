"""The indexer's top-k through SGLang 0.5.17's JIT radix top-k (issue 21; not wired into serving).

`select_topk_sglang(scores, k)` has the contract of `kernels.indexer_select.select_topk`: scores fp32
[N, E] (allowed = score > −∞), result [N, k] int64, per row the min(k, #allowed) allowed columns
with the largest scores, ascending (`ordered=True`), −1 padded. It calls SGLang's public functions
of `sglang.kernels.ops.attention.dsv4.topk`:

* k ∈ {512, 1024}: `topk_transform_512` ("v1", one JIT build per k);
* any other k ≤ 2048 (or `variant="v2"`): `plan_topk_v2` + `topk_transform_512_v2` ("v2", one
  JIT build for every k; it needs a score row stride that is a multiple of 4 floats and a 16-byte
  aligned base, so other inputs are copied into a padded buffer first).

Glue invariants:
* page transform = identity: one page of `page_size` = the next power of two ≥ E, page table
  [N, 1] of zeros, so SGLang's `pt[i >> b] << b | i & (2^b − 1)` is i;
* `seq_lens` = `valid_lengths` clamped to [0, E] (default E): SGLang ranks columns < seq_len
  only, so columns ≥ valid_lengths[i] count as not allowed;
* SGLang returns min(k, seq_len) columns whatever their scores (a row of ≤ k columns comes back
  as 0 … seq_len − 1): each returned column outside [0, seq_len) or whose score is −∞ is set to
  −1, which gives min(k, #allowed) (−∞ ranks below every allowed score);
* no host sync unless `check_nan` (one, like `select_topk`).

Equality: set-equal to `select_topk` except for ties. Ours takes the lower column among scores
equal to the k-th; SGLang's kernels promise no tie order (v1: atomic order; v2 prefers the lower
column on some of its paths only). −0 ranks below +0 in SGLang (ours: equal). SGLang keeps a
bounded candidate buffer for the k-th score's coarse (fp16-key) bin (v1: 8,192 columns, v2: 2,048):
with more, the set may differ beyond ties (benchmarks/topk_kernels.py counts rows equal up to ties).

No fallback: a request it cannot serve raises `SglangTopkUnavailable` (non-CUDA tensors, k > 2048,
SGLang's module missing, a failed JIT build or launch).
"""
from __future__ import annotations

import importlib

import torch
from torch import Tensor

V1_KS = (512, 1024)
MAX_K = 2048
#: SGLang 0.5.17's DeepSeek-V4 top-k module (imported through sys.modules, so a test can block it)
SGLANG_TOPK_MODULE = "sglang.kernels.ops.attention.dsv4.topk"
VARIANTS = ("v1", "v2")


class SglangTopkUnavailable(RuntimeError):
    """SGLang's JIT top-k cannot serve this request (the message says why)."""


def sglang_topk_module():
    """`sglang.kernels.ops.attention.dsv4.topk`, or SglangTopkUnavailable."""
    try:
        module = importlib.import_module(SGLANG_TOPK_MODULE)
    except Exception as exc:          # ImportError and whatever the JIT utilities raise on import
        raise SglangTopkUnavailable(f"SGLang's DeepSeek-V4 top-k module is not importable: {exc!r}") from exc
    return module


def choose_variant(k: int, variant: str | None = None) -> str:
    """"v1" for k ∈ V1_KS, else "v2"; an explicit `variant` is checked against k."""
    if k < 1:
        raise ValueError(f"select_topk_sglang: k must be ≥ 1, got {k}")
    if k > MAX_K:
        raise SglangTopkUnavailable(f"SGLang's top-k serves k ≤ {MAX_K}, got k = {k}")
    if variant is None:
        return "v1" if k in V1_KS else "v2"
    if variant not in VARIANTS:
        raise ValueError(f"select_topk_sglang: variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "v1" and k not in V1_KS:
        raise SglangTopkUnavailable(f"SGLang's top-k v1 serves k ∈ {V1_KS}, got k = {k} (use v2)")
    return variant


def identity_pages(n: int, e: int, device: torch.device) -> tuple[Tensor, int]:
    """(page table [n, 1] int32 zeros, page size = next power of two ≥ e): SGLang's page
    transform of column i < e is then i."""
    return torch.zeros((n, 1), dtype=torch.int32, device=device), 1 << max(0, (e - 1).bit_length())


def v2_scores(scores: Tensor) -> Tensor:
    """`scores` when v2 can read it (unit column stride, row stride a multiple of 4, 16-byte aligned
    base), else a copy in a buffer whose rows are padded to a multiple of 4 (viewed [N, E])."""
    n, e = scores.shape
    if scores.stride(1) == 1 and scores.stride(0) % 4 == 0 and scores.data_ptr() % 16 == 0:
        return scores
    buf = torch.full((n, -(-e // 4) * 4), float("-inf"), dtype=scores.dtype, device=scores.device)
    buf[:, :e] = scores
    return buf[:, :e]


def seq_lengths(valid_lengths: Tensor | None, n: int, e: int, device: torch.device) -> Tensor:
    """[n] int32 contiguous: `valid_lengths` clamped to [0, e] (SGLang reads them as uint32 and
    must not see negatives), or e for every row."""
    if valid_lengths is None:
        return torch.full((n,), e, dtype=torch.int32, device=device)
    if valid_lengths.shape != (n,) or valid_lengths.is_floating_point() or valid_lengths.device != device:
        raise ValueError(f"select_topk_sglang: valid_lengths must be an integer [{n}] tensor on {device}, got "
                         f"{valid_lengths.dtype} {tuple(valid_lengths.shape)} on {valid_lengths.device}")
    return valid_lengths.clamp(0, e).to(torch.int32).contiguous()


def to_contract(raw: Tensor, scores: Tensor, lens: Tensor, ordered: bool) -> Tensor:
    """SGLang's [N, k] int32 columns → ours: int64, −1 where the column is outside [0, seq_len) or
    its score is −∞; `ordered`: ascending with the −1s last."""
    idx = raw.to(torch.int64)
    inside = (idx >= 0) & (idx < lens.to(torch.int64)[:, None])
    safe = torch.where(inside, idx, 0)
    keep = inside & (scores.gather(1, safe) > float("-inf"))
    if not ordered:
        return torch.where(keep, idx, -1)
    big = torch.iinfo(torch.int64).max
    idx = torch.sort(torch.where(keep, idx, big), dim=1).values
    return torch.where(idx == big, -1, idx)


def topk_with_module(module, scores: Tensor, k: int, *, valid_lengths: Tensor | None = None,
                     variant: str | None = None, ordered: bool = True) -> Tensor:
    """The glue of `select_topk_sglang` on an already loaded SGLang top-k `module` (no device or
    NaN checks: the caller's)."""
    v = choose_variant(k, variant)
    n, e = scores.shape
    if n == 0:
        return torch.empty((0, k), dtype=torch.int64, device=scores.device)
    if e == 0:
        return torch.full((n, k), -1, dtype=torch.int64, device=scores.device)
    lens = seq_lengths(valid_lengths, n, e, scores.device)
    pages, page_size = identity_pages(n, e, scores.device)
    out = torch.empty((n, k), dtype=torch.int32, device=scores.device)
    try:
        if v == "v1":
            s = scores if scores.stride(1) == 1 else scores.contiguous()
            module.topk_transform_512(s, lens, pages, out, page_size)
        else:
            s = v2_scores(scores)
            module.topk_transform_512_v2(s, lens, pages, out, page_size, module.plan_topk_v2(lens))
    except Exception as exc:
        raise SglangTopkUnavailable(f"SGLang's top-k {v} failed (JIT build or launch) at N = {n}, E = {e}, "
                                    f"k = {k}: {exc!r}") from exc
    return to_contract(out, s, lens, ordered)


def select_topk_sglang(scores: Tensor, k: int, *, valid_lengths: Tensor | None = None, check_nan: bool = True,
                       variant: str | None = None, ordered: bool = True) -> Tensor:
    """[N, k] int64: `kernels.indexer_select.select_topk(scores, k)` up to ties (module doc), ranked by
    SGLang's JIT top-k. `valid_lengths` ([N] integer, optional): only columns < valid_lengths[i]
    are ranked (a speed hint where the columns beyond are −∞ anyway). NaN raises (one host sync)
    unless `check_nan=False`. `ordered=False` leaves the chosen columns in SGLang's order (−1
    wherever a slot holds none). Raises SglangTopkUnavailable where it cannot serve (module doc)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise TypeError(f"select_topk_sglang: want a 2-D fp32 score tensor, got {scores.dtype} {tuple(scores.shape)}")
    choose_variant(k, variant)
    if not scores.is_cuda or torch.version.hip is not None:
        raise SglangTopkUnavailable(f"SGLang's JIT top-k needs CUDA tensors, got {scores.device}")
    if check_nan and bool(torch.isnan(scores).any()):
        raise ValueError("select_topk_sglang: NaN score (cannot be ranked)")
    return topk_with_module(sglang_topk_module(), scores, k, valid_lengths=valid_lengths, variant=variant,
                            ordered=ordered)
