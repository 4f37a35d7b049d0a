"""Engram tables kept as stored, rows dequantised on lookup (`runtime/engram_table.py`)."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.checkpoint.codecs import dequantize_engram_rows, ue8m0_from_exponent
from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.reference.engram import engram_embedding
from sglang_dsv41.runtime.engram_table import StoredEngramTable
from sglang_dsv41.runtime.weights import runtime_weights


def random_table(rows: int, d: int, seed: int = 0) -> StoredEngramTable:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, d), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38                       # no NaN codes
    exps = torch.randint(-20, 10, (rows, d // 32), generator=g)
    return StoredEngramTable(codes.view(torch.float8_e4m3fn), ue8m0_from_exponent(exps))


def test_lookup_equals_the_dequantised_table_bit_for_bit() -> None:
    table = random_table(50, 64)
    whole = dequantize_engram_rows(table.values, table.scales).to(torch.float32)
    assert torch.equal(table.dequantized(), whole)
    ids = torch.tensor([[3, 49, 0], [3, 7, 22]])
    rows = table[ids]
    assert rows.shape == (2, 3, 64) and rows.dtype == torch.float32
    assert torch.equal(rows, whole[ids])
    assert torch.equal(table[ids.to(torch.int32).reshape(-1)], whole[ids.reshape(-1)])
    assert torch.equal(engram_embedding(ids, table), engram_embedding(ids, whole))   # the reference reads it unchanged


def test_row_slices_stay_stored_and_shape_is_the_logical_shape() -> None:
    table = random_table(40, 32, seed=1)
    part = table[10:25]
    assert isinstance(part, StoredEngramTable) and part.shape == (15, 32) and table.shape == (40, 32)
    assert torch.equal(part.dequantized(), table.dequantized()[10:25])
    assert part.equal(StoredEngramTable(table.values[10:25], table.scales[10:25])) and not part.equal(table[11:26])
    assert table.nbytes == 40 * 32 + 40 * 1 and table.new_zeros(2, 32).dtype == torch.float32
    with pytest.raises(ValueError, match="outside the table"):
        engram_embedding(torch.tensor([[0, 40]]), table)


def test_bad_tables_and_indices_are_refused() -> None:
    table = random_table(8, 32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        StoredEngramTable(table.values.view(torch.uint8), table.scales)
    with pytest.raises(ValueError, match="do not match"):
        StoredEngramTable(table.values, table.scales[:4])
    with pytest.raises(TypeError, match="integer id tensor"):
        table[torch.tensor([1.0])]


def test_runtime_holds_the_stored_bytes_not_a_dequantised_table(tiny_checkpoint) -> None:
    """The runtime keeps every Engram table as stored (1 + 1/32 bytes per value, not 4) and its
    lookups equal the reference loader's dequantised table."""
    from sglang_dsv41.checkpoint.loader import load_reference_weights_from_tensors

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names()}
    w = runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=False)
    ref = load_reference_weights_from_tensors(stored, cfg, vision=False, dspark=False)
    for layer in cfg.text.engram_layer_ids:
        name = f"layers.{layer}.engram.embed.weight"
        table = w[name]
        assert isinstance(table, StoredEngramTable)
        assert table.nbytes == stored[name].numel() + stored[name.replace(".weight", ".scale")].numel()
        assert torch.equal(table.dequantized(), ref[name])


@pytest.mark.gpu
def test_lookup_on_cuda_equals_cpu_and_replays_in_a_graph() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run with -m gpu on the GPU machine; see docs/validation.md)")
    table = random_table(1000, 256, seed=3)
    on_gpu = table.to("cuda")
    ids = torch.randint(0, 1000, (64, 4), generator=torch.Generator().manual_seed(4))
    want = table[ids]
    static_ids = ids.cuda()
    assert torch.equal(on_gpu[static_ids].cpu(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = on_gpu[static_ids]
    static_ids.copy_(torch.flip(ids, (0,)).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[torch.flip(ids, (0,))])
