"""TP 4 and TP 8 == TP 1, bit for bit, on the tiny-tp8 checkpoint (issue 6 on CPU; runtime/tensor_parallel.py).

The default tiny preset (4 heads in 2 output groups) shards only at TP 1/2; the `tiny-tp8`
preset (presets.tiny_tp8_config_dict: 8 heads in 8 groups, 8 routed experts) is the smallest
shape TP 4 and TP 8 (= EP 8, one expert per rank) can run on. Here:

* the tiny-tp8 checkpoint verifies (`sglang-dsv41 verify`) and the reference loads and runs it;
* TP 4 and TP 8 over spawned gloo processes (test_runtime_tp.py's engine and limits) run a short
  scenario — two requests in one packed batch with B's prompt chunked, B's second chunk mixed
  with A's decode, then batched decode steps — and every rank's logits equal TP 1's exactly;
* the shard plan at TP 4 / TP 8: each rank holds 2 / 1 heads with their output groups, 2 / 1
  routed experts and a contiguous block of each Engram table's rows, and the loader gives it
  exactly those.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_scenarios import Slots, allocate_caches, prompt, run_batch
from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.tensor_parallel import ShardPlan, TensorParallel, load_shard_weights
from test_runtime_tp import CPU, _engine, shard_of
from tp_harness import run_tp
from runtime_values import same_value

ROWS = {"A": 1, "B": 2}
PROMPTS = {"A": prompt(71, 23), "B": prompt(72, 30)}
DECODE = {"A": prompt(73, 4)[1:], "B": prompt(74, 3)[1:]}    # A: 3 decode steps, B: 2
B_FIRST_CHUNK = 13


def short_scenario(engine: TorchForward) -> dict[str, torch.Tensor]:
    """Logits of A and B at every position computed, in position order: [A whole + B 0..12],
    [B 13..29 + A decode], [A decode + B decode] × 2 (positions end odd and even; the tiny
    window 8, index_topk 4 and candidate span 12 bind)."""
    slots = Slots(CPU, rows=3, max_context=64)
    caches = allocate_caches(engine, slots)
    a, b = PROMPTS["A"], PROMPTS["B"]
    got: dict[str, list[torch.Tensor]] = {"A": [], "B": []}

    def batch(*pieces: tuple[str, int, list[int]]) -> None:
        for (name, _, _), logits in zip(pieces, run_batch(engine, caches, slots,
                                                          [(ROWS[n], start, ids) for n, start, ids in pieces])):
            got[name].append(logits)

    batch(("A", 0, a), ("B", 0, b[:B_FIRST_CHUNK]))
    batch(("B", B_FIRST_CHUNK, b[B_FIRST_CHUNK:]), ("A", len(a), DECODE["A"][:1]))
    for step in (1, 2):
        batch(("A", len(a) + step, DECODE["A"][step:step + 1]), ("B", len(b) + step - 1, DECODE["B"][step - 1:step]))
    return {name: torch.cat(parts) for name, parts in got.items()}


@pytest.fixture(scope="module")
def tiny_tp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sglang_dsv41.checkpoint.synth import make_checkpoint

    return make_checkpoint("tiny-tp8", tmp_path_factory.mktemp("tiny-tp8") / "ckpt", seed=0, progress=False)


@pytest.fixture(scope="module")
def text(tiny_tp8_checkpoint: Path):
    return DeepseekV41Config.from_file(tiny_tp8_checkpoint).text


@pytest.fixture(scope="module")
def tp1_logits(tiny_tp8_checkpoint: Path) -> dict[str, torch.Tensor]:
    return short_scenario(_engine(tiny_tp8_checkpoint, TensorParallel()))


# ---- the checkpoint -----------------------------------------------------------------------

def test_tiny_tp8_is_the_tiny_config_with_8_heads_in_8_groups(tiny_tp8_checkpoint: Path, tiny_checkpoint: Path) -> None:
    import json

    mine = json.loads((tiny_tp8_checkpoint / "config.json").read_text())
    tiny = json.loads((tiny_checkpoint / "config.json").read_text())
    differ = {k for k in tiny["text_config"] if tiny["text_config"][k] != mine["text_config"][k]}
    assert differ == {"num_attention_heads", "o_groups"}
    assert (mine["text_config"]["num_attention_heads"], mine["text_config"]["o_groups"]) == (8, 8)
    assert {k: v for k, v in mine.items() if k != "text_config"} == {k: v for k, v in tiny.items() if k != "text_config"}


def test_tiny_tp8_checkpoint_verifies(tiny_tp8_checkpoint: Path, capsys) -> None:
    from sglang_dsv41 import cli

    assert cli.main(["verify", str(tiny_tp8_checkpoint), "--quiet"]) == 0
    assert "clean" in capsys.readouterr().out


def test_make_checkpoint_cli_writes_tiny_tp8(tmp_path: Path, tiny_tp8_checkpoint: Path) -> None:
    from sglang_dsv41 import cli

    assert cli.main(["make-checkpoint", "--preset", "tiny-tp8", "--out", str(tmp_path), "--quiet"]) == 0
    for name in ("config.json", "model.safetensors.index.json"):
        assert (tmp_path / name).read_bytes() == (tiny_tp8_checkpoint / name).read_bytes(), name
    assert cli.main(["make-checkpoint", "--preset", "tiny-tp8", "--out", str(tmp_path / "x"), "--layers", "3",
                     "--quiet"]) == 1    # slice-only options are refused


def test_reference_loads_and_generates_on_tiny_tp8(tiny_tp8_checkpoint: Path, tp1_logits) -> None:
    from sglang_dsv41.reference.model import ReferenceModel

    model = ReferenceModel.from_checkpoint(tiny_tp8_checkpoint)
    assert model.cfg.text.num_attention_heads == model.cfg.text.o_groups == 8
    tokens = model.generate(PROMPTS["A"], 4)
    assert len(tokens) == 4 and all(0 <= t < 1024 for t in tokens)
    assert tokens[0] == int(torch.argmax(tp1_logits["A"][len(PROMPTS["A"]) - 1]))  # the runtime agrees


# ---- TP 4 / TP 8 == TP 1 ------------------------------------------------------------------

def _assert_equal_to_tp1(ranks: list[dict[str, object]], tp1: dict[str, torch.Tensor], experts: int) -> None:
    held = [r["held_experts"] for r in ranks]
    assert sorted(e for h in held for e in h) == list(range(experts))     # the ranks really are sharded
    assert all(len(h) == experts // len(ranks) for h in held)
    for rank, got in enumerate(r["logits"] for r in ranks):
        assert got.keys() == tp1.keys()
        for name, want in tp1.items():
            assert got[name].shape == want.shape, (rank, name)
            assert torch.equal(got[name], want), \
                f"rank {rank}, {name}: max |Δ| {float((got[name] - want).abs().max())}"


def test_tp4_logits_equal_tp1_bit_for_bit(tiny_tp8_checkpoint: Path, tmp_path: Path, tp1_logits, text) -> None:
    _assert_equal_to_tp1(run_tp(tiny_tp8_checkpoint, tmp_path, 4, "test_runtime_tp_sizes:short_scenario"), tp1_logits, text.n_routed_experts)


@pytest.mark.slow
def test_tp8_logits_equal_tp1_bit_for_bit(tiny_tp8_checkpoint: Path, tmp_path: Path, tp1_logits, text) -> None:
    _assert_equal_to_tp1(run_tp(tiny_tp8_checkpoint, tmp_path, 8, "test_runtime_tp_sizes:short_scenario"), tp1_logits, text.n_routed_experts)


# ---- shard plan and loader at TP 4 / TP 8 -------------------------------------------------

@pytest.mark.parametrize("size", [4, 8])
def test_plan_at_tp4_and_tp8(text, size: int) -> None:
    plans = [ShardPlan.for_config(text, r, size) for r in range(size)]
    per_rank = 8 // size
    for r, p in enumerate(plans):
        assert list(p.groups) == list(range(r * per_rank, (r + 1) * per_rank))
        assert list(p.heads) == list(range(r * per_rank, (r + 1) * per_rank))     # one head per group
        assert list(p.experts) == list(range(r * per_rank, (r + 1) * per_rank))
    for layer, rows in zip(text.engram_layer_ids, text.engram_num_embeddings):
        blocks = [p.engram_rows[layer] for p in plans]
        assert [i for b in blocks for i in b] == list(range(rows))
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


@pytest.mark.parametrize("size", [4, 8])
def test_shard_loader_at_tp4_and_tp8(tiny_tp8_checkpoint: Path, text, size: int) -> None:
    cfg = DeepseekV41Config.from_file(tiny_tp8_checkpoint)
    with CheckpointReader(tiny_tp8_checkpoint) as reader:
        stored = {name: reader.get(name) for name in reader.names()}
    full = load_shard_weights(stored, cfg, ShardPlan.for_config(text, 0, 1))
    for rank in (0, size - 1):
        plan = ShardPlan.for_config(text, rank, size)
        shard = load_shard_weights(stored, cfg, plan)
        assert {int(n.split(".")[4]) for n in shard if ".ffn.experts." in n} == set(plan.experts)
        for name, value in shard.items():
            assert same_value(value, shard_of(full[name], plan, name)), name
        for layer in text.engram_layer_ids:
            assert shard[f"layers.{layer}.engram.embed.weight"].shape[0] == len(plan.engram_rows[layer])
        assert shard["layers.0.attn.wq_b.weight"].shape[0] == (8 // size) * text.head_dim
        assert shard["layers.0.attn.wo_a.weight"].shape[0] == (8 // size) * text.o_lora_rank
        assert shard["layers.0.attn.attn_sink"].shape == (8 // size,)
        assert shard["layers.0.attn.wo_b.weight"].shape == (text.hidden_size, (8 // size) * text.o_lora_rank)
