"""The FlashMLA prefill opt-in (`runtime/attention_flashmla.py`, SGLANG_DSV41_ATTN_PREFILL=flashmla).

What is pinned, on CPU:
* the start-up plan (native / padded / the Triton workspace path) and the mode rules (refused
  with deterministic inference; the workspace size rules of `bf16`);
* the index construction, tensor-only: every query's kernel indices address exactly the key rows
  the Triton workspace path reads (its SWA window by slot, its selected workspace rows), as a
  multiset, compacted valid-first with `topk_length` = the valid count, padded to 64;
* `KernelAttentionOps`' wiring: a planned flashmla choice hands `attend` the batch's inputs and
  launches the planned kernel (an unplanned one raises);
* the launch as a whole against the Triton path's math (`attend_with_sink`, float64) through a
  test-only pure-torch emulation of `flash_mla_sparse_fwd` (softmax over the indexed keys plus the
  sink, P rounded to BF16 before P·V, BF16 output), within `flashmla_bound`; an index list off by
  one row is outside it; the padded plan (4 heads × 96 → 64 × 512) gives the unpadded result.
On the H200 (`@pytest.mark.gpu`): the real kernel against the Triton workspace kernel at the
Flash shape (8,192 queries × 64 heads × 512, window 128, top-512 of 2,048) within the bound,
with and without `topk_length`.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from sglang_dsv41.numerics.geometry import softmax_scale, swa_key_positions
from sglang_dsv41.runtime import attention_flashmla as FM
from sglang_dsv41.runtime import attention_ops, attention_ops_torch
from sglang_dsv41.runtime import attention_prefill as AP
from sglang_dsv41.runtime.batch import make_layout

HOPPER = (9, 0)


# ---- test-only emulation of the kernel's documented math ----------------------------------------

def emulate_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """flash_mla_sparse_fwd's math in torch (test only): per query and head, softmax over the
    valid indexed keys (−1 or ≥ s_kv = none; beyond topk_length = none) in fp32 with P rounded to
    BF16 before P·V, the sink as an extra logit in the normaliser; BF16 output [s_q, h_q, d_v]."""
    s_kv = kv.shape[0]
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1])[None, :] < topk_length[:, None].long()
    keys = kv[:, 0].float()[idx.clamp(0, s_kv - 1)]                                  # [N, T, D]
    s = torch.einsum("nhd,ntd->nht", q.float(), keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -torch.inf)
    m = s.amax(dim=2).clamp(min=-1e30)
    p = torch.exp(s - m[..., None])
    lsum = p.sum(dim=2)
    num = torch.einsum("nht,ntd->nhd", p.to(torch.bfloat16).float(), keys[..., :d_v])
    o = num / lsum.clamp(min=1e-30)[..., None]
    if attn_sink is not None:
        lse = m + torch.log(lsum.clamp(min=1e-30))
        o = o / (1 + torch.exp(attn_sink.float()[None, :] - lse))[..., None]
    return o.to(torch.bfloat16), m, lse / torch.log(torch.tensor(2.0))


# ---- a batch ----------------------------------------------------------------------------------

def _batch(prefix, extend, window, width, topk, seed=0, heads=8, dim=64):
    """A checked layout of requests with `prefix` / `extend` lengths, SWA slots through a random
    full → SWA slot map, a random BF16 SWA cache and workspace, random ascending selections of
    visible compressed positions (ratio 4), q and sink."""
    g = torch.Generator().manual_seed(seed)
    R, C = len(prefix), 4096
    req_to_token = (2 + torch.arange(R * C).view(R, C)).to(torch.int32)
    pl, el = torch.tensor(prefix), torch.tensor(extend)
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
    token_req = torch.repeat_interleave(torch.arange(R), el)
    slots = req_to_token[token_req, pos].long()
    layout = make_layout(torch.arange(R), pl, el, pos, slots, req_to_token)
    swa_slot_of = torch.randperm(R * C + 2, generator=g) + 1
    win = swa_key_positions(pos, window)
    full = torch.where(win >= 0, layout.slots_at(layout.token_req[:, None].expand_as(win), win.clamp(min=0)), -1)
    swa_slots = torch.where(full >= 0, swa_slot_of[full.clamp(min=0)], -1)
    swa_cache = torch.randn(R * C + 3, dim, generator=g).to(torch.bfloat16)
    workspace = torch.randn(R * width, dim, generator=g).to(torch.bfloat16)
    n_vis = ((pos + 1) // 4).clamp(max=width)
    sel = torch.full((pos.numel(), topk), -1, dtype=torch.int64)
    for t in range(pos.numel()):
        k = min(topk, int(n_vis[t]))
        sel[t, :k] = torch.sort(torch.randperm(int(n_vis[t]), generator=g)[:k]).values
    comp_rows = AP.workspace_rows(layout.token_req, sel, width)
    q = torch.randn(pos.numel(), heads, dim, generator=g).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    return layout, swa_slots, swa_cache, workspace, comp_rows, q, sink


CASES = {"one_request": ([0], [300]), "prefixes": ([0, 5, 200, 3], [70, 40, 33, 1])}


def _triton_semantics(q, sink, swa_cache, swa_slots, workspace, comp_rows):
    """The Triton workspace path's math: `attend_with_sink` (float64, rounded once) over the
    window rows by slot then the workspace rows."""
    sk, sv = attention_ops_torch.gather_rows(swa_cache, swa_slots)
    ck, cv = attention_ops_torch.gather_rows(workspace, comp_rows)
    return attention_ops_torch.attend_with_sink(q.float(), torch.cat((sk, ck), 1), sink, torch.cat((sv, cv), 1))


# ---- plan and mode ------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,dim,cap,mode", [(64, 512, HOPPER, "native"), (128, 512, (10, 0), "native"),
                                                (32, 512, HOPPER, "padded"), (4, 96, HOPPER, "padded"),
                                                (96, 512, HOPPER, "padded"), (256, 512, HOPPER, "bf16"),
                                                (64, 576, HOPPER, "bf16"), (64, 512, (8, 0), "bf16"),
                                                (64, 512, None, "bf16")])
def test_plan(heads, dim, cap, mode) -> None:
    plan = FM.plan_flashmla(heads, dim, cap)
    assert plan.mode == mode, plan
    assert plan.kernel_heads in FM.KERNEL_HEADS or mode == "bf16"
    assert plan.kernel_heads == (64 if heads <= 64 else 128) or mode == "bf16"


def test_mode_rules(monkeypatch) -> None:
    """flashmla is a workspace choice (the same size rules); refused with deterministic inference."""
    big = AP.PREFILL_MIN_QUERIES
    assert AP.applies("flashmla", big, 1, 4096) and not AP.applies("flashmla", big, 64, 4096)
    assert not AP.applies("flashmla", big - 1, 1, 4096)
    monkeypatch.setenv(AP.PREFILL_ENV, "flashmla")
    assert AP.prefill_choice(False) == "flashmla"
    with pytest.raises(ValueError, match="deterministic"):
        AP.prefill_choice(True)
    from sglang_dsv41.kernels import indexer, sparse_attention
    with pytest.raises(ValueError, match="deterministic"):
        attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="flashmla", deterministic=True)


def test_planned_on_a_device_without_the_kernel_is_the_logged_triton_path(caplog) -> None:
    from sglang_dsv41.kernels import indexer, sparse_attention
    ops = attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="flashmla")
    with caplog.at_level(logging.WARNING, logger=attention_ops.__name__):
        chosen = ops.planned(64, 512, torch.device("cpu"))
    assert chosen.prefill == "wide" and chosen.decode == "auto" and chosen.flashmla_plan is None
    assert "planned the Triton kernels instead" in caplog.text
    other = attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="bf16", decode="triton")
    assert other.planned(64, 512, torch.device("cpu")) is other
    auto = attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="bf16", decode="auto")
    assert auto.planned(64, 512, torch.device("cpu")) is auto
    dec = attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="bf16", decode="flashmla")
    chosen = dec.planned(64, 512, torch.device("cpu"))
    assert (chosen.prefill, chosen.decode, chosen.flashmla_plan) == ("bf16", "triton", None)


def test_decode_choice_rules(monkeypatch) -> None:
    """SGLANG_DSV41_ATTN_DECODE: `auto` by default in serving mode (never plans FlashMLA), `triton` with
    deterministic inference; `flashmla` read from the variable, an unknown value and `flashmla` with
    deterministic inference refused; a planned decode choice keeps the prefill choice it was given."""
    from sglang_dsv41.kernels import indexer, sparse_attention
    monkeypatch.delenv(attention_ops.ATTENTION_DECODE_ENV, raising=False)
    auto = attention_ops.KernelAttentionOps(sparse_attention, indexer)
    assert auto.decode == "auto" and auto.planned(64, 512, torch.device("cuda")) is auto
    assert attention_ops.KernelAttentionOps(sparse_attention, indexer, deterministic=True).decode == "triton"
    monkeypatch.setenv(attention_ops.ATTENTION_DECODE_ENV, "triton")
    assert attention_ops.KernelAttentionOps(sparse_attention, indexer).decode == "triton"
    monkeypatch.setenv(attention_ops.ATTENTION_DECODE_ENV, "flashmla")
    assert attention_ops.KernelAttentionOps(sparse_attention, indexer).decode == "flashmla"
    with pytest.raises(ValueError, match="deterministic"):
        attention_ops.KernelAttentionOps(sparse_attention, indexer, deterministic=True)
    monkeypatch.setenv(attention_ops.ATTENTION_DECODE_ENV, "cutlass")
    with pytest.raises(ValueError, match="cutlass"):
        attention_ops.KernelAttentionOps(sparse_attention, indexer)
    monkeypatch.delenv(attention_ops.ATTENTION_DECODE_ENV)
    ops = attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="bf16", decode="flashmla")
    monkeypatch.setattr(FM, "load_kernel", lambda: emulate_sparse_fwd)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)
    chosen = ops.planned(64, 512, torch.device("cuda"))
    assert (chosen.prefill, chosen.decode, chosen.flashmla_kernel) == ("bf16", "flashmla", emulate_sparse_fwd)
    assert chosen.flashmla_plan.mode == "native"


def test_flashmla_decode_launches_only_for_its_query_counts(monkeypatch) -> None:
    """A planned flashmla decode launches FlashMLA for 2..256 queries (FLASHMLA_DECODE_QUERIES); one
    query and larger batches take the Triton kernel."""
    from types import SimpleNamespace

    from sglang_dsv41.kernels import indexer
    assert attention_ops.FLASHMLA_DECODE_QUERIES == range(2, 257)

    class TritonPath(Exception):
        """Raised by the stand-in Triton plan: the call took the Triton kernel."""

    def triton_path(*args, **kwargs):
        raise TritonPath

    stub = SimpleNamespace(plan_decode_config=triton_path, device_sm_count=lambda device: 132,
                           plan_config=triton_path)
    ops = attention_ops.KernelAttentionOps(stub, indexer, prefill="bf16", decode="flashmla")
    ops.flashmla_plan, ops.flashmla_kernel = SimpleNamespace(), object()
    launched = []
    monkeypatch.setattr(FM, "decode_attend", lambda *a: launched.append(a[2].shape[0]) or a[2])
    swa = torch.zeros(4, 512, dtype=torch.bfloat16)
    for n, flashmla in ((1, False), (2, True), (256, True), (257, False)):
        q = torch.zeros(n, 64, 512, dtype=torch.bfloat16)
        slots = torch.zeros(n, 2, dtype=torch.long)
        if flashmla:
            ops.attend(q, torch.zeros(64), swa, slots, None, None)
        else:
            with pytest.raises(TritonPath):
                ops.attend(q, torch.zeros(64), swa, slots, None, None)
    assert launched == [2, 256]


@pytest.mark.parametrize("choice", ["auto", "gather", "triton"])
def test_decode_rows_by_choice_and_query_count(choice: str, monkeypatch) -> None:
    """Decode batches (no workspace) with compressed entries: `auto` (the serving default) decodes the
    entries into BF16 rows for 1..GATHER_DECODE_MAX_QUERIES (256) queries, read by the `wide` kernel from
    WIDE_DECODE_MIN_QUERIES (2) queries on, and reads the packed rows above; `gather` always, `triton`
    never. Either way one attention launch."""
    from types import SimpleNamespace

    from sglang_dsv41.kernels import indexer, key_gather
    assert attention_ops.GATHER_DECODE_MAX_QUERIES == 256
    gathered, read = [], []
    monkeypatch.setattr(key_gather, "gather_latent_rows", lambda comp, entries: gathered.append(entries.shape[0])
                        or ("bf16-rows", entries))
    stub = SimpleNamespace(plan_decode_config=lambda *a, **k: "plan", device_sm_count=lambda device: 132,
                           sparse_sink_attention=lambda q, swa, slots, comp, entries, sink, scale, config:
                           read.append(comp) or torch.zeros_like(q))
    ops = attention_ops.KernelAttentionOps(stub, indexer, prefill="bf16", decode=choice)
    ops._wide = SimpleNamespace(plan_decode=lambda *a: "plan", prefill_sink_attention=lambda q, swa, slots, comp,
                                entries, sink, scale, config: read.append(("wide", comp)) or torch.zeros_like(q))
    monkeypatch.setattr(ops, "_packed_latents", lambda packed: "packed-rows")
    swa = torch.zeros(4, 512, dtype=torch.bfloat16)
    for n in (1, 8, 256, 257):
        q = torch.zeros(n, 2, 512, dtype=torch.bfloat16)
        ops.attend(q, torch.zeros(2), swa, torch.zeros(n, 2, dtype=torch.long), object(), torch.zeros(n, 4, dtype=torch.int32))
    want = {"auto": [1, 8, 256], "gather": [1, 8, 256, 257], "triton": []}[choice]
    assert gathered == want
    rows = ["bf16-rows" if n in want else "packed-rows" for n in (1, 8, 256, 257)]
    if choice == "auto":
        rows[1:3] = [("wide", "bf16-rows")] * 2
    assert read == rows


def test_decode_rows_are_gathered_once_per_source_and_entries_in_a_forward(monkeypatch) -> None:
    """With a forward's `memo`, layers passing the same kv source and the same entries tensor (one
    selection shared by several layers, `ForwardScratch.comp_entries`) read the rows the first one
    gathered; another source, another entries tensor or no memo gathers again."""
    from types import SimpleNamespace

    from sglang_dsv41.kernels import indexer, key_gather
    gathered, read = [], []
    monkeypatch.setattr(key_gather, "gather_latent_rows",
                        lambda comp, entries: gathered.append((comp, id(entries))) or (f"rows{len(gathered)}", entries))
    stub = SimpleNamespace(plan_decode_config=lambda *a, **k: "plan", device_sm_count=lambda device: 132,
                           sparse_sink_attention=lambda q, swa, slots, comp, entries, sink, scale, config:
                           read.append(comp) or torch.zeros_like(q))
    ops = attention_ops.KernelAttentionOps(stub, indexer, prefill="bf16", decode="gather")
    monkeypatch.setattr(ops, "_packed_latents", lambda packed: f"latents{packed.source.layer}")
    swa, q, slots = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(2, 2, 512), torch.zeros(2, 2, dtype=torch.long)
    source = {s: SimpleNamespace(source=SimpleNamespace(layer=s)) for s in (2, 8)}
    entries, other = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    memo: dict = {}
    for packed, e in ((source[2], entries), (source[2], entries), (source[8], entries), (source[2], other),
                      (source[8], entries)):
        ops.attend(q, torch.zeros(2), swa, slots, packed, e, memo=memo)
    assert [c for c, _ in gathered] == ["latents2", "latents8", "latents2"]
    assert read == ["rows1", "rows1", "rows2", "rows3", "rows2"]
    ops.attend(q, torch.zeros(2), swa, slots, source[2], entries)                     # no memo: gathers
    assert len(gathered) == 4


def test_compressed_entries_are_made_once_per_selection_and_ratio() -> None:
    """`attention._compressed_entries`: layers reading one selection at one ratio get the same tensor
    (the entries of their slots // ratio); another selection layer gets its own."""
    from types import SimpleNamespace

    from sglang_dsv41.runtime.attention import ForwardScratch, _compressed_entries
    from sglang_dsv41.runtime.backend import FastTorchBackend
    from sglang_dsv41.runtime.batch import make_layout
    table = torch.arange(64, dtype=torch.int32).view(1, 64) + 128
    layout = make_layout(torch.tensor([0]), torch.tensor([10]), torch.tensor([2]), torch.tensor([10, 11]),
                         table[0, 10:12].long(), table)
    selection = torch.tensor([[0, 2, -1], [1, 4, -1]])
    scratch = ForwardScratch()
    role = lambda layer, src: SimpleNamespace(layer=layer, selection_from=src, ratio=2)      # noqa: E731
    be = FastTorchBackend()
    first = _compressed_entries(be, role(2, 2), selection, layout, scratch)
    assert torch.equal(first, torch.tensor([[64, 66, -1], [65, 68, -1]]))        # slot(2j + 1) // 2
    assert _compressed_entries(be, role(3, 2), selection, layout, scratch) is first
    assert _compressed_entries(be, role(9, 8), selection.clone(), layout, scratch) is not first


def test_unplanned_flashmla_decode_raises() -> None:
    from sglang_dsv41.kernels import indexer, sparse_attention
    ops = attention_ops.KernelAttentionOps(sparse_attention, indexer, decode="flashmla")
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not planned"):
        ops.attend(q, torch.zeros(64), torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.long),
                   None, None)


def test_kernel_ops_wiring(monkeypatch) -> None:
    """`KernelAttentionOps` with a planned flashmla choice: `prefill_workspace` returns the batch's
    `FlashMLAInputs` over the forward's workspace (unplanned: raises, never the Triton path), and
    `attend` launches the planned kernel on them (here the emulation) instead of the Triton kernel."""
    from types import SimpleNamespace

    from sglang_dsv41.kernels import indexer, sparse_attention
    monkeypatch.setattr(AP, "PREFILL_MIN_QUERIES", 1)
    width, ratio = 16, 4
    layout, swa_slots, swa_cache, workspace, comp_rows, q, sink = _batch([0, 5], [40, 24], 8, width, 8, dim=512)
    sel = torch.where(comp_rows >= 0, comp_rows - layout.token_req[:, None] * width, -1)
    scratch = SimpleNamespace(workspaces={3: workspace}, entry_tables={})
    layout = dataclasses.replace(layout, max_seq_len=width * ratio)     # width = max_seq_len // ratio
    ops = attention_ops.KernelAttentionOps(sparse_attention, indexer, prefill="flashmla")
    with pytest.raises(RuntimeError, match="not planned"):
        ops.prefill_workspace(layout, None, 3, ratio, sel, scratch, swa_slots)
    ops.flashmla_plan, ops.flashmla_kernel = FM.plan_flashmla(8, 512, HOPPER), emulate_sparse_fwd
    got = ops.prefill_workspace(layout, None, 3, ratio, sel, scratch, swa_slots)
    want = FM.prefill_inputs(workspace, layout.token_req, layout.starts, swa_slots, comp_rows)
    assert isinstance(got, FM.FlashMLAInputs) and got.workspace is workspace
    for name in ("swa_gather", "indices", "lengths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    monkeypatch.setattr(sparse_attention, "sparse_sink_attention", None)      # the Triton kernel is not called
    o = ops.attend(q.float(), sink, swa_cache, swa_slots, None, None, workspace=got)
    assert o.dtype == torch.bfloat16                                          # the kernel's BF16, not widened
    assert torch.equal(o, FM.attend(emulate_sparse_fwd, ops.flashmla_plan, q, sink, swa_cache, want,
                                    softmax_scale(512)))


# ---- index construction -------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 8, 128])
def test_indices_address_the_triton_paths_rows(case, window) -> None:
    """Per query, the rows of [SWA block | workspace] the kernel indices address == the rows the
    Triton path reads (its window by slot, its selected workspace rows), as multisets; compacted
    valid-first, −1 after, width a multiple of 128 (the SM90 kernel asserts topk % (2·64) == 0), lengths = valid counts, int32."""
    prefix, extend = CASES[case]
    layout, swa_slots, swa_cache, workspace, comp_rows, *_ = _batch(prefix, extend, window, 64, 16)
    inputs = FM.prefill_inputs(workspace, layout.token_req, layout.starts, swa_slots, comp_rows)
    M = inputs.swa_gather.numel()
    assert M == layout.num_tokens + layout.num_requests * (window - 1)
    idx = inputs.indices[:, 0].long()
    assert inputs.indices.dtype == torch.int32 and inputs.lengths.dtype == torch.int32
    assert idx.shape[1] % 128 == 0 and idx.shape[1] >= window + 16
    n = inputs.lengths.long()
    cols = torch.arange(idx.shape[1])[None, :]
    assert bool(((idx >= 0) == (cols < n[:, None])).all())                 # valid first, then −1 only
    assert torch.equal(n, (swa_slots >= 0).sum(1) + (comp_rows >= 0).sum(1))
    # identity of a kv row: ("swa", slot) or ("ws", row)
    for t in range(layout.num_tokens):
        got = sorted(("swa", int(inputs.swa_gather[r])) if r < M else ("ws", r - M) for r in idx[t, :n[t]].tolist())
        want = sorted([("swa", int(s)) for s in swa_slots[t] if s >= 0] + [("ws", int(r)) for r in comp_rows[t] if r >= 0])
        assert got == want, t


def test_combined_indices_pads_and_keeps_order() -> None:
    swa = torch.tensor([[-1, -1, 0, 1], [2, 3, 4, 5]])
    comp = torch.tensor([[0, 2, -1], [-1, -1, -1]])
    idx, n = FM.combined_indices(swa, comp, 10)
    assert idx.shape == (2, 1, 128) and n.tolist() == [4, 4]
    assert idx[0, 0, :5].tolist() == [0, 1, 10, 12, -1] and idx[1, 0, :5].tolist() == [2, 3, 4, 5, -1]
    assert bool((idx[:, :, 5:] == -1).all())
    # 130 columns (an odd multiple of 64 would fail the kernel's assertion) round up to 256
    wide, _ = FM.combined_indices(torch.zeros(1, 70, dtype=torch.long), torch.zeros(1, 60, dtype=torch.long), 10)
    assert wide.shape == (1, 1, 256)


# ---- the launch against the Triton path's math --------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("use_lengths", [True, False])
def test_emulated_launch_within_the_bound_of_the_triton_math(case, use_lengths) -> None:
    prefix, extend = CASES[case]
    layout, swa_slots, swa_cache, workspace, comp_rows, q, sink = _batch(prefix, extend, 8, 64, 16, dim=512)
    inputs = FM.prefill_inputs(workspace, layout.token_req, layout.starts, swa_slots, comp_rows)
    plan = FM.plan_flashmla(q.shape[1], q.shape[2], HOPPER)
    got = FM.attend(emulate_sparse_fwd, plan, q, sink, swa_cache, inputs, softmax_scale(512), use_lengths).float()
    want = _triton_semantics(q, sink, swa_cache, swa_slots, workspace, comp_rows)
    kv = FM.key_rows(swa_cache, inputs)[:, 0].float()
    idx = inputs.indices[:, 0].long()
    key_max = torch.where(idx >= 0, kv.abs().amax(1)[idx.clamp(min=0)], 0.0).amax(1)        # [N]
    bound = FM.flashmla_bound(key_max[:, None, None], want.abs().amax(-1, keepdim=True))
    err = (got - want).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0                                             # P really is rounded
    # an index list one SWA row off is outside the bound
    shifted = FM.FlashMLAInputs(inputs.workspace, inputs.swa_gather.roll(1), inputs.indices, inputs.lengths)
    wrong = FM.attend(emulate_sparse_fwd, plan, q, sink, swa_cache, shifted, softmax_scale(512)).float()
    assert not bool(((wrong - want).abs() <= bound).all())


def test_padded_plan_gives_the_unpadded_result() -> None:
    """4 heads × 96 dims run padded to 64 × 512: the kept heads and dims equal the emulation at
    the model's own shape (zero dims add nothing to q·k; zero heads are dropped)."""
    layout, swa_slots, swa_cache, workspace, comp_rows, q, sink = _batch([3], [40], 8, 16, 8, heads=4, dim=96)
    inputs = FM.prefill_inputs(workspace, layout.token_req, layout.starts, swa_slots, comp_rows)
    plan = FM.plan_flashmla(4, 96, HOPPER)
    assert (plan.mode, plan.kernel_heads) == ("padded", 64)
    got = FM.attend(emulate_sparse_fwd, plan, q, sink, swa_cache, inputs, softmax_scale(96))
    assert got.shape == q.shape
    kv = FM.key_rows(swa_cache, inputs, dim=96)
    want = emulate_sparse_fwd(q, kv, inputs.indices, softmax_scale(96), 96, sink, inputs.lengths)[0]
    assert torch.equal(got, want)


# ---- H200: the real kernel against the Triton workspace kernel ----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("use_lengths", [True, False])
def test_gpu_flashmla_matches_the_triton_workspace_path_at_the_flash_shape(use_lengths) -> None:
    """One 8,192-token request, 64 heads × 512, window 128, top-512 of 2,048 workspace rows
    (ratio 4), random BF16 rows: FlashMLA within `flashmla_bound` of `sparse_sink_attention` on
    the same workspace (`plan_prefill_config`, as the `bf16` choice launches it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sglang_dsv41.kernels import sparse_attention as SA
    dev = torch.device("cuda")
    plan = FM.plan_flashmla(64, 512, torch.cuda.get_device_capability(dev))
    assert plan.mode == "native", plan
    kernel = FM.load_kernel()
    N, H, D, W, K, width = 8192, 64, 512, 128, 512, 2048
    g = torch.Generator(device=dev).manual_seed(0)
    pos = torch.arange(N, device=dev)
    req = torch.zeros(N, dtype=torch.int64, device=dev)
    win = swa_key_positions(pos, W)
    swa_slots = torch.where(win >= 0, win + 2, -1)
    swa_cache = torch.randn(N + 2, D, generator=g, device=dev).to(torch.bfloat16)
    workspace = torch.randn(width, D, generator=g, device=dev).to(torch.bfloat16)
    n_vis = ((pos + 1) // 4).clamp(max=width)
    score = torch.rand(N, width, generator=g, device=dev).masked_fill(
        torch.arange(width, device=dev)[None, :] >= n_vis[:, None], -1.0)
    top = torch.topk(score, K, dim=1)
    sel = torch.sort(torch.where(top.values >= 0, top.indices, width + 1), dim=1).values
    sel = torch.where(sel > width, -1, sel)
    comp_rows = AP.workspace_rows(req, sel, width)
    q = (torch.randn(N, H, D, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    sink = torch.randn(H, generator=g, device=dev)
    scale = softmax_scale(D)
    want = SA.sparse_sink_attention(q, swa_cache, swa_slots, workspace, comp_rows, sink, scale,
                                    config=SA.plan_prefill_config(N, H, D, W, K)).float()
    inputs = FM.prefill_inputs(workspace, req, torch.zeros(1, dtype=torch.int64, device=dev), swa_slots, comp_rows)
    got = FM.attend(kernel, plan, q, sink, swa_cache, inputs, scale, use_lengths).float()
    kv = FM.key_rows(swa_cache, inputs)[:, 0]
    idx = inputs.indices[:, 0].long()
    key_max = torch.where(idx >= 0, kv.float().abs().amax(1)[idx.clamp(min=0)], 0.0).amax(1)
    bound = FM.flashmla_bound(key_max[:, None, None], want.abs().amax(-1, keepdim=True))
    err = (got - want).abs()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126))) - 7)
    print(f"\nflashmla vs triton (topk_length {use_lengths}): max |Δ| {float(err.max()):.3e}, max |Δ|/bound "
          f"{float((err / bound).max()):.3f}, max |Δ| in output-scale ulps {float((err / ulp).max()):.2f}, "
          f"equal fraction {float((err == 0).float().mean()):.4f}")
    assert bool(torch.isfinite(got).all())
    assert bool((err <= bound).all()), float((err / bound).max())
