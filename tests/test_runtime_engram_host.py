"""Engram tables in host memory, per_rank layout (`runtime/engram_host.py`, runtime.md §A.7).

What is pinned (CPU):
* the placement read from the launcher's variables: unset/0 → device, 1 → host (per_rank, also
  when the layout is unset), `shared` and any other layout or enable value → an error naming it;
* `HostBuffer`: mmap memory of the asked size starting on a 2 MiB boundary, huge pages requested
  and collapse attempted (the madvise results recorded), nothing registered without CUDA;
* `HostEngramTable`: the copied bytes equal the source, `nbytes`, slices are views of the same host
  rows that outlive the parent, lookups on CPU ids equal the device table bit for bit, the reader
  interface (`device` = compute device, `new_zeros`, `engram_embedding`); a CUDA compute device
  without registered buffers is refused; `UvaRows` is what Triton 3.6 specialises as a `*u8`;
* `runtime_weights(..., engram_placement="host")` on the tiny checkpoint: host tables (TP 1 and a
  TP 2 shard via `ShardPlan.rows_of`) with the device tables' bytes and lookups, every other weight
  unchanged, the CPU info line logged;
* the CPU runtime forward (one-shot prefill and static decode steps, which read the table in
  `_engram_update_on_device`) with host tables == with device tables, bit for bit.
GPU (`gpu`, H200): UVA gathers from registered host tables == device tables (both read orders,
slices, int32 / 2-D ids), replay in a CUDA graph with new ids == eager, the table's bytes do not count in `torch.cuda.memory_allocated`,
`runtime_weights(..., "host")` on CUDA (TP 1 and a TP 2 shard) and the CUDA forward with host
tables == device tables bit for bit.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sglang_dsv41.checkpoint.codecs import ue8m0_from_exponent
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.reference.engram import engram_embedding
from sglang_dsv41.runtime.engram_host import (ENABLE_ENV, HUGE_PAGE, LAYOUT_ENV, HostBuffer, HostEngramTable, UvaRows,
                                              engram_placement_from_env)
from sglang_dsv41.runtime.engram_table import StoredEngramTable
from sglang_dsv41.runtime.tensor_parallel import ShardPlan, TensorParallel
from sglang_dsv41.runtime.weights import runtime_weights

from tp_harness import engine_for, stored_tensors

CPU = torch.device("cpu")
THP_HERE = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def random_parts(rows: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, d), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38                       # no NaN codes: torch.equal compares
    exps = torch.randint(-30, 10, (rows, d // 32), generator=g)
    return codes.view(torch.float8_e4m3fn), ue8m0_from_exponent(exps)




# ---- the launcher's variables ------------------------------------------------------------------

def test_placement_from_env() -> None:
    assert engram_placement_from_env({}) == "device"
    assert engram_placement_from_env({ENABLE_ENV: "0", LAYOUT_ENV: "shared"}) == "device"   # layout unread when off
    assert engram_placement_from_env({ENABLE_ENV: "1"}) == "host"                           # unset layout = per_rank
    assert engram_placement_from_env({ENABLE_ENV: "1", LAYOUT_ENV: "per_rank"}) == "host"
    with pytest.raises(ValueError, match=f"{LAYOUT_ENV}='shared' is not supported.*only {LAYOUT_ENV}=per_rank"):
        engram_placement_from_env({ENABLE_ENV: "1", LAYOUT_ENV: "shared"})
    with pytest.raises(ValueError, match=f"{LAYOUT_ENV}='per-rank'.*per_rank"):
        engram_placement_from_env({ENABLE_ENV: "1", LAYOUT_ENV: "per-rank"})
    with pytest.raises(ValueError, match=f"{ENABLE_ENV}='yes please'"):
        engram_placement_from_env({ENABLE_ENV: "yes please"})


def test_placement_from_env_reads_os_environ(monkeypatch) -> None:
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    assert engram_placement_from_env() == "device"
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setenv(LAYOUT_ENV, "shared")
    with pytest.raises(ValueError, match="shared"):
        engram_placement_from_env()


# ---- host storage ------------------------------------------------------------------------------

def test_host_buffer_is_aligned_mmap_memory_with_huge_pages_requested() -> None:
    buf = HostBuffer(3 * HUGE_PAGE + 5)
    assert buf.tensor.dtype == torch.uint8 and buf.tensor.numel() == buf.nbytes == 3 * HUGE_PAGE + 5
    assert buf.tensor.data_ptr() % HUGE_PAGE == 0 and buf.tensor.device == CPU
    assert buf.huge_pages_requested == THP_HERE, buf.huge_page_note
    assert buf.huge_page_note and buf.huge_pages_collapsed is None
    assert not buf.registered
    buf.tensor.fill_(3)
    collapsed = buf.collapse_huge_pages()                 # kernel-dependent (EINVAL before Linux 6.1 / in VMs)
    assert buf.huge_pages_collapsed is collapsed and (collapsed or "MADV_COLLAPSE" in buf.huge_page_note)
    assert int(buf.tensor.sum()) == 3 * buf.nbytes
    assert int(HostBuffer(HUGE_PAGE).tensor.sum()) == 0                     # anonymous memory starts zeroed
    assert HostBuffer(0).tensor.numel() == 0
    with pytest.raises(ValueError, match="nbytes"):
        HostBuffer(-1)


def test_host_table_holds_a_copy_and_reads_like_the_device_table() -> None:
    values, scales = random_parts(300, 64, seed=1)
    table = HostEngramTable.copy_of(values, scales, CPU)
    device_table = StoredEngramTable(values, scales)
    assert table.placement == "host" and device_table.placement == "device"
    assert table.values.data_ptr() != values.data_ptr() and table.equal(device_table) and device_table.equal(table)
    assert torch.equal(table.values.view(torch.uint8), values.view(torch.uint8))
    assert table.values.dtype == torch.float8_e4m3fn and table.scales.dtype == scales.dtype
    assert table.nbytes == 300 * 64 + 300 * 2 == device_table.nbytes
    assert table.shape == (300, 64) and table.ndim == 2 and table.device == CPU and table.storage_device == CPU
    assert table.huge_pages_requested == THP_HERE and not table.pinned
    assert all(b.huge_pages_collapsed is not None for b in table.buffers) == THP_HERE     # tried after the copy
    ids = torch.tensor([[0, 299, 5], [5, 17, 0]])
    rows = table[ids]
    assert rows.shape == (2, 3, 64) and rows.dtype == torch.float32 and torch.equal(rows, device_table[ids])
    assert torch.equal(table[ids.to(torch.int32)], rows)
    assert torch.equal(engram_embedding(ids, table), engram_embedding(ids, device_table))
    z = table.new_zeros(2, 64)
    assert z.dtype == torch.float32 and z.device == CPU and not z.any()
    assert torch.equal(table.dequantized(), device_table.dequantized())
    values.view(torch.uint8).zero_()                                    # the table is a copy
    assert not table.equal(StoredEngramTable(values, scales))
    with pytest.raises(TypeError, match="integer id tensor"):
        table[torch.tensor([1.0])]


def test_slices_are_views_of_the_same_host_rows_and_outlive_the_parent() -> None:
    values, scales = random_parts(100, 32, seed=2)
    table = HostEngramTable.copy_of(values, scales, CPU, sorted_reads=True)
    part = table[40:70]
    assert isinstance(part, HostEngramTable) and part.shape == (30, 32) and part.sorted_reads
    assert part.buffers is table.buffers and part.compute_device == CPU
    assert part.values.data_ptr() == table.values.data_ptr() + 40 * 32
    assert part.scales.data_ptr() == table.scales.data_ptr() + 40
    assert part.nbytes == 30 * 32 + 30
    want = StoredEngramTable(values, scales)[40:70]
    del table
    gc.collect()
    ids = torch.tensor([0, 29, 3, 3])
    assert part.equal(want) and torch.equal(part[ids], want[ids])


def test_uva_rows_are_a_pointer_triton_accepts() -> None:
    """What Triton 3.6's launcher needs of a pointer argument (engram_host module doc): its
    specialiser types `UvaRows` as `*u8` (16-byte aligned: the "D" specialisation)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from sglang_dsv41.kernels.engram_gather import RowMajorBytes

    values, scales = random_parts(64, 32, seed=3)
    table = HostEngramTable.copy_of(values, scales, CPU)
    rows = UvaRows(table.values.view(torch.uint8))
    assert isinstance(rows, RowMajorBytes) and rows.shape == (64, 32) and rows.dtype == torch.uint8
    assert rows.data_ptr() == table.values.data_ptr()
    assert native_specialize_impl(BaseBackend, rows, False, True, True)[:2] == ("*u8", "D")
    odd = UvaRows(table.values.view(torch.uint8).reshape(-1)[1:33].view(1, 32))   # address ≡ 1 (mod 16)
    assert native_specialize_impl(BaseBackend, odd, False, True, True)[:2] == ("*u8", "")


def test_cuda_compute_device_needs_registered_buffers() -> None:
    values, scales = random_parts(8, 32)
    with pytest.raises(ValueError, match="registered with CUDA"):
        HostEngramTable(values, scales, compute_device=torch.device("cuda"))
    with pytest.raises(ValueError, match="host memory"):
        HostEngramTable(values.to("meta"), scales.to("meta"), compute_device=CPU)
    with pytest.raises(ValueError, match="CPU or CUDA"):
        HostEngramTable.copy_of(values, scales, "meta")


# ---- runtime_weights ----------------------------------------------------------------------------

@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)], ids=["tp1", "tp2_rank1"])
def test_runtime_weights_host_placement_equals_device_placement(tiny_checkpoint, caplog, rank: int, size: int) -> None:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    stored = stored_tensors(tiny_checkpoint)
    plan = ShardPlan.for_config(cfg.text, rank, size)
    kw = dict(experts_mxfp4=False, expert_ids=list(plan.experts), rows_of=plan.rows_of)
    device = runtime_weights(stored, cfg, CPU, **kw)
    with caplog.at_level(logging.INFO, logger="sglang_dsv41.runtime.weights"):
        host = runtime_weights(stored, cfg, CPU, engram_placement="host", **kw)
    assert any("host placement on a CPU runtime" in r.getMessage() for r in caplog.records)
    assert host.keys() == device.keys()
    g = torch.Generator().manual_seed(rank)
    for name, value in host.items():
        if not name.endswith(".engram.embed.weight"):
            assert torch.equal(value, device[name]), name
            continue
        want = device[name]
        assert isinstance(value, HostEngramTable) and type(want) is StoredEngramTable
        layer = int(name.split(".")[1])
        held = plan.engram_rows[layer]
        assert value.shape[0] == len(held) and (size == 1 or len(held) < cfg.text.engram_num_embeddings[0])
        assert value.equal(want) and value.device == CPU and not value.pinned
        ids = torch.randint(0, len(held), (5, 24), generator=g)
        assert torch.equal(value[ids], want[ids]), name
    with pytest.raises(ValueError, match="engram_placement"):
        runtime_weights(stored, cfg, CPU, engram_placement="shared", **kw)


def _engines(ckpt: Path, device: torch.device = CPU):
    """{"device" | "host": TorchForward} on `device`, loaded as the server loads it (tp_harness)."""
    engines = {p: engine_for(ckpt, TensorParallel(), device, engram_placement=p) for p in ("device", "host")}
    assert any(isinstance(v, HostEngramTable) for v in engines["host"].weights.values())
    return engines


def test_cpu_forward_with_host_tables_equals_device_tables(tiny_checkpoint) -> None:
    """One-shot prefill (reference lookup path) and static decode steps (the CUDA-graph layout's
    `_engram_update_on_device`) give the same logits bit for bit with either placement."""
    from cuda_graph_scenarios import static_decode_logits
    from runtime_scenarios import one_shot_logits, prompt

    engines = _engines(tiny_checkpoint)
    tokens = prompt(5, 21)
    assert torch.equal(one_shot_logits(engines["host"], CPU, tokens), one_shot_logits(engines["device"], CPU, tokens))
    host, device = static_decode_logits(engines["host"]), static_decode_logits(engines["device"])
    assert host.keys() == device.keys() and len(host) == 2
    for step in host:
        assert torch.equal(host[step], device[step]), step


# ---- GPU (H200) ---------------------------------------------------------------------------------

def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_uva_gather_from_registered_host_memory_equals_the_device_table() -> None:
    _need_cuda()
    values, scales = random_parts(20000, 256, seed=4)
    host = HostEngramTable.copy_of(values, scales, "cuda")
    assert host.pinned and host.device.type == "cuda" and host.storage_device == CPU
    on_gpu = StoredEngramTable(values.cuda(), scales.cuda())
    ids = torch.randint(0, 20000, (64, 24), generator=torch.Generator().manual_seed(5)).cuda()
    want = on_gpu[ids]
    for table in (host, replace(host, sorted_reads=True)):
        got = table[ids]
        assert got.device == ids.device and got.shape == (64, 24, 256) and torch.equal(got, want), table.sorted_reads
        assert torch.equal(table[ids.to(torch.int32)], want)
    part, part_gpu = host[1000:3000], on_gpu[1000:3000]
    local = torch.randint(0, 2000, (37,), generator=torch.Generator().manual_seed(6)).cuda()
    assert torch.equal(part[local], part_gpu[local])                  # a view: interior UVA address
    assert torch.equal(host[ids.cpu()], want.cpu())                    # CPU ids: the torch path
    z = host.new_zeros(3, 256)
    assert z.device.type == "cuda" and z.dtype == torch.float32


@pytest.mark.gpu
def test_uva_gather_replays_in_a_cuda_graph_with_new_ids() -> None:
    _need_cuda()
    values, scales = random_parts(5000, 256, seed=7)
    g = torch.Generator().manual_seed(8)
    first, second = (torch.randint(0, 5000, (48, 24), generator=g) for _ in range(2))
    for sorted_reads in (False, True):
        table = HostEngramTable.copy_of(values, scales, "cuda", sorted_reads=sorted_reads)
        static_ids = first.cuda()
        table[static_ids]                                               # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = table[static_ids]
        static_ids.copy_(second.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, table[second.cuda()]), sorted_reads
        assert torch.equal(out.cpu(), StoredEngramTable(values, scales)[second]), sorted_reads


@pytest.mark.gpu
def test_host_table_bytes_are_not_on_the_gpu() -> None:
    _need_cuda()
    values, scales = random_parts(256 * 1024, 256, seed=10)             # 64 MiB of rows
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    table = HostEngramTable.copy_of(values, scales, "cuda")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == 0
    out = table[torch.tensor([0, 262143], device="cuda")]
    assert torch.cuda.memory_allocated() - before <= 2 * 256 * 4 + 4096   # only the looked-up rows (+ ids)
    assert torch.equal(out.cpu(), StoredEngramTable(values, scales)[torch.tensor([0, 262143])])


@pytest.mark.gpu
@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)], ids=["tp1", "tp2_rank1"])
def test_runtime_weights_host_tables_on_cuda(tiny_checkpoint, rank: int, size: int) -> None:
    _need_cuda()
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    stored = stored_tensors(tiny_checkpoint)
    plan = ShardPlan.for_config(cfg.text, rank, size)
    kw = dict(experts_mxfp4=False, dense_fp8=False, expert_ids=list(plan.experts), rows_of=plan.rows_of)
    cuda = torch.device("cuda")
    device, host = runtime_weights(stored, cfg, cuda, **kw), runtime_weights(stored, cfg, cuda, engram_placement="host", **kw)
    for layer in cfg.text.engram_layer_ids:
        name = f"layers.{layer}.engram.embed.weight"
        table, want = host[name], device[name]
        assert isinstance(table, HostEngramTable) and table.pinned and table.device == want.device
        assert table.storage_device == CPU and table.shape == want.shape and table.equal(want)
        ids = torch.randint(0, table.shape[0], (7, 24), generator=torch.Generator().manual_seed(layer)).cuda()
        assert torch.equal(table[ids], want[ids])
        assert table.new_zeros(2, table.shape[1]).device == want.device


@pytest.mark.gpu
def test_cuda_forward_with_host_tables_equals_device_tables(tiny_checkpoint) -> None:
    """The server's CUDA forward (MXFP4 experts, FP8 dense) with host tables: one-shot logits and a
    replayed static decode step equal the device-table forward's eager logits bit for bit."""
    _need_cuda()
    from cuda_graph_scenarios import clone_caches, decode_step, prefilled, step_tokens
    from runtime_scenarios import one_shot_logits, prompt

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.device("cuda")
    engines = _engines(tiny_checkpoint, cuda)
    tokens = prompt(5, 21)
    assert torch.equal(one_shot_logits(engines["host"], cuda, tokens), one_shot_logits(engines["device"], cuda, tokens))
    states = {p: prefilled(e, cuda) for p, e in engines.items()}
    steps = {p: decode_step(states[p], step_tokens(0), 6) for p in engines}
    host, st = engines["host"], steps["host"]

    def forward():
        return host.logits(host.hidden_states(st.input_ids, st.static_layout(states["host"].slots.table),
                                              states["host"].caches))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                         # warm-up (Triton compiles) ...
        saved = clone_caches(states["host"].caches)
        forward()
        states["host"].caches = saved                                     # ... then the prefilled caches again
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    graph.replay()
    dev, sd = engines["device"], steps["device"]
    want = dev.logits(dev.hidden_states(sd.input_ids, sd.static_layout(states["device"].slots.table),
                                        states["device"].caches))
    torch.cuda.synchronize()
    assert torch.equal(out, want)
