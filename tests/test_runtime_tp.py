"""Tensor parallel torch path == TP 1, bit for bit (issue 3; runtime/tensor_parallel.py).

* TP 2 over two spawned processes with a gloo group (file rendezvous, bounded waits) runs
  the shared runtime scenarios (packed extend of mixed lengths, chunked prefill at odd and even
  boundaries mixed with decode, a prefix shared through slots, batched decode) and a single
  request alone under DSpark (below); every rank's logits equal the TP-1 logits exactly (and each other);
* DSpark speculative greedy decoding with the real draft (`dspark_scenarios.dspark_greedy`: draft
  logits through the vocabulary-parallel embedding and gathered LM head, verify logits, tokens) at
  TP 2 == TP 1 bit for bit, and its tokens == plain greedy decoding;
* `--mm-enable-dp-encoder` (`vision_batch.encode_images` with the TP group): the images split over
  the two ranks and all-gathered give TP 1's span rows exactly;
* the shard plan: group/head/expert/Engram-row ranges partition the model, illegal sizes and
  ranks are rejected with a message naming the constraint;
* the shard loader: each rank holds only its experts, Engram rows and vocabulary block of the
  embedding / LM head (SGLang's vocab-parallel split), and every held tensor equals the
  corresponding slice of the TP-1 weights;
* collectives are SGLang's: the harness builds SGLang's parallel state (gloo) and the ranks'
  `TensorParallel.from_sglang()` reduces through `tensor_model_parallel_all_reduce`.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tp_harness import engine_for, run_tp, stored_tensors
from runtime_scenarios import (ContractMeasurement, fixed_decode_tokens, measure_contract, one_shot_logits,
                               run_scenario, scenario_caches)
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.tensor_parallel import (ShardPlan, TensorParallel, TensorParallelError, balanced_block,
                                                  load_shard_weights, vocab_shard)

from runtime_values import same_value

CPU = torch.device("cpu")
TP = 2


_engine = engine_for


def _outputs(engine: TorchForward, ckpt: Path | None = None) -> dict[str, torch.Tensor]:
    """The compared outputs; `ckpt`: the checkpoint (in a `run_tp` worker: the one it loaded)."""
    from dspark_scenarios import dspark_greedy
    from tp_harness import worker_checkpoint

    got = run_scenario(engine, scenario_caches(engine, CPU), CPU, fixed_decode_tokens())
    got["vision_rows"] = _encoder_rows(engine)
    got |= dspark_greedy(engine, ckpt or worker_checkpoint())
    return got


def _encoder_rows(engine: TorchForward) -> torch.Tensor:
    """Five images of three sizes through `vision_batch.encode_images` with the engine's TP group:
    at TP 2 that is `--mm-enable-dp-encoder` (each rank encodes its share, then one all-gather); the
    rows must equal TP 1's, which encodes all five. Seeded weights: the same tower on every rank."""
    from types import SimpleNamespace

    from sglang_dsv41.runtime.forward import fp32_default_dtype
    from sglang_dsv41.runtime.mm_processor import GRID_KEY
    from sglang_dsv41.runtime.vision import VisionTower
    from sglang_dsv41.runtime.vision_batch import encode_images
    from sglang_dsv41.vision_preprocess import ImageGrid

    gen = torch.Generator().manual_seed(17)
    with fp32_default_dtype():
        tower = VisionTower(engine.cfg)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_((0.05 * torch.randn(p.shape, generator=gen)).bfloat16().float())
    items = []
    for i, (n_h, n_w) in enumerate([(2, 3), (1, 1), (3, 3), (2, 2), (1, 2)]):
        g = ImageGrid(resized_width=42 * n_w, resized_height=42 * n_h, vit_h=3 * n_h, vit_w=3 * n_w, n_h=n_h, n_w=n_w,
                      resize_plain=False)
        patches = torch.randn(g.num_patches, 588, generator=gen).bfloat16()
        items.append(SimpleNamespace(hash=i, offsets=[(0, g.num_tokens - 1)], feature=patches,
                                     model_specific_data={GRID_KEY: dict(vars(g))}))
    rows, encoded_here = encode_images(items, tower, engine.tp)
    assert encoded_here == len(items) if engine.tp.size == 1 else 0 < encoded_here < len(items), encoded_here
    return torch.cat(rows)


def tiny_config_experts(ckpt: Path) -> int:
    return DeepseekV41Config.from_file(ckpt).text.n_routed_experts


@pytest.fixture(scope="module")
def tp1_outputs(tiny_checkpoint) -> dict[str, torch.Tensor]:
    return _outputs(_engine(tiny_checkpoint, TensorParallel()), tiny_checkpoint)


def test_tp2_logits_equal_tp1_bit_for_bit(tiny_checkpoint, tmp_path, tp1_outputs) -> None:
    ranks = run_tp(tiny_checkpoint, tmp_path, TP, "test_runtime_tp:_outputs")
    held = [r["held_experts"] for r in ranks]          # the ranks really are sharded
    total = tiny_config_experts(tiny_checkpoint)
    assert sorted(e for h in held for e in h) == list(range(total))
    assert all(0 < len(h) < total for h in held)
    for rank, got in enumerate(r["logits"] for r in ranks):
        assert got.keys() == tp1_outputs.keys()
        for name, want in tp1_outputs.items():
            assert got[name].shape == want.shape, (rank, name)
            assert torch.equal(got[name], want), \
                f"rank {rank}, {name}: max |Δ| {float((got[name] - want).abs().max())}"


def _fp32_contract(engine: TorchForward) -> dict[str, object]:
    """This rank's shard on the fp32 serving backend (what a CPU server runs without
    --enable-deterministic-inference) measured against the reference (`measure_contract`)."""
    import dataclasses

    from test_runtime_numerics_contract import GREEDY_STEPS
    from tp_harness import worker_checkpoint
    from sglang_dsv41.reference.model import ReferenceModel

    fast = TorchForward(engine.cfg, engine.weights, engine.hasher, tp=engine.tp, deterministic=False)
    assert not fast.backend.deterministic
    m = measure_contract(fast, CPU, ReferenceModel.from_checkpoint(worker_checkpoint()), GREEDY_STEPS)
    return dataclasses.asdict(m)


def test_tp2_fp32_serving_path_within_the_numerics_contract(tiny_checkpoint, tmp_path) -> None:
    """TP 2 on gloo with the fp32 CPU backend (SGLang's all-reduce summing fp32 routed partials):
    the end-to-end contract TP 1 is held to — top-1 ≥ 99 % teacher-forced, every logit within
    LOGIT_BOUND of the reference — and both ranks agree."""
    from test_runtime_numerics_contract import LOGIT_BOUND, MIN_TOP1_AGREEMENT

    ranks = [ContractMeasurement(**r["logits"])
             for r in run_tp(tiny_checkpoint, tmp_path, TP, "test_runtime_tp:_fp32_contract")]
    print("\n" + ranks[0].summary("TP 2 fp32 CPU path"))
    assert ranks[0] == ranks[1]
    assert ranks[0].top1 >= MIN_TOP1_AGREEMENT
    assert ranks[0].worst_logit_diff <= LOGIT_BOUND, ranks[0].worst_logit_diff


def test_tp1_engine_equals_the_plain_runtime(tiny_checkpoint, tp1_outputs) -> None:
    """TP 1 through `load_shard_weights` is the plain runtime (reference loader, no tp argument)."""
    from sglang_dsv41.checkpoint.loader import load_reference_weights

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    plain = TorchForward(cfg, load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False),
                         EngramHasher.from_config(cfg, token_map))
    # the DSpark request alone (TP 1; each TP-2 rank equals it bit for bit, above): every verify row
    # it committed == the plain runtime's one-shot logits there, and its tokens == plain greedy
    from dspark_scenarios import DSPARK_PROMPT, ROUNDS

    spec, commits = tp1_outputs["dspark_tokens"].tolist(), tp1_outputs["dspark_commits"].tolist()
    P = len(DSPARK_PROMPT)
    want = one_shot_logits(plain, CPU, DSPARK_PROMPT + spec[:-1])
    assert len(spec) > 1 + ROUNDS and spec == want[P - 1:].argmax(-1).tolist()
    for k, c in enumerate(commits):
        assert torch.equal(tp1_outputs[f"dspark_verify_logits_{k}"][:c], want[P:P + c]), k
        P += c


# ---- shard plan ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text(tiny_checkpoint):
    return DeepseekV41Config.from_file(tiny_checkpoint).text


def test_plan_partitions_groups_heads_experts_and_engram_rows(text) -> None:
    plans = [ShardPlan.for_config(text, r, TP) for r in range(TP)]
    assert [g for p in plans for g in p.groups] == list(range(text.o_groups))
    assert [h for p in plans for h in p.heads] == list(range(text.num_attention_heads))
    assert [e for p in plans for e in p.experts] == list(range(text.n_routed_experts))
    for layer, rows in zip(text.engram_layer_ids, text.engram_num_embeddings):
        assert [i for p in plans for i in p.engram_rows[layer]] == list(range(rows))
    for p in plans:   # heads follow their output group
        assert list(p.heads) == [h for g in p.groups for h in range(g * text.heads_per_group, (g + 1) * text.heads_per_group)]


@pytest.mark.parametrize("vocab", [None, 129280, 1000])
def test_vocab_shards_are_sglangs_vocab_parallel_split(text, vocab) -> None:
    """The embedding / LM-head rows of each rank are the ids SGLang's VocabParallelEmbedding and
    ParallelLMHead give that rank (vocabulary padded to 64, equal blocks, padding held by nobody)."""
    from sglang.srt.layers.vocab_parallel_embedding import pad_vocab_size, vocab_range_from_global_vocab_size

    V = text.vocab_size if vocab is None else vocab
    for size in (1, 2, 4, 8):
        shards = [vocab_shard(V, size, r) for r in range(size)]
        assert [i for held, _ in shards for i in held] == list(range(V))
        for r, (held, per) in enumerate(shards):
            lo, hi = vocab_range_from_global_vocab_size(pad_vocab_size(V), r, size)
            assert (held.start, held.stop, per) == (min(lo, V), min(hi, V), hi - lo)


def test_balanced_block_covers_uneven_counts() -> None:
    blocks = [balanced_block(10, 4, r) for r in range(4)]
    assert [len(b) for b in blocks] == [3, 3, 2, 2]
    assert [i for b in blocks for i in b] == list(range(10))


@pytest.mark.parametrize("size", [3, 4])
def test_plan_rejects_sizes_not_dividing_o_groups(text, size) -> None:
    assert text.o_groups % size   # tiny: 2 groups
    with pytest.raises(TensorParallelError, match=r"must divide o_groups \(2\) and num_attention_heads \(4\)"):
        ShardPlan.for_config(text, 0, size)


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_plan_rejects_invalid_ranks(text, rank, size) -> None:
    with pytest.raises(TensorParallelError, match="not a valid rank"):
        ShardPlan.for_config(text, rank, size)


def test_tensor_parallel_above_one_needs_sglangs_tp_group() -> None:
    with pytest.raises(TensorParallelError, match="needs SGLang's TP group"):
        TensorParallel(0, 2)


def test_tensor_parallel_refuses_a_group_of_another_shape() -> None:
    class Group:          # what TensorParallel reads of SGLang's GroupCoordinator
        world_size, rank_in_group = 4, 1
    with pytest.raises(TensorParallelError, match="rank 1 of 4, asked for rank 0 of 2"):
        TensorParallel(0, 2, Group())


# ---- shard loader -------------------------------------------------------------------------

def test_tp1_shard_loader_equals_runtime_weights(tiny_checkpoint) -> None:
    from sglang_dsv41.runtime.weights import runtime_weights

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    stored = stored_tensors(tiny_checkpoint)
    want = runtime_weights(stored, cfg, CPU, experts_mxfp4=False)
    got = load_shard_weights(stored, cfg, ShardPlan.for_config(cfg.text, 0, 1))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert same_value(got[name], value), name


def shard_of(value: torch.Tensor, plan: ShardPlan, name: str) -> torch.Tensor:
    """The rows (`rows_of`) and columns (`cols_of`: row-parallel linears) of `value` `plan` holds."""
    rows, cols = plan.rows_of(name), plan.cols_of(name)
    if rows is not None:
        value = value[rows.start:rows.stop]
    return value if cols is None else value[:, cols.start:cols.stop]


def test_shard_loader_holds_only_this_ranks_share(tiny_checkpoint, text) -> None:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    stored = stored_tensors(tiny_checkpoint)
    full = load_shard_weights(stored, cfg, ShardPlan.for_config(text, 0, 1))
    for rank in range(TP):
        plan = ShardPlan.for_config(text, rank, TP)
        shard = load_shard_weights(stored, cfg, plan)
        experts = {int(n.split(".")[4]) for n in shard if ".ffn.experts." in n}
        assert experts == set(plan.experts)
        for name, value in shard.items():
            assert same_value(value, shard_of(full[name], plan, name)), name
        i = text.engram_layer_ids[0]
        assert shard[f"layers.{i}.engram.embed.weight"].shape[0] == len(plan.engram_rows[i]) < text.engram_num_embeddings[0]
        assert shard["layers.0.attn.wq_b.weight"].shape[0] == len(plan.heads) * text.head_dim
        assert shard["layers.0.attn.wo_a.weight"].shape[0] == len(plan.groups) * text.o_lora_rank
        assert shard["layers.0.attn.attn_sink"].shape == (len(plan.heads),)
        # row-parallel wo_b: the input columns of this rank's groups; the tiny shared expert (32
        # columns) would split a 32-wide tile at TP 2, so the plan replicates it
        assert shard["layers.0.attn.wo_b.weight"].shape == (text.hidden_size, len(plan.groups) * text.o_lora_rank)
        assert plan.shared is None
        assert shard["layers.0.ffn.shared_experts.w2.weight"].shape == full["layers.0.ffn.shared_experts.w2.weight"].shape
        for name in ("embed.weight", "head.weight"):     # vocabulary-parallel rows
            assert shard[name].shape == (len(plan.vocab), text.hidden_size) and len(plan.vocab) < text.vocab_size


def test_tp2_static_decode_equals_tp1(tiny_checkpoint, tmp_path) -> None:
    """The static (CUDA-graph) decode forward at TP 2 — sharded Engram rows gathered without a
    host check — gives TP 1's live logits bit for bit (CPU, padded batches)."""
    from cuda_graph_scenarios import static_decode_logits

    want = static_decode_logits(engine_for(tiny_checkpoint, TensorParallel()))
    for rank in run_tp(tiny_checkpoint, tmp_path, TP, "cuda_graph_scenarios:static_decode_logits"):
        assert rank["logits"].keys() == want.keys()
        for name, logits in want.items():
            assert torch.equal(rank["logits"][name], logits), name
