"""`benchmarks/moe_prefill_flags.py` on CPU (its timing needs CUDA): the opt-flag recorder wraps
triton_kernels' `make_opt_flags`, records each GEMM's flags and restores the function, also after an error;
the output comparison tells equal bits from differing outputs in BF16 ulps; the flag sets parse as
SGLANG_DSV41_MOE_PREFILL_FLAGS; without CUDA the script refuses."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton_kernels import matmul_ogs as ogs

from benchmark_loader import load_benchmark
from sglang_dsv41.kernels.moe_mxfp4_flags import PREFILL_FLAGS_ENV, parse_decode_flags

bench = load_benchmark("moe_prefill_flags.py")


def test_recorder_records_each_gemm_and_restores(monkeypatch) -> None:
    calls = iter([SimpleNamespace(block_m=128, block_n=256, block_k=128, num_stages=3),
                  SimpleNamespace(block_m=64, block_n=128, block_k=64, num_stages=4)])
    monkeypatch.setattr(ogs, "make_opt_flags", lambda *a, **k: next(calls))
    original = ogs.make_opt_flags
    with bench.FlagRecorder() as rec:
        assert ogs.make_opt_flags is not original
        ogs.make_opt_flags(1, x=2)
        ogs.make_opt_flags()
    assert ogs.make_opt_flags is original
    assert rec.seen == [dict(block_m=128, block_n=256, block_k=128, num_stages=3),
                        dict(block_m=64, block_n=128, block_k=64, num_stages=4)]
    with pytest.raises(RuntimeError), bench.FlagRecorder():
        raise RuntimeError("a failing launch")
    assert ogs.make_opt_flags is original


def test_ulps_apart() -> None:
    ref = torch.tensor([1.0, 2.0, -4.0, 0.5]).to(torch.bfloat16)
    assert bench.ulps_apart(ref.clone(), ref) == dict(bits_equal=True, differing=0.0, max_ulps=0.0)
    out = ref.clone()
    out[1] = torch.tensor(2.0 + 2 * 2.0**-6).to(torch.bfloat16)          # two BF16 ulps of 2.0 (2^-6 each)
    got = bench.ulps_apart(out, ref)
    assert not got["bits_equal"] and got["differing"] == 0.25 and got["max_ulps"] == pytest.approx(2.0)


def test_flag_sets_parse_as_the_prefill_switch() -> None:
    assert bench.FLAG_SETS[0] == ""
    for flags in bench.FLAG_SETS:
        parse_decode_flags(flags, PREFILL_FLAGS_ENV)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is CPU-only")
def test_refuses_without_cuda() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main([])


def test_refuses_a_decode_sized_call_before_anything_runs(capsys) -> None:
    """`--tokens` ≤ 16 would take the decode flags, so the prefill switch it sweeps would not apply."""
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "16", "--flag-sets", "", "split_k=2"])
    assert "--tokens must exceed 16" in capsys.readouterr().err
