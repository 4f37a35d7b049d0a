"""Device dispatch of the runtime's attention and indexer (`runtime/attention_ops.py`) — on CPU.

What is pinned:
* CPU → the torch path; CUDA → the Triton kernels (the real kernel functions); a kernel module
  that cannot be imported, or kernels built for Triton's interpreter, make CUDA raise (no torch
  fallback), while CPU is unaffected; other devices raise; a model picks its implementations
  once, at construction.
* The CUDA implementation's whole-batch orchestration (window SWA slots, the kernel's
  `PackedSource` of the layer's kv source with entry indices, sink, scale and the
  batch-invariant launch config; the indexer's packed entry-index table, visibility,
  published blocks per query, query chunks of the score matrix, `select_for_role`) runs on CPU
  with the two Triton entry points replaced by exact torch stand-ins: the packed scenarios
  (`runtime_scenarios.py`) give the CPU path's logits bit for bit.
* The real Triton kernels under Triton's CPU interpreter, in a child process (TRITON_INTERPRET
  must be set before triton is first imported): the per-sublayer tests of
  `tests/test_runtime_forward_gpu.py` (attention within one BF16 ulp of the output scale,
  selections equal, on identical inputs of every layer of the packed scenarios) pass on CPU
  tensors — the GPU file's code and the kernels' argument plumbing checked before a GPU run.
"""
from __future__ import annotations

import collections
import math
import re
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import child_runs
from runtime_scenarios import fixed_decode_tokens, run_scenario, scenario_caches
from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.kernels import entry_index as kernel_entry_index
from sglang_dsv41.kernels import indexer as kernel_indexer
from sglang_dsv41.kernels import indexer_select as kernel_select
from sglang_dsv41.kernels import sparse_attention as kernel_attention
from sglang_dsv41.kernels import sparse_attention_prefill as kernel_prefill_attention
from sglang_dsv41.numerics.geometry import softmax_scale
from sglang_dsv41.numerics.rounding import bf16
from sglang_dsv41.runtime import attention_ops, attention_ops_torch, attention_prefill, moe_ops
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.mhc_ops import TorchMhc
from packed_rows_codec import kernel_source_as_runtime_rows
from sglang_dsv41.runtime.forward import TorchForward

CPU = torch.device("cpu")
DEFAULT_CHUNK = attention_ops.SCORE_ELEMENTS_PER_CHUNK


@pytest.fixture
def fresh_kernel_ops():
    """`kernel_ops` is cached per process: start and end every dispatch test uncached."""
    attention_ops.kernel_ops.cache_clear()
    yield
    attention_ops.kernel_ops.cache_clear()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> tuple[DeepseekV41Config, TorchForward]:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return cfg, TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map))


# ---- dispatch ----------------------------------------------------------------------------------

def test_cpu_uses_the_torch_path() -> None:
    assert attention_ops.ops_for(CPU) is attention_ops.TORCH_OPS
    assert isinstance(attention_ops_torch.TORCH_OPS, attention_ops_torch.TorchAttentionOps)

def test_cuda_tensors_use_the_triton_kernels(fresh_kernel_ops) -> None:
    ops = attention_ops.ops_for(torch.device("cuda"))
    assert isinstance(ops, attention_ops.KernelAttentionOps)
    assert ops.sparse_attention.sparse_sink_attention is kernel_attention.sparse_sink_attention
    assert ops.indexer.index_scores is kernel_indexer.index_scores
    assert ops.indexer_select.select_indices is kernel_select.select_indices
    assert ops.entry_index.entry_index_table is kernel_entry_index.entry_index_table
    assert attention_ops.ops_for(torch.device("cuda", 0)) is ops      # loaded once
    exact = attention_ops.ops_for(torch.device("cuda"), torch.float32, deterministic=True)
    assert (ops.deterministic, ops.splits, exact.deterministic, exact.splits) == (False, "decode", True, "one")
    assert attention_ops.ops_for(torch.device("cuda"), deterministic=True) is exact

def test_prefill_defaults_by_device_and_mode(fresh_kernel_ops, monkeypatch) -> None:
    """Session 13's defaults: CUDA serving → the BF16 prefill workspace and BF16-weight rows in one
    GEMM (on the activation as given since session 35); `--enable-deterministic-inference` → packed rows
    and 128-row blocks; CPU unchanged (the torch attention, never a workspace; the torch backends have
    no BF16 GEMM rows); the variables override the mode (whole rows never with deterministic)."""
    from sglang_dsv41.runtime import backend as B
    from sglang_dsv41.runtime.attention_prefill import PREFILL_ENV

    cuda, f32 = torch.device("cuda"), torch.float32
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    monkeypatch.delenv(B.BF16_GEMM_ENV, raising=False)
    serving, exact = attention_ops.ops_for(cuda, f32, False), attention_ops.ops_for(cuda, f32, True)
    assert (serving.prefill, exact.prefill) == ("wide", "packed")
    assert (B.bf16_gemm_for(False), B.bf16_gemm_for(True)) == ("direct", "blocked")
    serving_dense, exact_dense = B.backend_for(cuda, {}, False).dense, B.backend_for(cuda, {}, True).dense
    assert serving_dense.whole_rows and serving_dense.unpadded and not serving_dense.triton_rows
    assert not exact_dense.whole_rows and not exact_dense.unpadded and not exact_dense.triton_rows
    for deterministic in (False, True):                                        # CPU: as before session 13
        ops = attention_ops.ops_for(CPU, f32 if not deterministic else torch.float64, deterministic)
        assert isinstance(ops, attention_ops_torch.TorchAttentionOps)
        assert ops.prefill_workspace(None, None, 2, 2, None, None) is None
        assert not hasattr(B.backend_for(CPU, {}, deterministic), "dense")
    monkeypatch.setenv(PREFILL_ENV, "packed")
    monkeypatch.setenv(B.BF16_GEMM_ENV, "blocked")
    attention_ops.kernel_ops.cache_clear()
    assert attention_ops.ops_for(cuda, f32, False).prefill == "packed" and B.bf16_gemm_for(False) == "blocked"
    assert not B.backend_for(cuda, {}, False).dense.whole_rows
    monkeypatch.setenv(PREFILL_ENV, "bf16")
    monkeypatch.setenv(B.BF16_GEMM_ENV, "triton")
    assert B.backend_for(cuda, {}, False).dense.triton_rows
    monkeypatch.setenv(B.BF16_GEMM_ENV, "whole")
    whole = B.backend_for(cuda, {}, False).dense
    assert whole.whole_rows and not whole.unpadded and not whole.triton_rows
    attention_ops.kernel_ops.cache_clear()
    assert attention_ops.ops_for(cuda, f32, True).prefill == "bf16"             # an explicit choice wins
    with pytest.raises(ValueError, match="not row invariant"):
        B.backend_for(cuda, {}, True)


@pytest.mark.parametrize("missing", sorted(attention_ops.KERNEL_MODULES.values()))
def test_missing_kernel_on_cuda_raises(fresh_kernel_ops, monkeypatch, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)                   # import → ImportError
    with pytest.raises(RuntimeError, match=re.escape(missing)):
        attention_ops.ops_for(torch.device("cuda"))
    assert attention_ops.ops_for(CPU) is attention_ops.TORCH_OPS  # CPU does not need them

def test_interpreter_built_kernels_refused_on_cuda(fresh_kernel_ops, monkeypatch) -> None:
    monkeypatch.setattr(kernel_indexer, "INTERPRETED", True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        attention_ops.ops_for(torch.device("cuda"))

def test_other_devices_raise() -> None:
    with pytest.raises(RuntimeError, match="no attention implementation for device 'meta'"):
        attention_ops.ops_for(torch.device("meta"))

def test_model_picks_its_implementations_once_by_device(engine) -> None:
    _, forward = engine
    assert isinstance(forward.backend, ExactTorchBackend) and forward.attention_ops is attention_ops.TORCH_OPS
    assert isinstance(forward.mhc, TorchMhc) and forward.moe is moe_ops._moe_cpu

# ---- the CUDA orchestration with exact stand-ins for the two Triton entry points ----------

def _exact_sparse_sink_attention(calls: list[str]):
    def sparse_sink_attention(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, *, config):
        assert q.dtype == torch.bfloat16 and sink.dtype == torch.float32 and config.num_splits == 1
        assert scale == softmax_scale(q.shape[-1]) and swa_slots.shape[:1] == q.shape[:1]
        calls.append("attend")
        packed = None
        if isinstance(comp_cache, torch.Tensor):    # the prefill workspace: BF16 rows by row index
            assert comp_cache.dtype == torch.bfloat16 and comp_slots.shape[0] == q.shape[0]
            calls.append("workspace")
            keys, valid = attention_ops_torch.gather_rows(swa_cache, swa_slots)
            c_keys, c_valid = attention_ops_torch.gather_rows(comp_cache, comp_slots)
            o = attention_ops_torch.attend_with_sink(q.float(), torch.cat((keys, c_keys), dim=1), sink,
                                               torch.cat((valid, c_valid), dim=1))
            return o.to(torch.bfloat16)
        if comp_cache is not None:                  # the kernel's PackedSource → the runtime's decoder
            assert isinstance(comp_cache, kernel_attention.PackedSource) and comp_slots.shape[0] == q.shape[0]
            assert comp_cache.part == "latent"
            packed = kernel_source_as_runtime_rows(comp_cache)
        o = attention_ops_torch.TORCH_OPS.attend(q.float(), sink, swa_cache, swa_slots, packed, comp_slots)
        return o.to(torch.bfloat16)
    return sparse_sink_attention

def _exact_index_scores(calls: list[str]):
    def index_scores(q, head_w, key_cache, entry_slots, token_req, n_visible, *, head_sum_exact, check_inputs,
                     tile_cache=None, grouped_queries=False, fill_invisible=True):
        """The kernel's contract: bf16(Σ_h bf16(w·ReLU(bf16(dot)))), dots and head sum in float64
        (reference `index_scores` per query); `fill_invisible=False`: NaN past each query's visibility."""
        assert head_sum_exact and not check_inputs
        assert grouped_queries and bool((token_req[1:] >= token_req[:-1]).all())     # a layout's: non-decreasing
        calls.append("scores")
        slots = entry_slots[token_req]                                    # [N, E] entry indices / workspace rows
        if isinstance(key_cache, torch.Tensor):                           # the prefill key workspace: BF16 rows
            assert key_cache.dtype == torch.bfloat16
            calls.append("key_workspace_scores")
            keys = key_cache[slots.clamp(min=0)].double()
        else:
            assert key_cache.part == "key"                                # the kernel's PackedSource → our decoder
            packed = kernel_source_as_runtime_rows(key_cache)
            keys = packed.keys(slots.reshape(-1)).reshape(*slots.shape, -1).double()   # [N, E, Di]
        dots = bf16(torch.einsum("thd,ted->the", q.double(), keys).float())
        terms = bf16(torch.relu(dots) * head_w.float().unsqueeze(-1))
        scores = bf16(terms.double().sum(dim=1).float()) + 0.0
        seen = torch.arange(slots.shape[1])[None, :] < n_visible[:, None]
        scores = torch.where(seen & (slots >= 0), scores, -math.inf)
        return scores if fill_invisible else torch.where(seen, scores, math.nan)
    return index_scores

def _counted(calls: list[str], name: str, fn):
    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return counted


@pytest.fixture(scope="module")
def cpu_scenario_logits(engine) -> dict[str, torch.Tensor]:
    _, forward = engine
    return run_scenario(forward, scenario_caches(forward, CPU), CPU, fixed_decode_tokens())


@pytest.mark.parametrize("chunk_elements, prefill, keys", [(DEFAULT_CHUNK, "packed", "packed"),
                                                           (150, "packed", "packed"), (DEFAULT_CHUNK, "bf16", "packed"),
                                                           (DEFAULT_CHUNK, "wide", "bf16"), (DEFAULT_CHUNK, "heads", "bf16"),
                                                           (150, "packed", "bf16")])
def test_kernel_orchestration_with_exact_stand_ins_equals_cpu_path(engine, cpu_scenario_logits, monkeypatch,
                                                                   chunk_elements: int, prefill: str, keys: str) -> None:
    """… also with the prefill workspace (SGLANG_DSV41_ATTN_PREFILL=bf16, every eager batch taking it
    here): compressed keys read as BF16 rows of the decoded workspace by request-local position
    give the same logits as the packed entries; `wide` hands the same workspace to
    `kernels.sparse_attention_prefill.prefill_sink_attention` (its stand-in here) instead; with the
    indexer's keys from the BF16 key workspace (SGLANG_DSV41_INDEXER_PREFILL_KEYS=bf16, decoded once per
    kv source and forward) the scores, so the logits, are the same."""
    cfg, forward = engine
    want = cpu_scenario_logits
    calls: list[str] = []
    monkeypatch.setenv("SGLANG_DSV41_ATTN_PREFILL", prefill)
    monkeypatch.setenv("SGLANG_DSV41_INDEXER_PREFILL_KEYS", keys)
    monkeypatch.setattr(attention_ops.AP, "PREFILL_MIN_QUERIES", 1)
    workspaces: list = []
    monkeypatch.setattr(attention_ops.AP, "key_workspace", _counted(workspaces, "made", attention_ops.AP.key_workspace))
    stand_in = attention_ops.KernelAttentionOps(
        SimpleNamespace(sparse_sink_attention=_exact_sparse_sink_attention(calls),
                        plan_config=kernel_attention.plan_config, PackedSource=kernel_attention.PackedSource,
                        plan_prefill_config=_counted(calls, "prefill_plan", kernel_attention.plan_prefill_config)),
        SimpleNamespace(index_scores=_exact_index_scores(calls), PackedSource=kernel_indexer.PackedSource),
        deterministic=True,                                               # one split: the exact stand-in's plan
        entry_index=SimpleNamespace(entry_index_table=_counted(calls, "table", kernel_entry_index.entry_index_table)))
    assert stand_in.prefill == prefill
    exact = _exact_sparse_sink_attention(calls)

    def wide(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, config=None):
        calls.append("wide" if config is None else f"wide {config.layout} {config.tile_keys}")
        assert swa_slots.dtype == comp_slots.dtype                        # the windows cast to the rows' type
        windows.append(swa_slots)                                         # kept alive: ids stay distinct
        return exact(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale,
                     config=kernel_attention.plan_prefill_config(q.shape[0], q.shape[1], q.shape[2], 1, 1))
    windows: list = []
    stand_in._wide = SimpleNamespace(prefill_sink_attention=wide, plan_heads=kernel_prefill_attention.plan_heads)
    monkeypatch.setattr(forward, "attention_ops", stand_in)
    monkeypatch.setattr(attention_ops, "SCORE_ELEMENTS_PER_CHUNK", chunk_elements)
    got = run_scenario(forward, scenario_caches(forward, CPU), CPU, fixed_decode_tokens())
    batches, indexer_layers = 5, sum(r.runs_indexer for r in cfg.text.layer_roles())
    ratios = {r.ratio for r in cfg.text.layer_roles() if r.runs_indexer}
    compressed_ratios = {r.ratio for r in cfg.text.layer_roles() if r.ratio > 0}
    workspace = prefill in ("bf16", "wide", "heads")
    tables = len(compressed_ratios) if workspace else len(ratios)
    assert calls.count("table") == batches * tables   # one entry table per ratio and forward
    assert calls.count("attend") == batches * cfg.text.num_hidden_layers
    compressed_layers = sum(r.ratio > 0 for r in cfg.text.layer_roles())
    assert calls.count("workspace") == (batches * compressed_layers if workspace else 0)
    assert calls.count("wide") == (batches * compressed_layers if prefill == "wide" else 0)
    assert calls.count("wide heads 0") == (batches * compressed_layers if prefill == "heads" else 0)   # plan_heads
    assert len({id(w) for w in windows}) == (batches if prefill in ("wide", "heads") else 0)   # one window a forward
    key_sources = {r.kv_source for r in cfg.text.layer_roles() if r.runs_indexer}
    assert len(workspaces) == (batches * len(key_sources) if keys == "bf16" else 0)   # once per source and forward
    assert calls.count("key_workspace_scores") == (calls.count("scores") if keys == "bf16" else 0)
    assert calls.count("prefill_plan") == (0 if prefill in ("wide", "heads") else calls.count("workspace"))
    if chunk_elements == DEFAULT_CHUNK:
        assert calls.count("scores") == batches * indexer_layers      # one chunk per layer
    else:
        assert calls.count("scores") > 4 * batches * indexer_layers   # many query chunks
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_prefill_workspace_rules() -> None:
    """`attention_prefill.applies`: a workspace choice, ≥ PREFILL_MIN_QUERIES tokens and a workspace of ≤
    WORKSPACE_MAX_ENTRIES rows (static layouts alike, by their static bounds); a bad choice raises. Rows:
    b·width + j, −1 kept."""
    AP = attention_ops.AP
    big = AP.PREFILL_MIN_QUERIES
    assert AP.applies("bf16", big, 1, 4096) and AP.applies("wide", big, 1, 4096)
    assert not AP.applies("packed", big, 1, 4096)
    assert not AP.applies("bf16", big - 1, 1, 4096)                  # decode graphs (≤ 256 queries) never reach it
    assert not AP.applies("bf16", big, 2, AP.WORKSPACE_MAX_ENTRIES // 2 + 1)
    assert AP.applies("wide", big, 16, AP.WORKSPACE_MAX_ENTRIES // 16)   # a graph's slots × context width, at the bound
    with pytest.raises(ValueError, match="SGLANG_DSV41_ATTN_PREFILL='fp8'"):
        AP.applies("fp8", big, 1, 4096)
    rows = AP.workspace_rows(torch.tensor([0, 1, 1]), torch.tensor([[0, 3, -1], [2, -1, -1], [0, 1, 5]]), 8)
    assert rows.tolist() == [[0, 3, -1], [10, -1, -1], [8, 9, 13]]


def test_entry_tables_are_built_once_and_whole_where_a_workspace_reads_them() -> None:
    """`KernelAttentionOps.entry_table`: one build per ratio and forward for each kind; a whole table (every
    column written) serves partial readers too, a partial one never a whole reader (which builds its own)."""
    fills: list[bool] = []

    def table(req_to_token, req_rows, n_entries, ratio, width, fill=True):
        fills.append(fill)
        return kernel_entry_index.entry_index_table(req_to_token, req_rows, n_entries, ratio, width)
    ops = attention_ops.KernelAttentionOps(SimpleNamespace(), SimpleNamespace(),
                                           entry_index=SimpleNamespace(entry_index_table=table))
    layout = SimpleNamespace(req_to_token=torch.arange(32).view(2, 16), req_rows=torch.tensor([1, 0]),
                             seq_lens=torch.tensor([9, 4]))
    tables: dict = {}
    partial = ops.entry_table(layout, 2, 8, tables, whole=False)
    assert ops.entry_table(layout, 2, 8, tables, whole=False) is partial and fills == [False]
    whole = ops.entry_table(layout, 2, 8, tables, whole=True)
    assert whole is not partial and fills == [False, True]
    assert ops.entry_table(layout, 2, 8, tables, whole=False) is whole                 # the whole one serves
    assert ops.entry_table(layout, 1, 16, {}, whole=True).shape == (2, 16) and fills == [False, True, True]
    assert torch.equal(whole, kernel_entry_index.entry_index_table(layout.req_to_token, layout.req_rows,
                                                                   layout.seq_lens // 2, 2, 8))


def test_key_workspace_rule_and_rows(monkeypatch) -> None:
    """`attention_prefill.key_workspace_applies`: `bf16` (the default) under the workspace size rule,
    never `packed`, a bad choice raises; `key_workspace`: row b·width + j holds the decoded key of
    entry table[b, j] (zeros and row −1 where there is none), the same in chunks."""
    from sglang_dsv41.presets import flash_config_dict
    from sglang_dsv41.runtime import kv_layout
    AP = attention_ops.AP
    monkeypatch.delenv(AP.KEY_PREFILL_ENV, raising=False)
    assert AP.key_choice() == "bf16"
    big = AP.PREFILL_MIN_QUERIES
    assert AP.key_workspace_applies("bf16", big, 1, 4096)
    assert not AP.key_workspace_applies("packed", big, 1, 4096)
    assert not AP.key_workspace_applies("bf16", big - 1, 1, 4096)
    assert not AP.key_workspace_applies("bf16", big, 2, AP.WORKSPACE_MAX_ENTRIES // 2 + 1)
    with pytest.raises(ValueError, match="SGLANG_DSV41_INDEXER_PREFILL_KEYS='fp8'"):
        AP.key_workspace_applies("fp8", big, 1, 4096)
    monkeypatch.setenv(AP.KEY_PREFILL_ENV, "bogus")
    with pytest.raises(ValueError):
        AP.key_choice()
    layout = kv_layout.CompressedRowLayout.from_config(DeepseekV41Config.from_dict(flash_config_dict()).text)
    source = layout.sources[0]
    g = torch.Generator().manual_seed(3)
    key_rows = torch.randint(0, 255, (64, layout.key_row_bytes), generator=g, dtype=torch.uint8)
    table = torch.tensor([[0, 3, -1, 5], [7, -1, -1, -1]])
    want = [kv_layout.decode_keys(kv_layout.read_entries(key_rows, source.key, table[b, j:j + 1]),
                                  layout.index_head_dim).to(torch.bfloat16) for b in range(2) for j in range(4)]
    for chunk in (1 << 14, 3):
        monkeypatch.setattr(AP, "DECODE_CHUNK", chunk)
        ws, rows = AP.key_workspace(key_rows, source.key, layout.index_head_dim, table)
        assert ws.dtype == torch.bfloat16 and ws.shape == (8, layout.index_head_dim)
        assert rows.tolist() == [[0, 1, -1, 3], [4, -1, -1, -1]]
        for i, w in enumerate(want):
            assert torch.equal(ws[i:i + 1].view(torch.int16), w.view(torch.int16)), i
        assert not ws[2].any() and not ws[5:].any()


def test_cuda_workspaces_are_one_entry_decode_launch_each(monkeypatch) -> None:
    """On CUDA rows `latent_workspace` / `key_workspace` hand their part's columns to `kernels.entry_decode`
    (one launch; its bits are pinned by tests/test_kernels_entry_decode.py) instead of the torch codec."""
    from sglang_dsv41.kernels import entry_decode
    from sglang_dsv41.runtime import kv_layout
    AP = attention_ops.AP
    seen = []
    monkeypatch.setattr(entry_decode, "decode_entry_rows", lambda rows, entries, **kw: seen.append((rows, entries, kw))
                        or torch.zeros(entries.numel(), kw["dims"], dtype=torch.bfloat16))
    rows, table = SimpleNamespace(is_cuda=True), torch.tensor([[0, -1], [2, 3]])
    latent = kv_layout.SourceColumns(20, 1, 0, 288, 288)
    key = kv_layout.SourceColumns(2, 2, 34, 34, 68)
    assert AP.latent_workspace(rows, latent, 512, table).shape == (4, 512)
    ws, got_rows = AP.key_workspace(rows, key, 128, table)
    assert ws.shape == (4, 128) and got_rows.tolist() == [[0, -1], [2, 3]]
    assert [(r is rows, e is table, kw) for r, e, kw in seen] == [
        (True, True, dict(offset=0, share=288, ratio=1, dims=512, part="latent")),
        (True, True, dict(offset=34, share=34, ratio=2, dims=128, part="key"))]


# ---- the real kernels in Triton's interpreter ---------------------------------------------------

INTERPRETER_ARGV = child_runs.interpreter_argv(Path(__file__).resolve().parent / "test_runtime_forward_gpu.py",
                                               "-W", "ignore::DeprecationWarning", "-k", "identical_inputs")


@pytest.mark.slow
@pytest.mark.child_run(*INTERPRETER_ARGV)
def test_gpu_sublayer_tests_pass_in_the_triton_interpreter() -> None:
    """tests/test_runtime_forward_gpu.py's identical-input tests, CPU tensors, TRITON_INTERPRET=1
    (~50 s; its batch-invariance test passes there too, 75 s more, and is left to the GPU run;
    the child may have run ahead on a spare core: `child_runs`)."""
    proc = child_runs.run(INTERPRETER_ARGV, timeout_s=900)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\b2 passed", proc.stdout) and not re.search(r"\d+ (failed|skipped|error)", proc.stdout), tail


def test_kernel_choices_come_from_the_environment(monkeypatch) -> None:
    """The attention plan: `plan_decode_config` with the device's multiprocessors by default (the
    serving path), one split in deterministic mode; SGLANG_DSV41_ATTN_SPLITS overrides either;
    SGLANG_DSV41_INDEXER_HEAD_SUM picks the head sum; the prefill rows: the BF16 workspace serving,
    the packed rows deterministic, SGLANG_DSV41_ATTN_PREFILL overrides either; a workspace launch
    takes `plan_prefill_config` (Flash: 16 heads, 4 warps); unknown values raise."""
    seen: list[tuple] = []

    def plan_decode_config(*shape, sm_count):
        seen.append(("decode", shape, sm_count))
        return kernel_attention.plan_decode_config(*shape, sm_count=sm_count)

    def plan_prefill_config(*shape):
        cfg = kernel_attention.plan_prefill_config(*shape)
        seen.append(("prefill", shape, cfg.block_h, cfg.num_warps))
        return cfg

    def attend(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, *, config):
        seen.append(("attend", config.num_splits))
        return torch.zeros_like(q)
    fake = SimpleNamespace(plan_config=kernel_attention.plan_config, plan_decode_config=plan_decode_config,
                           plan_prefill_config=plan_prefill_config, device_sm_count=lambda device: 132,
                           sparse_sink_attention=attend)
    q, sink = torch.zeros(1, 64, 512), torch.zeros(64)
    swa, slots = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(1, 128, dtype=torch.long)
    for env in ("SGLANG_DSV41_ATTN_SPLITS", "SGLANG_DSV41_INDEXER_HEAD_SUM", "SGLANG_DSV41_ATTN_PREFILL"):
        monkeypatch.delenv(env, raising=False)
    serving = attention_ops.KernelAttentionOps(fake, SimpleNamespace())
    assert (serving.splits, serving.head_sum, serving.prefill) == ("decode", "auto", "wide")
    assert "'decode' key splits" in serving.description and "'wide' prefill rows" in serving.description
    serving.attend(q, sink, swa, slots, None, None)
    assert seen == [("decode", (1, 64, 512, 128, 0), 132), ("attend", 4)]   # 4 SWA tiles of 32, one each
    exact = attention_ops.KernelAttentionOps(fake, SimpleNamespace(), deterministic=True)
    assert (exact.splits, exact.head_sum, exact.prefill) == ("one", "fp64", "packed")
    # `auto`: fp32 head sums only for batches of ≥ PREFILL_MIN_QUERIES tokens (session 35), graphed or not (session 42)
    big = attention_prefill.PREFILL_MIN_QUERIES
    exact_by_batch = {big: False, 8192: False, big - 1: True, 256: True, 1: True}   # tokens → exact head sum
    assert {n: serving.head_sum_exact(n) for n in exact_by_batch} == exact_by_batch
    assert exact.head_sum_exact(8192)
    exact.attend(q, sink, swa, slots, None, None)
    assert seen[2:] == [("attend", 1)]
    rows = torch.zeros(1, 512, dtype=torch.long)
    workspace = (torch.zeros(4, 512, dtype=torch.bfloat16), rows)
    serving._wide = SimpleNamespace(prefill_sink_attention=lambda q, swa, ss, ws, r, sink, scale: seen.append(
        ("wide", ws is workspace[0] and r is rows, scale == softmax_scale(512))) or torch.zeros_like(q))
    serving.attend(q, sink, swa, slots, None, rows, workspace=workspace)
    assert seen[3:] == [("wide", True, True)]                          # `wide` plans itself
    monkeypatch.setenv("SGLANG_DSV41_ATTN_PREFILL", "heads")
    heads = attention_ops.KernelAttentionOps(fake, SimpleNamespace())
    heads._wide = SimpleNamespace(plan_heads=kernel_prefill_attention.plan_heads,
                                  prefill_sink_attention=lambda q, swa, ss, ws, r, sink, scale, config: seen.append(
                                      ("heads", ws is workspace[0], config)) or torch.zeros_like(q))
    heads.attend(q, sink, swa, slots, None, rows, workspace=workspace)
    assert seen[4:] == [("heads", True, kernel_prefill_attention.plan_heads(64, 512))]
    assert seen.pop()[2].layout == "heads"
    monkeypatch.setenv("SGLANG_DSV41_ATTN_PREFILL", "bf16")
    bf16 = attention_ops.KernelAttentionOps(fake, SimpleNamespace())
    bf16.attend(q, sink, swa, slots, None, rows, workspace=workspace)
    assert seen[4:] == [("prefill", (1, 64, 512, 128, 512), 16, 4), ("attend", 1)]
    monkeypatch.setenv("SGLANG_DSV41_ATTN_SPLITS", "decode")
    monkeypatch.setenv("SGLANG_DSV41_INDEXER_HEAD_SUM", "FP32")
    monkeypatch.setenv("SGLANG_DSV41_ATTN_PREFILL", "BF16")
    chosen = attention_ops.KernelAttentionOps(fake, SimpleNamespace(), deterministic=True)
    assert (chosen.splits, chosen.head_sum, chosen.prefill) == ("decode", "fp32", "bf16")
    assert not chosen.head_sum_exact(1) and not chosen.head_sum_exact(8192)
    monkeypatch.setenv("SGLANG_DSV41_ATTN_PREFILL", "packed")
    assert attention_ops.KernelAttentionOps(fake, SimpleNamespace()).prefill == "packed"
    monkeypatch.setenv("SGLANG_DSV41_ATTN_PREFILL", "fp8")
    with pytest.raises(ValueError, match="SGLANG_DSV41_ATTN_PREFILL='fp8'"):
        attention_ops.KernelAttentionOps(fake, SimpleNamespace())
    monkeypatch.delenv("SGLANG_DSV41_ATTN_PREFILL")
    monkeypatch.setenv("SGLANG_DSV41_ATTN_SPLITS", "One")
    assert attention_ops.KernelAttentionOps(fake, SimpleNamespace()).splits == "one"
    monkeypatch.setenv("SGLANG_DSV41_ATTN_SPLITS", "many")
    with pytest.raises(ValueError, match="SGLANG_DSV41_ATTN_SPLITS='many'"):
        attention_ops.KernelAttentionOps(fake, SimpleNamespace())


def test_windows_cast_to_the_rows_type_once_per_forward() -> None:
    """`_slots_as`: the int64 windows as the rows' int32, one cast per (window tensor, type) and forward memo;
    a window already of that type, or no memo, as `Tensor.to` gives it."""
    window = torch.arange(12).view(3, 4)
    memo: dict = {}
    first = attention_ops._slots_as(window, torch.int32, memo)
    assert first.dtype == torch.int32 and torch.equal(first, window.to(torch.int32))
    assert attention_ops._slots_as(window, torch.int32, memo) is first
    assert attention_ops._slots_as(window.clone(), torch.int32, memo) is not first     # another forward's window
    assert attention_ops._slots_as(window, torch.int64, memo) is window
    assert attention_ops._slots_as(window, torch.int32, None).dtype == torch.int32


def test_wide_decode_opt_in(monkeypatch) -> None:
    """SGLANG_DSV41_ATTN_DECODE=wide: a decode batch (no workspace) goes to the `wide` kernel under its
    module's `plan_decode` with the device's multiprocessors, its compressed keys as given (None for an
    SWA-only layer); refused in deterministic mode (the split count follows the batch size)."""
    from sglang_dsv41.kernels import sparse_attention_prefill as sap
    monkeypatch.setenv("SGLANG_DSV41_ATTN_DECODE", "wide")
    seen: list[tuple] = []
    fake = SimpleNamespace(device_sm_count=lambda device: 132, plan_config=kernel_attention.plan_config)
    ops = attention_ops.KernelAttentionOps(fake, SimpleNamespace())
    assert ops.decode == "wide" and "'wide' decode" in ops.description

    def wide_call(q, swa, ss, comp, cs, sink, scale, *, config):
        seen.append((comp is None, cs is None, config))
        return torch.zeros_like(q)
    ops._wide = SimpleNamespace(prefill_sink_attention=wide_call, plan_decode=sap.plan_decode)
    q, sink = torch.zeros(8, 64, 512), torch.zeros(64)
    swa, slots = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.long)
    ops.attend(q, sink, swa, slots, None, None)
    assert seen == [(True, True, sap.plan_decode(8, 64, 512, 128, 0, 132))] and seen[0][2].num_splits == 2
    with pytest.raises(ValueError, match="SGLANG_DSV41_ATTN_DECODE=wide is not available"):
        attention_ops.KernelAttentionOps(fake, SimpleNamespace(), deterministic=True)


def test_auto_decode_takes_wide_by_batch_size(monkeypatch) -> None:
    """The serving default `auto`: one query to the split-KV decode kernel on BF16 rows, 2 … 256 to the
    `wide` kernel under `plan_decode`, more to the decode kernel on the packed rows; with
    `--enable-deterministic-inference` an explicit `auto` never takes `wide` (its splits follow the batch)."""
    from sglang_dsv41.kernels import sparse_attention_prefill as sap
    monkeypatch.delenv("SGLANG_DSV41_ATTN_DECODE", raising=False)
    seen: list[tuple] = []

    def decode_call(q, swa, ss, comp, cs, sink, scale, *, config):
        seen.append(("decode", q.shape[0]))
        return torch.zeros_like(q)

    def wide_call(q, swa, ss, comp, cs, sink, scale, *, config):
        seen.append(("wide", q.shape[0], config.num_splits))
        return torch.zeros_like(q)
    fake = SimpleNamespace(device_sm_count=lambda device: 132, plan_config=kernel_attention.plan_config,
                           plan_decode_config=kernel_attention.plan_decode_config, sparse_sink_attention=decode_call)
    serving = attention_ops.KernelAttentionOps(fake, SimpleNamespace())
    exact = attention_ops.KernelAttentionOps(fake, SimpleNamespace(), deterministic=True, decode="auto")
    assert serving.decode == "auto" and exact.decode == "auto"
    for ops in (serving, exact):
        ops._wide = SimpleNamespace(prefill_sink_attention=wide_call, plan_decode=sap.plan_decode)
    swa, sink = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(64)
    for n in (1, 2, 64, 256, 257):
        serving.attend(torch.zeros(n, 64, 512), sink, swa, torch.zeros(n, 128, dtype=torch.long), None, None)
    assert seen == [("decode", 1), ("wide", 2, 2), ("wide", 64, 2), ("wide", 256, 1), ("decode", 257)]
    seen.clear()
    exact.attend(torch.zeros(8, 64, 512), sink, swa, torch.zeros(8, 128, dtype=torch.long), None, None)
    assert seen == [("decode", 8)]


# ---- a prefix hit's extend: the CUDA path's host work does not grow with the context -------------

#: aten ops that wait for a CUDA device (`.item()`, `int()` / `bool()` of a tensor, `.tolist()`, …)
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select",
            "aten.repeat_interleave.Tensor", "aten._unique2", "aten.unique")
#: the files of the CUDA attention / indexer path (the stand-in kernels below live in this test file)
ATTENTION_PATH = ("runtime/attention.py", "runtime/attention_ops.py", "runtime/attention_prefill.py",
                  "runtime/indexer_select.py", "kernels/indexer.py", "kernels/indexer_select.py",
                  "kernels/entry_index.py", "kernels/topk_select.py")


class _PathOps(TorchDispatchMode):
    """Per aten op issued from ATTENTION_PATH (innermost repository frame): its name and output size."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frames = [f.filename for f in traceback.extract_stack()
                  if "/sglang_dsv41/" in f.filename or "/kernels/" in f.filename]
        if frames and frames[-1].endswith(ATTENTION_PATH):
            size = max((t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), default=0)
            self.ops.append((str(func), size))
        return out


class _NoLaunch:
    """A Triton kernel stand-in: `kernel[grid](...)` launches nothing (the caller's outputs keep their shapes)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _shape_only_kernels(monkeypatch) -> attention_ops.KernelAttentionOps:
    """`KernelAttentionOps` (serving mode, one split) over stand-ins of the Triton launches that only
    give the right shapes (no values, no host sync): the decode, `wide` and indexer kernels, and the serving
    default's key gather (`auto`: BF16 rows at decode sizes) launching nothing; everything else (the
    `wide` kernel's `plan_decode` included) is the real module code."""
    from sglang_dsv41.kernels import key_gather
    from sglang_dsv41.kernels import sparse_attention_prefill as sap

    monkeypatch.setattr(key_gather, "_gather_keys_kernel", _NoLaunch())
    def index_scores(q, head_w, key_cache, entries, token_req, n_visible, **_):
        j = torch.arange(entries.shape[1])
        return torch.where(j[None, :] < n_visible[:, None], torch.zeros(q.shape[0], entries.shape[1]), -math.inf)

    def sparse_sink_attention(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, *, config):
        return torch.zeros_like(q)

    ops = attention_ops.KernelAttentionOps(
        SimpleNamespace(sparse_sink_attention=sparse_sink_attention, plan_config=kernel_attention.plan_config,
                        plan_prefill_config=kernel_attention.plan_prefill_config, device_sm_count=lambda device: 132,
                        PackedSource=kernel_attention.PackedSource),
        SimpleNamespace(index_scores=index_scores, PackedSource=kernel_indexer.PackedSource),
        splits="one", prefill="bf16", indexer_select=kernel_select, entry_index=kernel_entry_index)
    ops._wide = SimpleNamespace(prefill_sink_attention=sparse_sink_attention, plan_decode=sap.plan_decode)
    return ops


def test_a_hit_extend_does_the_same_host_work_at_any_context(engine, monkeypatch) -> None:
    """A prefix hit's 32-token extend on the CUDA path's code (issue 14 "What a hit costs"): after a
    64- and a 2,048-token prefix the attention and indexer code issue the same aten ops, none of
    them waits for the device, and no tensor is larger than the scores' N × E plus q's N × H × D
    (no BF16 workspace of the context below PREFILL_MIN_QUERIES new tokens)."""
    from sglang_dsv41.runtime.batch import BatchLayout, make_layout
    from sglang_dsv41.runtime.cache import RuntimeCaches
    from sglang_dsv41.runtime.engram_history import host_history

    cfg, forward = engine
    monkeypatch.setattr(forward, "attention_ops", _shape_only_kernels(monkeypatch))
    monkeypatch.setattr(BatchLayout, "host_checks", property(lambda self: False))   # as on CUDA
    n, page, seen = 32, 64, {}
    for prefix in (64, 2048):
        seq = prefix + n
        caches = RuntimeCaches.allocate(cfg.text, page + seq + page, 4, page_size=page)
        table = torch.zeros(4, seq + page, dtype=torch.int32)
        table[1, :seq] = torch.arange(page, page + seq, dtype=torch.int32)
        ids = torch.randint(3, 900, (seq,), generator=torch.Generator().manual_seed(prefix))
        layout = make_layout(torch.tensor([1]), torch.tensor([prefix]), torch.tensor([n]), torch.arange(prefix, seq),
                             table[1, prefix:seq].to(torch.int64), table,
                             engram_history=host_history([ids.tolist()], [prefix], forward.hasher.history_len))
        watch = _PathOps()
        with watch:
            forward.hidden_states(ids[prefix:], layout, caches)
        names = [name for name, _ in watch.ops]
        assert names and not [x for x in names if x.startswith(SYNC_OPS)], [x for x in names if x.startswith(SYNC_OPS)]
        per_token = n * cfg.text.num_attention_heads * cfg.text.head_dim            # q and the output
        assert max(size for _, size in watch.ops) <= n * seq + per_token, prefix
        seen[prefix] = collections.Counter(names)
    assert seen[64] == seen[2048]
