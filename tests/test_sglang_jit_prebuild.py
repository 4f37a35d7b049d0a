"""CPU checks of benchmarks/sglang_jit_prebuild.py: every target's builder still exists in the installed
SGLang, `--dry-run` lists every target with the cache directory SGLang's `load_jit` would use for sm_90a
(no compiler runs), and the per-module template arguments follow the V4-Flash config. No GPU, no nvcc."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.kernels.jit.utils", reason="sglang (0.5.17) not importable")
pytest.importorskip("tvm_ffi", reason="tvm-ffi not importable")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sglang_jit_prebuild as pb  # noqa: E402
from sglang_v4_baseline import v4_config_dict  # noqa: E402


def _by_name() -> dict[str, pb.Target]:
    return {t.name: t for t in pb.targets()}


def test_every_builder_exists_in_installed_sglang():
    missing = []
    for t in pb.targets():
        fn = getattr(importlib.import_module(t.module), t.func, None)
        if not callable(fn):
            missing.append(f"{t.module}.{t.func}")
    assert not missing, f"SGLang moved these JIT builders: {missing}"


def test_targets_unique_and_marlin_first():
    ts = pb.targets()
    assert len({t.name for t in ts}) == len(ts)
    assert ts[0].name == "moe_wna16_marlin"
    assert [t.est_s for t in ts] == sorted((t.est_s for t in ts), reverse=True)


def test_args_follow_v4_flash_config():
    cfg, t = v4_config_dict(4), _by_name()
    hd, rope, idx = cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]
    assert (hd, rope, idx) == (512, 64, 128)
    assert t["dsv4_main_q_norm_rope"].args == ("torch.bfloat16", hd, rope)
    assert t["dsv4_main_k_norm_rope_flashmla"].args == ("torch.bfloat16", hd, rope, pb.PAGE_SIZE)
    f32 = "torch.float32"
    assert t["dsv4_compress_4_attn_d512"].args == (hd, f32, f32, f32, 4)
    assert t["dsv4_compress_128_attn_d512"].args == (hd, f32, f32, f32, 128)
    assert t["dsv4_compress_4_indexer_d128"].args == (idx, f32, f32, f32, 4)
    # compressed-KV stores: c4 pool page 256/4, c128 pool page 256/128, indexer pool page 256/4
    assert t["dsv4_fused_norm_rope_v2_attn_d512_p64"].args == (f32, hd, rope, pb.PAGE_SIZE // 4, False)
    assert t["dsv4_fused_norm_rope_v2_attn_d512_p2"].args == (f32, hd, rope, pb.PAGE_SIZE // 128, False)
    assert t["dsv4_fused_norm_rope_v2_indexer_d128_p64"].args == (f32, idx, rope, pb.PAGE_SIZE // 4, False)
    assert t[f"dsv4_topk_v1_{cfg['index_topk']}"].args == (512,)
    assert t["dsv3_router_gemm"].args == (cfg["n_routed_experts"], cfg["hidden_size"], True, True)
    assert t["moe_wna16_marlin"].args == ("torch.bfloat16", False, False)
    assert t["per_token_group_quant_colmajor"].args[:5] == ("torch.bfloat16", "torch.float8_e4m3fn", 128, False, False)
    assert t["per_token_group_quant_rowmajor"].args[4] is True


def test_dry_run_lists_targets_with_server_cache_dirs(tmp_path, capsys):
    out = tmp_path / "dry.json"
    rc = pb.main(["--cache-dir", str(tmp_path / "jit"), "--dry-run", "--summary", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    summary = json.loads(out.read_text())
    names = [r["name"] for r in summary["targets"]]
    assert names == [t.name for t in pb.targets()] and not summary["failed"]
    tvm = (tmp_path / "jit" / "tvm_ffi").resolve()
    for r in summary["targets"]:
        assert r["name"] in text and r["status"] == "absent", r
        d = Path(r["build_dir"])
        assert d.parent == tvm and d.name.startswith(r["module"] + "__arch_9.0a__tvmffi_"), r
        assert r["module"].startswith("sgl_kernel_jit_")
    by = {r["name"]: r for r in summary["targets"]}
    # PDL on (sm_90a override) and the widths in the module names SGLang derives from the template args
    assert "_bf16_t_512_64_true_" in by["dsv4_main_q_norm_rope"]["module"]
    assert "_bf16_t_512_64_256_true_" in by["dsv4_main_k_norm_rope_flashmla"]["module"]
    assert "moe_wna16_marlin_bf16_t_false_false_" in by["moe_wna16_marlin"]["module"]


def test_unknown_only_name_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        pb.main(["--cache-dir", str(tmp_path), "--dry-run", "--only", "no_such_module"])


def test_missing_builder_is_an_error_not_a_skip():
    t = pb.Target("gone", "sglang.kernels.ops.attention.dsv4.topk", "_jit_no_such_builder", (), 1, "test")
    r = pb.run_target(t, build=False)
    assert r["status"] == "error" and "not found" in r["error"]
