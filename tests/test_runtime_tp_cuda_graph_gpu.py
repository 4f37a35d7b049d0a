"""CUDA-graph capture of the static decode forward at TP 2 with NCCL collectives (issue 3: graphs at TP > 1).

The question: does capture + replay of the static TP-2 decode step — attention groups, routed
experts, Engram rows and the vocabulary sharded, `TensorParallel.all_gather` / `all_reduce_sum`
(fp32 MoE partials, Engram and embedding rows, head logits) through SGLang's TP `GroupCoordinator`
(custom all-reduce / pynccl, captured inside its `graph_capture` context as SGLang's runner does)
— give the eager bits? The runtime's launcher adds `--disable-cuda-graph` at TP > 1 until this passes
(runtime/requirements.py: `cuda_graph_tp_sizes`).

GPU (`gpu`, two CUDA devices; skipped with the reason otherwise): `tp_harness.run_tp(...,
backend="nccl")` spawns one process per GPU (rank r on cuda:r, the engine loaded as the server
loads it, SGLang's default NCCL environment, SGLang's parallel state built as its scheduler
builds it) and runs `cuda_graph_scenarios.graph_decode_steps`
on each: the four requests prefilled, step 0 (batch 6 = 4 live + 2 SGLang padding requests)
eager, two warm-ups on a side stream, the step captured on that stream in every rank in the same
order (SGLang's sync + barrier before each warm-up and the capture), replayed with step 0's
inputs over a restored cache copy, then with step 1's inputs against eager. Asserted:

1. replay == eager bit for bit on each rank (steps 0 and 1, every padded row) and the graph's
   caches equal the eager caches byte for byte after each step. Step 1 has new tokens, slots and
   positions: a replay whose collectives did not run (or ran on stale buffers) would miss the
   other rank's experts / Engram rows / attention groups and differ;
2. both ranks' logits are identical (the result is replicated; a 2-rank float64 / fp32 sum is one
   commutative addition, so it is the same on both ranks whatever NCCL's algorithm), and the
   ranks really are sharded (expert blocks partition the experts);
3. TP 2 vs the TP-1 CUDA static forward (same scenario in-process on cuda:0, eager and replay):
   greedy tokens equal on every live row and the greedy token's log-probability within
   `GPU_LOGPROB_BOUND` (0.1 nats, tests/test_runtime_tp_server.py — the server test's quantity
   and bound). Why a bound and not bits: at TP 2 the per-rank dense shapes are narrower (wq_b
   rows, grouped wo_a) so the tensor-core kernels may pick other tiles, and the expert-parallel
   MoE forms the float64 routed sum in torch instead of the fused combine kernel (same finalize up
   to fp64 summation order, runtime/moe_ops.py); one BF16 ulp in every attention sublayer of the
   tiny model moves logits by ≈ 0.07 (checkpoint/synth.py), a wrong shard by far more. The max
   |Δ logit| and |Δ log p| are printed (`-s`) for docs/validation.md.

A capture failure on any rank fails the test with that rank's exception text (the harness
reports each rank's traceback file and kills the peers, which may be blocked in an NCCL kernel
waiting for the failed rank); every wait is capped by `GPU_TIMEOUT_S`.

CPU: `run_tp`'s new parameters are validated before anything is spawned, and a dry run of the
whole test — gloo ranks, `EagerReplay` standing in for the graph — passes the same checks, with
TP 2 equal to TP 1 bit for bit (the CPU forward is exact). It checks the scenario's bookkeeping
and this file's assertions, not capture.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tp_harness
from cuda_graph_scenarios import graph_decode_steps
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.runtime.tensor_parallel import TensorParallel
from test_runtime_tp_server import GPU_LOGPROB_BOUND
from tp_harness import TPHarnessError, engine_for, run_tp

TP = 2
SCENARIO = "cuda_graph_scenarios:graph_decode_steps"
#: (eager, replayed) logits per decode step, as `graph_decode_steps` names them
STEPS = (("eager0", "replay0"), ("eager1", "replay1"))
#: cap on the spawned ranks (engine build + Triton compiles from the parent's warm cache + capture)
GPU_TIMEOUT_S = 300


# ---- checks shared by the GPU test and its CPU dry run ------------------------------------------

def assert_replay_equals_eager(ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        out = r["logits"]
        for step, (eager, replay) in enumerate(STEPS):
            got, want = out[replay], out[eager]
            assert got.shape == want.shape, (rank, step, got.shape, want.shape)
            delta = float((got - want).abs().max())
            assert torch.equal(got, want), f"rank {rank}, step {step}: replayed logits differ from eager (max |Δ| {delta:.3g})"
            diffs = out[f"cache_diffs{step}"]
            assert not diffs, f"rank {rank}, step {step}: graph and eager wrote different caches: {diffs}"


def assert_ranks_identical_and_sharded(ranks: list[dict], n_experts: int) -> None:
    held = [r["held_experts"] for r in ranks]
    assert sorted(e for h in held for e in h) == list(range(n_experts)), held
    assert all(0 < len(h) < n_experts for h in held), held
    first = ranks[0]["logits"]
    for rank, r in enumerate(ranks[1:], start=1):
        assert r["logits"]["live"] == first["live"]
        for name in (n for pair in STEPS for n in pair):
            delta = float((r["logits"][name] - first[name]).abs().max())
            assert torch.equal(r["logits"][name], first[name]), f"rank {rank} vs rank 0, {name}: max |Δ| {delta:.3g}"


def compare_with_tp1(tp1: dict, ranks: list[dict]) -> dict[str, float]:
    """Greedy tokens equal on every live row (asserted); returns max |Δ logit| and the max |Δ log p|
    of TP 1's greedy token over every step, eager and replayed, of rank 0 (the ranks agree)."""
    live = tp1["live"]
    assert ranks[0]["logits"]["live"] == live
    max_logit = max_logprob = 0.0
    for name in (n for pair in STEPS for n in pair):
        want, got = tp1[name][:live].double(), ranks[0]["logits"][name][:live].double()
        tokens_want, tokens_got = want.argmax(dim=-1), got.argmax(dim=-1)
        assert torch.equal(tokens_got, tokens_want), f"{name}: greedy tokens TP 2 {tokens_got.tolist()} != TP 1 {tokens_want.tolist()}"
        pick = tokens_want[:, None]
        lp_want = torch.log_softmax(want, dim=-1).gather(1, pick)
        lp_got = torch.log_softmax(got, dim=-1).gather(1, pick)
        max_logit = max(max_logit, float((got - want).abs().max()))
        max_logprob = max(max_logprob, float((lp_got - lp_want).abs().max()))
    return {"max_abs_dlogit": max_logit, "max_abs_dlogp": max_logprob}


def n_routed_experts(ckpt: Path) -> int:
    return DeepseekV41Config.from_file(ckpt).text.n_routed_experts


# ---- CPU: request validation and the dry run ----------------------------------------------------

@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("run_tp spawned workers for a request it should have refused")
    monkeypatch.setattr(tp_harness.mp, "start_processes", refuse)


def test_nccl_without_enough_cuda_devices_is_refused_before_spawning(tmp_path: Path, no_spawn) -> None:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    size = found + 1
    reason = rf"TP {size} needs {size} CUDA devices, found {found}" if dist.is_nccl_available() else "has no NCCL"
    with pytest.raises(TPHarnessError, match=reason):
        run_tp(tmp_path / "no-checkpoint", tmp_path, size, SCENARIO, backend="nccl")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend="mpi"), r"backend 'mpi' is not one of \('gloo', 'nccl'\)"),
    (dict(timeout_s=0), "timeout_s must be positive"),
    (dict(size=0), "TP size 0 < 1"),
])
def test_invalid_requests_are_refused_before_spawning(tmp_path: Path, no_spawn, kwargs: dict, message: str) -> None:
    size = kwargs.pop("size", TP)
    with pytest.raises(TPHarnessError, match=message):
        run_tp(tmp_path / "no-checkpoint", tmp_path, size, SCENARIO, **kwargs)


def test_cpu_engine_refuses_other_devices(tiny_checkpoint: Path) -> None:
    with pytest.raises(TPHarnessError, match="no runtime for device meta"):
        engine_for(tiny_checkpoint, TensorParallel(), torch.device("meta"))


def test_cpu_dry_run_of_the_tp2_capture_test(tiny_checkpoint: Path, tmp_path: Path) -> None:
    tp1 = graph_decode_steps(engine_for(tiny_checkpoint, TensorParallel()))
    ranks = run_tp(tiny_checkpoint, tmp_path, TP, SCENARIO)
    assert tp1["live"] == 4 and tp1["eager0"].shape[0] == 6
    assert not torch.equal(tp1["eager0"], tp1["eager1"])          # step 1 is a different step
    assert_replay_equals_eager([{"logits": tp1}])
    assert_replay_equals_eager(ranks)
    assert_ranks_identical_and_sharded(ranks, n_routed_experts(tiny_checkpoint))
    assert compare_with_tp1(tp1, ranks) == {"max_abs_dlogit": 0.0, "max_abs_dlogp": 0.0}
    for name in (n for pair in STEPS for n in pair):                 # padding rows too: CPU TP 2 is exact
        assert torch.equal(ranks[0]["logits"][name], tp1[name]), name


def test_failing_rank_is_reported_with_its_exception_text(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """One rank raises while its peer never returns (as a peer blocked in an NCCL kernel for the
    dead rank): the rank's exception text within seconds, the peer killed — not the timeout."""
    with pytest.raises(RuntimeError, match=r"(?s)a rank (raised|exited).*rank 1 raised.*only rank 1 fails"):
        run_tp(tiny_checkpoint, tmp_path, TP, "test_runtime_tp_cuda_graph_gpu:rank1_fails", timeout_s=120)


def rank1_fails(engine) -> dict:
    """Scenario: rank 1 raises; rank 0 blocks far past the timeout (killed by the parent)."""
    if engine.tp.rank == 1:
        raise ValueError("only rank 1 fails")
    time.sleep(1000)
    return {}


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_results(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if torch.cuda.device_count() < TP:
        pytest.skip(f"needs {TP} CUDA devices (one NCCL rank each), found {torch.cuda.device_count()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    # TP 1 first, in-process on cuda:0: the oracle, and it fills the Triton cache the ranks then read
    tp1 = graph_decode_steps(engine_for(tiny_checkpoint, TensorParallel(), torch.device("cuda", 0)))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ranks = run_tp(tiny_checkpoint, tmp_path_factory.mktemp("tp2-graph"), TP, SCENARIO, backend="nccl",
                   timeout_s=GPU_TIMEOUT_S)
    return {"tp1": tp1, "ranks": ranks}


@pytest.mark.gpu
def test_tp2_replay_equals_eager_bit_for_bit(gpu_results: dict) -> None:
    assert_replay_equals_eager(gpu_results["ranks"])
    print(f"\n[tp2 cuda-graph] both ranks: {len(STEPS)} replayed decode steps (batch 6) == eager, caches identical")


@pytest.mark.gpu
def test_tp2_ranks_agree_and_are_sharded(gpu_results: dict, tiny_checkpoint: Path) -> None:
    assert_ranks_identical_and_sharded(gpu_results["ranks"], n_routed_experts(tiny_checkpoint))


@pytest.mark.gpu
def test_tp1_reference_replay_equals_eager(gpu_results: dict) -> None:
    """The oracle itself: at TP 1 the same scenario replays bit for bit (as test_runtime_cuda_graph_gpu)."""
    assert_replay_equals_eager([{"logits": gpu_results["tp1"]}])


@pytest.mark.gpu
def test_tp2_equals_tp1_within_the_tp_bound(gpu_results: dict) -> None:
    deltas = compare_with_tp1(gpu_results["tp1"], gpu_results["ranks"])
    print(f"\n[tp2 cuda-graph] vs TP 1 (live rows, steps 0-1, eager + replay): greedy tokens equal, "
          f"max |Δ logit| {deltas['max_abs_dlogit']:.3g}, max |Δ log p| {deltas['max_abs_dlogp']:.3g}")
    assert deltas["max_abs_dlogp"] <= GPU_LOGPROB_BOUND, deltas
