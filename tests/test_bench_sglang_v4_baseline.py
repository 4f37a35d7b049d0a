"""CPU checks of benchmarks/sglang_v4_baseline.py: the V4 config it generates parses with SGLang
0.5.17's own config classes at the intended shape, its argument lines parse with SGLang's own
ServerArgs + BenchArgs parsers, the per-layer arithmetic, and the blocked-run JSON. No GPU run."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sglang_v4_baseline as bench  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return bench.write_model_dir(tmp_path_factory.mktemp("v4") / "m", 4)


def test_config_parses_with_sglang_model_config(model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_DSV4_FP4_EXPERTS", "1")
    from sglang.srt.configs.model_config import ModelConfig, is_deepseek_v4
    mc = ModelConfig(str(model_dir), context_length=8448)
    h = mc.hf_config
    assert is_deepseek_v4(h) and h.architectures == ["DeepseekV4ForCausalLM"]
    assert (h.hidden_size, h.num_hidden_layers, h.num_attention_heads, h.q_lora_rank, h.o_lora_rank) == (
        4096, 4, 64, 1024, 1024)
    assert (h.n_routed_experts, h.num_experts_per_tok, h.moe_intermediate_size, h.index_n_heads) == (256, 6, 2048, 64)
    assert list(h.compress_ratios) == [4, 128, 4, 128, 0]
    assert h.num_hash_layers == 0                       # what deepseek_v2.py reads for hash routing
    assert (mc.head_dim, mc.qk_rope_head_dim, mc.index_head_dim, mc.window_size) == (512, 64, 128, 128)
    assert mc.quantization == "fp8" and h.quantization_config["weight_block_size"] == [128, 128]
    assert mc.is_fp4_experts is True                    # dummy weights take the MXFP4 expert path
    assert mc.context_len == 8448


def test_config_agrees_with_sglang_v4_dataclass():
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config
    cfg = bench.v4_config_dict(2)
    names = {f.name for f in dataclasses.fields(DeepSeekV4Config)}
    parsed = DeepSeekV4Config(**{k: v for k, v in cfg.items() if k in names})
    for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts",
                "moe_intermediate_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                "compress_ratios", "scoring_func", "vocab_size"):
        assert getattr(parsed, key) == cfg[key], key
    # V4-Flash's own widths are the dataclass defaults (so this is the released V4-Flash shape)
    default = DeepSeekV4Config(architectures=["DeepseekV4ForCausalLM"], **{
        k: cfg[k] for k in ("quantization_config", "compress_ratios", "rope_scaling")})
    for key in ("hidden_size", "n_routed_experts", "moe_intermediate_size", "q_lora_rank", "index_n_heads"):
        assert getattr(default, key) == cfg[key], key


def test_layer_counts_and_pattern():
    assert bench.v4_config_dict(2)["compress_ratios"] == [4, 128, 0]
    assert bench.v4_config_dict(6)["num_hidden_layers"] == 6
    for bad in (1, 3, 0):
        with pytest.raises(ValueError):
            bench.v4_config_dict(bad)


def test_argument_line_parses_with_sglang_parsers(model_dir):
    from sglang.benchmark.one_batch import BenchArgs
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    BenchArgs.add_cli_args(parser)
    argv = bench.sglang_argv(model_dir, [1, 8, 64, 256], 8192, 24, 0.5, "marlin")
    a = parser.parse_args(argv)
    assert a.load_format == "dummy" and a.model_path == str(model_dir) and a.moe_runner_backend == "marlin"
    assert list(a.batch_size) == [1, 8, 64, 256] and list(a.input_len) == [8192] and list(a.output_len) == [25]
    assert a.context_length % bench.PAGE == 0 and a.context_length >= 8192 + 25
    assert a.max_total_tokens == 256 * a.context_length and a.max_running_requests == 256
    bargs = BenchArgs.from_cli_args(a)
    assert bargs.batch_size == (1, 8, 64, 256)
    cmd = bench.bench_one_batch_command(argv)
    assert cmd.startswith("python -m sglang.bench_one_batch --model-path") and len(cmd) < 2000


def test_env_switches_exist_in_sglang():
    from sglang.srt.environ import envs
    fast, slow = bench.sglang_env(True), bench.sglang_env(False)
    assert fast["SGLANG_DSV4_FP4_EXPERTS"] == "1" and "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH" not in fast
    assert slow["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] == "1" and slow["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    assert fast["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"      # the all-M pre-compile outlasts a device call
    for name in (*slow, *fast):
        if name.startswith("SGLANG_"):
            assert hasattr(envs, name), name


def test_per_layer_arithmetic():
    lo = {1: {"context": 8192, "step_median_us": 1000.0}, 8: {"context": 8192, "step_median_us": 1200.0},
          64: {"context": 8192, "step_median_us": 2000.0}}
    hi = {1: {"context": 8192, "step_median_us": 1600.0}, 8: {"context": 4096, "step_median_us": 1800.0}}
    rows = {r["batch"]: r for r in bench.per_layer({2: lo, 4: hi}, [2, 4], [1, 8, 64, 256])}
    assert rows[1]["per_layer_us"] == pytest.approx(300.0) and rows[1]["fixed_us"] == pytest.approx(400.0)
    assert "contexts differ" in rows[8]["error"]
    assert "missing run for 4 layers" in rows[64]["error"]
    assert "missing run for 2 layers" in rows[256]["error"]


def test_caveats_name_the_shape_differences():
    text = " ".join(bench.nearest_shape_caveats())
    for needle in ("hidden 4096 vs V4.1 5120", "routed experts 256 vs 384", "1.41x", "c128", "hash routing"):
        assert needle in text, needle


def test_blocked_preflight_writes_json_and_fails(tmp_path, monkeypatch):
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda m: None if m == "tilelang" else real(m))
    pre = bench.preflight()
    assert pre["modules"]["tilelang"] is False
    assert any("TileLang" in b and "tilelang==0.1.11" in b for b in pre["blockers"])
    rc = bench.main(["--out", str(tmp_path)])
    assert rc == 2
    result = json.loads((tmp_path / "sglang_v4_baseline.json").read_text())
    assert result["errors"] and any("TileLang" in e for e in result["errors"])
    assert result["configs"]["2"]["hidden_size"] == 4096 and result["workers"] == []



def test_parallel_gpus_blocks_on_one_visible_gpu(tmp_path, monkeypatch):
    """--parallel-gpus with fewer GPUs than layer counts stops at the preflight, naming the count."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    pre = bench.preflight(need_gpus=2)
    assert any("--parallel-gpus needs 2 GPUs, 1 visible" in b for b in pre["blockers"])
    assert not any("parallel" in b for b in bench.preflight(need_gpus=1)["blockers"])


def test_worker_env_pins_the_gpu_and_its_own_jit_cache(tmp_path):
    env = bench.worker_env({"A": "1"}, 1, tmp_path / "jit")
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["A"] == "1"
    own = (tmp_path / "jit" / "gpu1").resolve()
    assert env["BENCH_JIT_CACHE_DIR"] == str(own)
    assert env["TRITON_CACHE_DIR"].startswith(str(own))
    assert "BENCH_JIT_CACHE_DIR" not in bench.worker_env({}, 0, None)


def test_parallel_workers_start_together_with_the_whole_budget(tmp_path, monkeypatch):
    """Both workers run at once (each waits for the other to have started), worker k gets GPU k and the
    remaining budget, and their records land in the JSON in layer order."""
    import threading
    started = threading.Barrier(2, timeout=10)
    seen = {}

    def fake(layers, model_dir, argv, env, timeout, chunk, log):
        started.wait()
        seen[layers] = (env["CUDA_VISIBLE_DEVICES"], timeout)
        return {"runs": [{"batch": 1, "context": 8192, "step_median_us": 100.0 * layers}], "errors": [],
                "returncode": 0, "layers": layers}
    monkeypatch.setattr(bench, "_run_worker", fake)
    monkeypatch.setattr(bench, "preflight", lambda need_gpus=1: {"modules": {"deep_gemm": False,
                                                                             "matplotlib": False},
                                                                 "blockers": [], "gpus": need_gpus})
    rc = bench.main(["--out", str(tmp_path), "--parallel-gpus", "--batches", "1", "--time-budget", "100"])
    assert rc == 0
    assert seen[2][0] == "0" and seen[4][0] == "1" and seen[2][1] > 90 and seen[4][1] > 90
    result = json.loads((tmp_path / "sglang_v4_baseline.json").read_text())
    assert [w["layers"] for w in result["workers"]] == [2, 4]
    assert result["per_layer"][0]["per_layer_us"] == 100.0 and "parallel_gpus" in result

# ---- JIT caches, warm-up, pack/restore (benchmarks/sglang_jit_cache.py) -------------------------------
import importlib.util  # noqa: E402
import os  # noqa: E402

import sglang_jit_cache as jc  # noqa: E402


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def test_jit_cache_env_points_every_cache_into_the_dir(tmp_path):
    env = jc.jit_cache_env(tmp_path / "c")
    root = (tmp_path / "c").resolve()
    for var in ("TVM_FFI_CACHE_DIR", "TILELANG_CACHE_DIR", "TILELANG_TMP_DIR", "SGLANG_DG_CACHE_DIR",
                "DG_JIT_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
                "CUDA_CACHE_PATH", "XDG_CACHE_HOME"):
        assert root in Path(env[var]).parents, var
    assert env["SGLANG_DG_CACHE_DIR"] == env["DG_JIT_CACHE_DIR"] == str(root / "deep_gemm")
    assert len({env[v] for v in ("TVM_FFI_CACHE_DIR", "TILELANG_CACHE_DIR", "TRITON_CACHE_DIR")}) == 3
    assert not jc._packable(Path(env["TILELANG_TMP_DIR"]).relative_to(root) / "x.so")
    # the variables are the ones the installed sources read (SGLang overwrites DG_JIT_CACHE_DIR from its own)
    assert 'os.getenv(\n    "SGLANG_DG_CACHE_DIR"' in _source("sglang.srt.layers.deep_gemm_wrapper.compile_utils")
    assert '"TVM_FFI_CACHE_DIR"' in _source("sglang.kernels.jit.utils.compile")
    assert '"TRITON_CACHE_DIR"' in _source("triton.knobs")
    assert "FLASHINFER_WORKSPACE_BASE" in _source("flashinfer.jit.env")


def test_warmup_argument_line_parses_and_keeps_the_server_arguments(model_dir):
    from sglang.benchmark.one_batch import BenchArgs
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    BenchArgs.add_cli_args(parser)
    timed = bench.sglang_argv(model_dir, [1, 8, 64, 256], 8192, 24, 0.5, "marlin")
    warm = bench.sglang_argv(model_dir, [1, 8, 64, 256], 8192, 24, 0.5, "marlin", run_steps=2)
    a, w = vars(parser.parse_args(timed)), vars(parser.parse_args(warm))
    assert w["output_len"] == [3] and a["output_len"] == [25]
    assert {k: v for k, v in a.items() if k != "output_len"} == {k: v for k, v in w.items() if k != "output_len"}
    assert list(w["cuda_graph_bs_decode"]) == [1, 8, 64, 256] and w["context_length"] == a["context_length"]


def _fill_cache(root: Path) -> dict[str, bytes]:
    rng = __import__("random").Random(0)
    files = {"tvm_ffi/m__arch_sm90a/m.so": rng.randbytes(900_000), "triton/ab/k.cubin": rng.randbytes(700_000),
             "deep_gemm/cache/kernel.x.1/kernel.cubin": b"c" * 1000, "tilelang/0.1.11-x86_64/kernels/k/a.so": b"t"}
    skipped = ("tvm_ffi/m__arch_sm90a/cuda.o", "tilelang/0.1.11-x86_64/.staging/k/a.so", "deep_gemm/tmp/x.cu",
               "scratch/tilelang_tmp/1.so")
    for rel, data in {**files, **{s: b"skip" for s in skipped}}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_pack_writes_parts_and_manifest(tmp_path):
    files = _fill_cache(tmp_path / "c")
    m = jc.pack(tmp_path / "c", tmp_path / "out", {"warmup": {"complete": False}}, part_mib=1)
    on_disk = json.loads((tmp_path / "out" / jc.MANIFEST).read_text())
    assert on_disk == json.loads(json.dumps(m)) and on_disk["warmup"] == {"complete": False}
    assert m["files"] == len(files) and m["bytes"] == sum(map(len, files.values()))
    assert m["by_cache"]["tvm_ffi"] == {"files": 1, "bytes": 900_000} and m["by_cache"]["tilelang"]["files"] == 1
    assert len(m["parts"]) == 2 and all(p["bytes"] <= 1 << 20 for p in m["parts"])   # random bytes: ~1.6 MiB
    assert sum(p["bytes"] for p in m["parts"]) == m["packed_bytes"]
    with pytest.raises(RuntimeError, match="more than 1"):
        jc.pack(tmp_path / "c", tmp_path / "out2", part_mib=1, max_parts=1)


def test_restore_round_trip_across_calls(tmp_path):
    files = _fill_cache(tmp_path / "c")
    jc.pack(tmp_path / "c", tmp_path / "out", part_mib=1)
    first, second = tmp_path / "call1", tmp_path / "call2"       # two calls, each carrying one part
    for d, part in ((first, "part00"), (second, "part01")):
        d.mkdir()
        (d / jc.MANIFEST).write_bytes((tmp_path / "out" / jc.MANIFEST).read_bytes())
        (d / f"{jc.PREFIX}.tgz.{part}").write_bytes((tmp_path / "out" / f"{jc.PREFIX}.tgz.{part}").read_bytes())
    dest, staging = tmp_path / "restored", tmp_path / "staging"
    r1 = jc.restore(dest, [first, tmp_path / "absent"], staging)
    assert r1["restored"] is False and r1["missing"] == [f"{jc.PREFIX}.tgz.part01"] and not dest.exists()
    (dest / "triton/ab").mkdir(parents=True)
    (dest / "triton/ab/k.cubin").write_bytes(b"newer")           # a file already on the machine is kept
    r2 = jc.restore(dest, [second], staging)
    assert r2["restored"] is True and r2["files_new"] == len(files) - 1
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == (b"newer" if rel == "triton/ab/k.cubin" else data), rel
    assert not (dest / "tvm_ffi/m__arch_sm90a/cuda.o").exists() and not (dest / "scratch").exists()
    assert jc.restore(dest, [], staging)["reason"] == "already restored on this machine"
    (staging / f"{jc.PREFIX}.tgz.part00").write_bytes(b"corrupt")
    os.remove(next(dest.glob(".restored-*")))
    assert jc.restore(dest, [], staging)["missing"] == [f"{jc.PREFIX}.tgz.part00"]


def test_warmup_mode_packs_a_manifest_even_when_blocked(tmp_path, monkeypatch):
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda m: None if m == "tilelang" else real(m))
    with pytest.raises(SystemExit):
        bench.main(["--warmup", "--out", str(tmp_path / "o")])               # needs --jit-cache
    (tmp_path / "c" / "triton").mkdir(parents=True)
    (tmp_path / "c" / "triton" / "k.json").write_text("{}")
    rc = bench.main(["--warmup", "--jit-cache", str(tmp_path / "c"), "--out", str(tmp_path / "o")])
    assert rc == 1
    m = json.loads((tmp_path / "o" / jc.MANIFEST).read_text())
    assert m["warmup"]["complete"] is False and m["warmup"]["stages"][0]["stage"] == "preflight"
    assert m["files"] == 1 and m["warmup"]["env"]["TRITON_CACHE_DIR"] == str((tmp_path / "c" / "triton").resolve())
    assert m["warmup"]["layer_counts"] == [2] and (tmp_path / "o" / f"{jc.PREFIX}.tgz.part00").is_file()


def test_routed_expert_count_runs_one_eager_step_and_restores_the_graph_runner():
    """`routed_experts_of_one_step`: hooks every TopK-class module, counts distinct expert ids per
    layer (padding ids < 0 left out), runs the step with the decode graph runner set aside, and
    puts the runner back and removes the hooks — also when the step raises."""
    import types

    import torch
    from torch import nn

    import sglang_v4_worker as w

    class FakeTopK(nn.Module):
        def __init__(self, ids):
            super().__init__()
            self.ids = ids

        def forward(self, x):
            return types.SimpleNamespace(topk_ids=self.ids)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = FakeTopK(torch.tensor([[1, 2], [2, 3]]))
            self.b = FakeTopK(torch.tensor([[5, 5], [-1, -1]]))

        def forward(self, x):
            return self.a(x), self.b(x)

    graph = object()
    runner = types.SimpleNamespace(model=Model(), decode_cuda_graph_runner=graph)
    calls = []

    def step():
        calls.append(runner.decode_cuda_graph_runner)
        runner.model(torch.zeros(1))
    out = w.routed_experts_of_one_step(runner, step, FakeTopK)
    assert out == {"per_layer": [3, 1], "topk_modules": 2}
    assert calls == [None] and runner.decode_cuda_graph_runner is graph

    def failing():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        w.routed_experts_of_one_step(runner, failing, FakeTopK)
    assert runner.decode_cuda_graph_runner is graph
    assert not runner.model.a._forward_hooks and not runner.model.b._forward_hooks
