"""The runtime forward on CUDA through the Triton kernels (`runtime/attention_ops.py`).

Why there is no end-to-end logit bound against the reference. Measured on the tiny random
checkpoint (CPU, docs/runtime.md "CUDA numerics"): moving ONE element of ONE attention output by
one BF16 ulp — the kernel's stated error — moves that token's logits by up to 0.36 and a later
token's by up to 3.7 (logit std ≈ 2, largest |logit| ≈ 10); the kernel path (Triton interpreter)
ends up to 7.1 from the reference over the packed scenarios. The random weights amplify every
rounding difference ≈ 2–4× per layer (with and without FP8 activation quantisation), so no
useful end-to-end bound — nor greedy-token equality, with top-2 margins of 0.005–1 — exists for
any path that is not bit-identical. What is pinned instead, each exactly or at the kernel's
own stated bound:

1. every sublayer of the packed scenarios (`runtime_scenarios.py`: requests of 49–61 tokens,
   chunked prefill at odd/even starts mixed with decode, a page-aligned prefix shared through
   slots; packed FP4 compressed rows, contracts phase 2 §1–§4), on identical inputs recorded
   from the CPU forward (SWA rows, packed rows, entry indices): the CUDA `attend` is within one BF16 ulp of
   the output scale (max |o| of that query and head) of the CPU float64 value, and the CUDA
   `select` returns exactly the CPU selection and candidate blocks (the scores are bitwise
   equal: float64 head sum);
2. batch invariance of the whole CUDA forward in deterministic mode (`--enable-deterministic-inference`:
   one attention key split, packed rows at prefill, W8A16 FP8 linears, BF16-weight rows in 128-row
   blocks, one mHC coefficient kernel (`mhc_ops.DETERMINISTIC_MIX`); `TorchForward(deterministic=True)`): the packed scenarios give every request bit for bit
   the logits of that request run alone in one shot — chunking, batching and prefix caching change
   nothing on CUDA (as on CPU, where both equal the reference); the prefill workspace's size rule
   lowered to `WORKSPACE_MIN_QUERIES`, no batch takes it;
3. the serving default (split-KV `plan_decode_config` attention: a query's bits depend on its
   batch's size; the BF16 prefill workspace, its size rule lowered to `WORKSPACE_MIN_QUERIES` so
   every batch but the decode-only one takes it; W8A8 FP8 linears; BF16-weight rows in one GEMM;
   the mHC coefficient kernel by token count (`auto`); GPU only): the same scenarios within the numerics contract of each request alone —
   |Δlogit| ≤ `SERVING_VS_ALONE_BOUND` = 2 × `LOGIT_BOUND` (the contract holds each serving run
   within `LOGIT_BOUND` of the reference, tests/test_runtime_numerics_contract.py) and top-1
   agreement ≥ `MIN_TOP1_AGREEMENT`; the scenario's last batch (4 decode tokens) plans key splits
   over the packed rows, the one-shot runs (≥ 49 tokens) one split over the workspace;
4. the CUDA forward runs through the kernels (every attention sublayer of every batch);
5. the mHC residual streams held as BF16 (`mhc_ops.TritonMhc.residual_dtype`, GPU only): a prefill, a
   decode step and the DSpark captures give, bit for bit, what R held as fp32 gives, in deterministic and
   serving mode.
The end-to-end distance to the reference is printed for docs/validation.md, not asserted.

Without TRITON_INTERPRET these tests are marked `gpu` and run on CUDA. With TRITON_INTERPRET=1
set before triton is imported they run on CPU tensors through the same kernels in Triton's
interpreter (`tests/test_runtime_attention_ops.py` does that on CPU machines).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime_scenarios import (DECODE_STEPS, SHARED_PREFIX, fixed_decode_tokens, full_tokens, layout_to,
                               greedy_generate, one_shot_logits, run_scenario, runtime_engine,
                               scenario_caches)
from runtime_values import with_linear_layers
from test_runtime_numerics_contract import LOGIT_BOUND, MIN_TOP1_AGREEMENT
from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.kernels import indexer as kernel_indexer
from sglang_dsv41.kernels import sparse_attention as kernel_attention
from sglang_dsv41.runtime import attention_ops, mhc_ops
from sglang_dsv41.runtime import attention_prefill as AP
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.kv_layout import PackedSourceRows

INTERPRETED = kernel_attention._is_interpreted() and kernel_indexer.INTERPRETED
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
CPU = torch.device("cpu")
BATCHES = 5                                   # run_scenario's batches
#: the prefill workspace's size rule in the scenario tests (`attention_prefill.PREFILL_MIN_QUERIES`):
#: above the split-KV decode sizes, below the scenario's prefill batches
WORKSPACE_MIN_QUERIES = kernel_attention.DECODE_SPLIT_MAX_QUERIES + 1
pytestmark = [] if INTERPRETED else [pytest.mark.gpu]


@pytest.fixture(scope="module")
def models(tiny_checkpoint) -> tuple[DeepseekV41Config, TorchForward, TorchForward]:
    """(config, CPU forward = the reference path, forward on DEVICE = the kernel path)."""
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    hasher = EngramHasher.from_config(cfg, token_map)
    cpu = TorchForward(cfg, weights, hasher)
    # deterministic mode (CUDA: MXFP4 experts and E4M3 dense weights as the server, W8A16, one key split)
    on_device = runtime_engine(tiny_checkpoint, DEVICE, deterministic=True)
    return cfg, cpu, on_device


def _kernel_ops(deterministic: bool) -> attention_ops.KernelAttentionOps:
    """The mode's kernel implementation (the interpreter's on CPU tensors; CUDA: what `ops_for` gives)."""
    if INTERPRETED:
        return attention_ops.KernelAttentionOps(kernel_attention, kernel_indexer, deterministic=deterministic)
    ops = attention_ops.ops_for(DEVICE, torch.float32, deterministic)
    assert isinstance(ops, attention_ops.KernelAttentionOps), f"CUDA dispatches to {type(ops).__name__}"
    return ops


@pytest.fixture(scope="module")
def kernel_ops() -> attention_ops.KernelAttentionOps:
    """The serving default's kernels (split-KV attention plan; fp64 head sum)."""
    return _kernel_ops(False)


def _count_dispatch(monkeypatch, engine: TorchForward, deterministic: bool) -> dict[str, list[int]]:
    """`engine` runs the mode's kernels (under the interpreter: on CPU tensors too); records the
    query count of each call (`attend` / `select`) and of each attend over the prefill workspace
    (`workspace`)."""
    ops = _kernel_ops(deterministic)
    assert INTERPRETED or engine.attention_ops is ops
    calls: dict[str, list[int]] = {"attend": [], "select": [], "workspace": []}

    class Counting:
        description, splits, prefill = ops.description, ops.splits, ops.prefill

        def attend(self, *args, **kwargs):
            calls["attend"].append(args[0].shape[0])
            if kwargs.get("workspace") is not None:
                calls["workspace"].append(args[0].shape[0])
            return ops.attend(*args, **kwargs)

        def prefill_workspace(self, *args):
            return ops.prefill_workspace(*args)

        def select(self, *args, **kwargs):
            calls["select"].append(args[5].shape[0])
            return ops.select(*args, **kwargs)

    monkeypatch.setattr(engine, "attention_ops", Counting())
    return calls


@pytest.fixture(scope="module")
def reference_logits(models) -> dict[str, torch.Tensor]:
    """CPU path (bit-identical to ReferenceModel) of each request's scenario tokens, one shot."""
    _, cpu, _ = models
    decode = fixed_decode_tokens()
    return {name: one_shot_logits(cpu, CPU, full_tokens(name, decode)) for name in DECODE_STEPS}


def _snapshot(arg, device: torch.device | None = None):
    """A copy of one attend argument (tensor, packed rows or None), optionally moved to `device`."""
    if arg is None:
        return None
    if isinstance(arg, PackedSourceRows):
        move = (lambda t: t.clone()) if device is None else (lambda t: t.to(device))
        return dataclasses.replace(arg, latent_rows=move(arg.latent_rows), key_rows=move(arg.key_rows))
    return arg.clone() if device is None else arg.to(device)


@pytest.fixture(scope="module")
def recorded(models) -> dict[str, list]:
    """Every attend / select call of the packed scenarios on the CPU path: inputs and outputs."""
    cfg, cpu, _ = models
    calls: dict[str, list] = {"attend": [], "select": []}
    torch_ops = cpu.attention_ops

    class Recording:
        description = "recording"

        def attend(self, q, sink, swa_cache, swa_slots, packed, comp_entries, memo=None):
            out = torch_ops.attend(q, sink, swa_cache, swa_slots, packed, comp_entries)
            args = tuple(_snapshot(a) for a in (q, sink, swa_cache, swa_slots, packed, comp_entries))
            calls["attend"].append((args, out))
            return out

        def prefill_workspace(self, *args):
            return torch_ops.prefill_workspace(*args)

        def select(self, be, cfg_, role, w, prefix, x, q_lora, layout, caches, inv_freq, act_quant, published,
                   entry_tables=None, query_tiles=None, key_workspaces=None):
            out = torch_ops.select(be, cfg_, role, w, prefix, x, q_lora, layout, caches, inv_freq, act_quant,
                                   published, entry_tables)
            calls["select"].append(dict(
                role=role, prefix=prefix, x=x.clone(), q_lora=q_lora.clone(),
                layout=dataclasses.replace(layout, req_to_token=layout.req_to_token.clone()),
                latent_rows=caches.latent_rows.clone(), key_rows=caches.key_rows.clone(), inv_freq=inv_freq,
                act_quant=act_quant,
                published=None if published is None else published.clone(), want=out))
            return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "attention_ops", Recording())
        run_scenario(cpu, scenario_caches(cpu, CPU), CPU, fixed_decode_tokens())
    return calls


def _bf16_ulp_of_output_scale(o: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp of max |o| over head_dim, per (query, head): 2^(⌊log2 scale⌋ − 7)."""
    scale = o.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -120)
    return torch.exp2(torch.floor(torch.log2(scale)) - 7)


@pytest.mark.parametrize("deterministic", [False] if INTERPRETED else [False, True],
                         ids=lambda d: "deterministic" if d else "serving")   # one plan on the interpreter (1 SM)
def test_attention_within_one_bf16_ulp_of_cpu_on_identical_inputs(models, recorded, deterministic: bool) -> None:
    cfg, _, _ = models
    ops = _kernel_ops(deterministic)
    assert len(recorded["attend"]) == BATCHES * cfg.text.num_hidden_layers
    differing, total = 0, 0
    for i, (args, want) in enumerate(recorded["attend"]):
        got = ops.attend(*(_snapshot(a, DEVICE) for a in args)).cpu()
        assert got.shape == want.shape and got.dtype == torch.bfloat16      # the kernel's BF16, not widened
        got = got.float()
        excess = float(((got - want).abs() - _bf16_ulp_of_output_scale(want)).max())
        assert excess <= 0.0, f"call {i} (layer {i % cfg.text.num_hidden_layers}): |Δo| exceeds one BF16 ulp " \
                              f"of the output scale by {excess:.3g}"
        differing, total = differing + int((got != want).sum()), total + want.numel()
    print(f"kernel attend ({ops.splits} key splits) vs CPU on identical inputs: {differing / total:.1%} of the "
          "outputs differ, each by ≤ 1 BF16 ulp of its output scale")


def test_selection_equals_cpu_on_identical_inputs(models, recorded, kernel_ops) -> None:
    cfg, cpu, on_device = models
    roles = [r for r in cfg.text.layer_roles() if r.runs_indexer]
    assert len(recorded["select"]) == BATCHES * len(roles)
    # the CPU path's (dequantised) weights on the device with the exact torch backend: the query
    # projection is then the CPU path's product on identical weights
    exact_weights = with_linear_layers({name: value.to(DEVICE) for name, value in cpu.weights.items()
                                        if ".attn." in name}, cfg)
    assert any(r.candidate_source for r in roles) and any(r.candidate_consumer for r in roles)
    caches = scenario_caches(on_device, DEVICE)
    for call in recorded["select"]:
        role = call["role"]
        caches = dataclasses.replace(caches, latent_rows=call["latent_rows"].to(DEVICE),
                                     key_rows=call["key_rows"].to(DEVICE))
        selection, blocks = kernel_ops.select(
            ExactTorchBackend(), cfg.text, role, exact_weights, call["prefix"], call["x"].to(DEVICE), call["q_lora"].to(DEVICE),
            layout_to(call["layout"], DEVICE), caches, call["inv_freq"].to(DEVICE), call["act_quant"],
            None if call["published"] is None else call["published"].to(DEVICE))
        want_selection, want_blocks = call["want"]
        assert torch.equal(selection.cpu(), want_selection), f"layer {role.layer}: selection differs"
        if role.candidate_source:
            assert blocks is not None and torch.equal(blocks.cpu(), want_blocks), f"layer {role.layer}: blocks differ"
        else:
            assert blocks is None


def test_packed_chunked_and_prefix_batches_equal_each_request_alone(models, reference_logits,
                                                                   monkeypatch) -> None:
    """Deterministic mode: bit for bit (item 2)."""
    cfg, _, on_device = models
    decode = fixed_decode_tokens()
    monkeypatch.setattr(AP, "PREFILL_MIN_QUERIES", WORKSPACE_MIN_QUERIES)
    dispatch = _count_dispatch(monkeypatch, on_device, deterministic=True)
    assert INTERPRETED or (on_device.attention_ops.splits, on_device.attention_ops.prefill) == ("one", "packed")
    assert INTERPRETED or not on_device.backend.dense.whole_rows
    assert INTERPRETED or on_device.mhc.mix == mhc_ops.DETERMINISTIC_MIX     # one mHC kernel at every batch size
    got = run_scenario(on_device, scenario_caches(on_device, DEVICE), DEVICE, decode)
    assert len(dispatch["attend"]) == BATCHES * cfg.text.num_hidden_layers
    assert not dispatch["workspace"], "deterministic mode took the prefill workspace"
    assert len(dispatch["select"]) == BATCHES * sum(r.runs_indexer for r in cfg.text.layer_roles())
    assert set(got) == set(DECODE_STEPS)
    worst_vs_reference = 0.0
    for name, logits in got.items():
        tokens = full_tokens(name, decode)
        assert logits.shape[0] == len(tokens) - (SHARED_PREFIX if name == "D" else 0)
        assert torch.isfinite(logits).all(), name
        alone = one_shot_logits(on_device, DEVICE, tokens)[-logits.shape[0]:]
        assert torch.equal(logits, alone), (f"request {name}: batched/chunked/prefix-shared logits differ from "
                                            f"the request alone by up to {float((logits - alone).abs().max()):.3g}")
        reference = reference_logits[name][-logits.shape[0]:]
        worst_vs_reference = max(worst_vs_reference, float((logits - reference).abs().max()))
    print(f"kernel path on {DEVICE.type}{' (Triton interpreter)' if INTERPRETED else ''} vs reference: "
          f"max |Δlogit| = {worst_vs_reference:.3g} over the packed scenarios (informative, not a bound)")


#: Two serving runs of the same request, each within the contract's LOGIT_BOUND of the reference.
SERVING_VS_ALONE_BOUND = 2 * LOGIT_BOUND


@pytest.mark.skipif(INTERPRETED, reason="one attention plan on the interpreter (1 SM); GPU only")
def test_serving_default_batches_match_each_request_alone_within_the_contract(tiny_checkpoint, reference_logits,
                                                                              monkeypatch) -> None:
    """The serving default (item 3): split-KV attention plans depend on the batch size, so the bits
    may differ from the request alone; the distance stays within the numerics contract. Every
    batch of more than DECODE_SPLIT_MAX_QUERIES tokens takes the prefill workspace."""
    from sglang_dsv41.kernels.sparse_attention import DECODE_SPLIT_MAX_QUERIES

    serving = runtime_engine(tiny_checkpoint, DEVICE, deterministic=False)
    ops = serving.attention_ops
    assert (ops.splits, ops.prefill, serving.backend.fp8_gemm) == ("decode", "wide", "w8a8_fold")
    assert serving.backend.dense.whole_rows and serving.mhc.mix == "auto"     # mHC kernel by token count
    monkeypatch.setattr(AP, "PREFILL_MIN_QUERIES", WORKSPACE_MIN_QUERIES)
    decode = fixed_decode_tokens()
    dispatch = _count_dispatch(monkeypatch, serving, deterministic=False)
    got = run_scenario(serving, scenario_caches(serving, DEVICE), DEVICE, decode)
    batch_sizes = set(dispatch["attend"])
    assert min(batch_sizes) <= DECODE_SPLIT_MAX_QUERIES < max(batch_sizes), batch_sizes   # both plans ran
    text = serving.cfg.text
    per_batch = dispatch["attend"][::text.num_hidden_layers]                  # each batch's query count
    prefill_batches = sum(n >= WORKSPACE_MIN_QUERIES for n in per_batch)
    assert prefill_batches >= 3 and len(dispatch["workspace"]) == prefill_batches * sum(
        r.ratio > 0 for r in text.layer_roles()), (per_batch, dispatch["workspace"])   # every compressed layer
    worst, worst_ref, agree, total = 0.0, 0.0, 0, 0
    for name, logits in got.items():
        tokens = full_tokens(name, decode)
        assert torch.isfinite(logits).all(), name
        alone = one_shot_logits(serving, DEVICE, tokens)[-logits.shape[0]:]
        worst = max(worst, float((logits - alone).abs().max()))
        worst_ref = max(worst_ref, float((logits - reference_logits[name][-logits.shape[0]:]).abs().max()))
        agree += int((logits.argmax(dim=-1) == alone.argmax(dim=-1)).sum())
        total += logits.shape[0]
    print(f"serving default: batched vs alone max |Δlogit| = {worst:.3g}, top-1 agreement {agree}/{total}; "
          f"vs reference {worst_ref:.3g} (informative)")
    assert worst <= SERVING_VS_ALONE_BOUND, f"batched vs alone: max |Δlogit| {worst:.4g} > {SERVING_VS_ALONE_BOUND}"
    assert agree >= MIN_TOP1_AGREEMENT * total, f"top-1 agreement {agree}/{total} < {MIN_TOP1_AGREEMENT:.0%}"


#: Stated end-to-end bound of the CUDA path against the float64 reference on the tiny checkpoint
#: (generator v2, well conditioned: a one-BF16-ulp nudge of every attention sublayer moves the
#: logits by ≤ 0.071, tests/test_checkpoint_conditioning.py). The CUDA path differs from the
#: reference by one BF16 ulp per attention output at most, fp32-accumulated tensor-core GEMMs
#: (runtime/dense_ops.py bound) and MXFP4-kernel rounding flips in ≤ 2 % of MoE outputs.
LOGIT_BOUND_VS_REFERENCE = 0.25
GREEDY_STEPS = 64


@pytest.mark.skipif(INTERPRETED, reason="64 decode steps through the interpreter take minutes; GPU only")
def test_greedy_64_steps_and_logits_match_the_reference(models, tiny_checkpoint) -> None:
    """The issue's end-to-end GPU check: greedy tokens of the CUDA path equal the float64
    reference's for 64 steps, and the logits along the way stay within the stated bound."""
    from sglang_dsv41.reference.model import ReferenceModel

    _, _, on_device = models
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    worst = 0.0
    for seed, length in ((11, 23), (12, 70)):                # shorter and longer than window/top-k/candidate span
        g = torch.Generator().manual_seed(seed)
        prompt_ids = [0] + torch.randint(3, 990, (length - 1,), generator=g).tolist()
        want = reference.generate(prompt_ids, GREEDY_STEPS)
        got = greedy_generate(on_device, DEVICE, prompt_ids, GREEDY_STEPS)
        ref_logits = reference.forward(reference.new_request(), prompt_ids + want[:-1]).logits
        logits = one_shot_logits(on_device, DEVICE, prompt_ids + want[:-1])
        delta = float((logits - ref_logits).abs().max())
        worst = max(worst, delta)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        print(f"prompt {length} tokens: max |Δlogit| vs reference = {delta:.4g}; greedy tokens "
              f"{'equal for ' + str(GREEDY_STEPS) + ' steps' if first_diff is None else f'differ from step {first_diff}'}")
        assert got == want, f"greedy tokens differ from step {first_diff}"
    assert worst <= LOGIT_BOUND_VS_REFERENCE, f"max |Δlogit| {worst:.4g} > stated bound {LOGIT_BOUND_VS_REFERENCE}"


@pytest.mark.skipif(INTERPRETED, reason="the CPU engine holds R as fp32; interpreter: tests/test_runtime_triton_backend.py")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "serving"])
def test_bf16_residual_streams_keep_the_forward_bits(tiny_checkpoint, deterministic: bool, monkeypatch) -> None:
    """The CUDA forward holds R as BF16 (R holds BF16 values, spec §3.2): a 70-token prefill, one decode
    step and the DSpark captures of two layers equal, bit for bit, those with R held as fp32 (each run
    twice first: the path repeats its own bits)."""
    from runtime_scenarios import prefill_then_decode

    engine = runtime_engine(tiny_checkpoint, DEVICE, deterministic=deterministic)
    assert isinstance(engine.mhc, mhc_ops.TritonMhc) and engine.mhc.residual_dtype == torch.bfloat16
    engine.set_capture_layers([0, engine.text.num_hidden_layers - 1])
    g = torch.Generator().manual_seed(21)
    tokens = [0] + torch.randint(3, 990, (70,), generator=g).tolist()

    held_bf16 = prefill_then_decode(engine, DEVICE, tokens)
    assert all(torch.equal(a, b) for a, b in zip(held_bf16, prefill_then_decode(engine, DEVICE, tokens))), \
        "the BF16 path does not repeat its bits"
    monkeypatch.setattr(engine.mhc, "residual_dtype", torch.float32)
    held_fp32 = prefill_then_decode(engine, DEVICE, tokens)
    for i, (a, b) in enumerate(zip(held_bf16, held_fp32)):
        assert torch.equal(a, b), (i, float((a - b).abs().max()))
