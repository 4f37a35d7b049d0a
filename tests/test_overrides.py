"""The V4.1 server-argument defaults and start-up refusals inside SGLang (`sglang_dsv41/overrides.py`;
issue 13 item 3): `ServerArgs` resolved in-process exactly as `python -m sglang.launch_server`
does after loading the plugin — the declared defaults on CPU and CUDA, every value the user gives
kept, and values the runtime cannot serve refused before any process starts, naming the flag.

`ServerArgs(device="cuda")` resolves on a machine without a GPU too (SGLang only reads the
device's memory size), so the CUDA defaults are checked here as well.
"""
from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

import pytest

from sglang_dsv41 import overrides, plugin
from sglang_dsv41.runtime.requirements import (CUDA_TOKENS_PER_CONTEXT, CURRENT_RUNTIME, DECODE_GRAPH_MAX_BS, PAGE_SIZE,
                                               PREFILL_GRAPH_TOKENS, REASONING_PARSER, STORAGE_PAGE_SIZE,
                                               TOOL_CALL_PARSER, GRAPH_BACKEND_NAME)


@pytest.fixture(scope="module")
def resolve(tiny_checkpoint: Path):
    """`resolve(device, **flags)`: the resolved `ServerArgs` of the tiny checkpoint."""
    plugin.register()
    from sglang.srt.server_args import ServerArgs

    def make(device: str, **flags: Any):
        return ServerArgs(model_path=str(tiny_checkpoint), device=device, **flags)

    return make


def _declared(sa: Any, device: str, tp: int = 1) -> dict[str, Any]:
    return {name: getattr(sa, name) for name in CURRENT_RUNTIME.defaults(device, tp)}


def test_cpu_defaults(resolve) -> None:
    sa = resolve("cpu")
    assert getattr(sa, overrides.GIVEN_ATTR) == {}                  # nothing given: every default applies
    assert _declared(sa, "cpu") == CURRENT_RUNTIME.defaults("cpu")
    assert sa.page_size == 2 and sa.attention_backend == "torch_native" and sa.swa_full_tokens_ratio == 0.1
    assert sa.max_total_tokens == 16384 and sa.sleep_on_idle is True
    assert sa.reasoning_parser == REASONING_PARSER and sa.tool_call_parser == TOOL_CALL_PARSER


def test_cuda_defaults_reach_the_graph_configuration(resolve) -> None:
    sa = resolve("cuda")
    assert _declared(sa, "cuda") == CURRENT_RUNTIME.defaults("cuda")
    assert sa.attention_backend == GRAPH_BACKEND_NAME and sa.sampling_backend == "pytorch" and sa.page_size == 2
    assert sa.cuda_graph_config.decode.max_bs == DECODE_GRAPH_MAX_BS == 256
    assert max(sa.cuda_graph_config.decode.bs) == 256
    assert sa.disable_cuda_graph is False and sa.sleep_on_idle is False
    # the pool cap: CUDA_TOKENS_PER_CONTEXT context lengths (SGLang's eager buffers scale with the pool)
    assert sa.max_total_tokens == CUDA_TOKENS_PER_CONTEXT * sa.get_model_config().context_len
    assert resolve("cuda", max_total_tokens=4096).max_total_tokens == 4096


def test_cuda_tensor_parallel_decodes_eagerly(resolve) -> None:
    sa = resolve("cuda", tp_size=2)
    assert sa.disable_cuda_graph is True and sa.cuda_graph_config.decode.backend == "disabled"
    assert sa.cuda_graph_config.prefill.backend == "disabled" and sa.cuda_graph_backend_prefill is None


def test_cuda_prefill_graphs_are_the_full_backend_over_small_buckets(resolve) -> None:
    """docs/prefill_graphs.md: SGLang's `full` prefill runner over buckets up to 256 tokens, without
    the MLA prefix-chunk variants its runner would otherwise assert our backend supports."""
    prefill = resolve("cuda").cuda_graph_config.prefill
    assert prefill.backend == "full" and prefill.bs == list(PREFILL_GRAPH_TOKENS)
    assert resolve("cuda").disable_chunked_prefix_cache is True
    assert resolve("cpu").cuda_graph_backend_prefill is None and resolve("cpu").disable_chunked_prefix_cache is False
    chosen = resolve("cuda", cuda_graph_backend_prefill="full", cuda_graph_bs_prefill=[8, 16])   # the user's buckets
    assert chosen.cuda_graph_config.prefill.bs == [8, 16] and chosen.disable_chunked_prefix_cache is True


EAGER_PREFILL = [({"disable_prefill_cuda_graph": True}, ["--disable-prefill-cuda-graph"]),
                 ({"cuda_graph_backend_prefill": "disabled"}, ["--cuda-graph-backend-prefill", "disabled"]),
                 ({"speculative_algorithm": "DSPARK"}, ["--speculative-algorithm", "DSPARK"]),
                 ({"disaggregation_mode": "prefill"}, ["--disaggregation-mode", "prefill"])]


@pytest.mark.parametrize("flags,cli", EAGER_PREFILL, ids=["off", "disabled", "dspark", "pd-prefill"])
def test_prefill_stays_eager_when_turned_off_or_with_dspark_or_pd(resolve, flags, cli) -> None:
    """In the server and in the CLI defaults the launch wrappers and the planner read."""
    declared = " ".join(CURRENT_RUNTIME.server_args("cuda", cli))
    assert "prefill" not in declared and "--disable-chunked-prefix-cache" not in declared
    assert "--cuda-graph-backend-prefill full" in " ".join(CURRENT_RUNTIME.server_args("cuda"))
    sa = resolve("cuda", **flags)
    assert sa.cuda_graph_config.prefill.backend == "disabled"
    assert sa.cuda_graph_bs_prefill is None and sa.disable_chunked_prefix_cache is False
    if "disaggregation_mode" not in flags:
        assert sa.cuda_graph_config.decode.backend == "full"             # decode graphs are untouched


STORAGE = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_hicache_storage_backend_defaults_the_page_size_to_the_storage_page(resolve, device: str) -> None:
    """L3 pays per stored page (docs/hicache.md "L3 write throughput"): with a HiCache storage backend
    the page size defaults to `STORAGE_PAGE_SIZE`; without one (or with the host tier alone) it stays
    `PAGE_SIZE`; a page size the user gives wins either way."""
    from sglang_dsv41.runtime.kv_rows import required_page_multiple

    sa = resolve(device, **STORAGE)
    assert sa.page_size == STORAGE_PAGE_SIZE != PAGE_SIZE and sa.hicache_storage_backend == "file"
    assert _declared(sa, device) == CURRENT_RUNTIME.defaults(device, hicache_storage=True)
    assert STORAGE_PAGE_SIZE % required_page_multiple(sa.get_model_config().hf_config.parsed().text) == 0
    assert resolve(device).page_size == PAGE_SIZE
    assert resolve(device, enable_hierarchical_cache=True).page_size == PAGE_SIZE            # L2 only
    assert resolve(device, hicache_storage_backend="file").page_size == PAGE_SIZE            # no HiCache at all
    given = resolve(device, page_size=PAGE_SIZE, **STORAGE)
    assert given.page_size == PAGE_SIZE and getattr(given, overrides.GIVEN_ATTR) == {"page_size": PAGE_SIZE}
    # the launch wrappers and the planner read the same declaration from the CLI arguments
    cli = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    assert f"--page-size {STORAGE_PAGE_SIZE}" in " ".join(CURRENT_RUNTIME.server_args(device, cli))
    assert f"--page-size {PAGE_SIZE}" in " ".join(CURRENT_RUNTIME.server_args(device, cli[1:]))
    assert "--page-size" not in CURRENT_RUNTIME.server_args(device, [*cli, "--page-size", "8"])


# A legal value other than the declared default, per declared field (switches cannot be given "off").
USER_VALUES = {
    "cpu": {"page_size": 4, "attention_backend": GRAPH_BACKEND_NAME, "swa_full_tokens_ratio": 0.5,
            "max_total_tokens": 2048, "reasoning_parser": "deepseek_v41", "tool_call_parser": "deepseek_v41"},
    "cuda": {"page_size": 4, "attention_backend": "torch_native", "swa_full_tokens_ratio": 0.5,
             "cuda_graph_max_bs_decode": 8, "sampling_backend": "flashinfer", "reasoning_parser": "deepseek_v41",
             "tool_call_parser": "deepseek_v41", "max_total_tokens": 4096, "mem_fraction_static": 0.5,
             "cuda_graph_backend_prefill": "full", "cuda_graph_bs_prefill": [8, 16]},
}
SWITCHES = {name for name, value in {**CURRENT_RUNTIME.defaults("cpu"), **CURRENT_RUNTIME.defaults("cuda"),
                                     **CURRENT_RUNTIME.defaults("cuda", 2)}.items() if value is True}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_user_value_wins(resolve, device: str) -> None:
    want = USER_VALUES[device]
    declared = CURRENT_RUNTIME.defaults(device)
    assert set(declared) - SWITCHES <= set(want)          # every non-switch default is exercised
    for name, value in want.items():
        sa = resolve(device, **{name: value})
        assert getattr(sa, overrides.GIVEN_ATTR) == {name: value}
        assert getattr(sa, name) == value, name
        others = {n: v for n, v in declared.items() if n != name and not (device == "cpu" and n == "sampling_backend")}
        assert {n: getattr(sa, n) for n in others} == others, name     # the rest still defaulted
    sa = resolve("cuda", cuda_graph_max_bs_decode=8)
    assert sa.cuda_graph_config.decode.max_bs == 8


REFUSED = [  # (flags, the flag the message must name)
    ({"page_size": 3}, "--page-size 3"),
    ({"page_size": 1}, "--page-size 1"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype fp8_e4m3"),
    ({"tp_size": 3}, "--tp-size 3"),
    ({"tp_size": 16}, "--tp-size 16"),
    ({"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}, "--enable-dp-attention"),
    ({"attention_backend": "triton"}, "--attention-backend triton"),
    ({"decode_attention_backend": "flashinfer"}, "--decode-attention-backend flashinfer"),
    ({"disable_hybrid_swa_memory": True}, "--disable-hybrid-swa-memory"),
    ({"speculative_algorithm": "DSPARK"}, "--speculative-algorithm DSPARK on cpu"),   # SGLang's worker: CUDA only
    ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),            # V4.1: DSpark only
    ({"cuda_graph_backend_prefill": "breakable"}, "--cuda-graph-backend-prefill breakable"),
    ({"cuda_graph_backend_prefill": "tc_piecewise"}, "--cuda-graph-backend-prefill tc_piecewise"),
    ({"cuda_graph_backend_prefill": "full", "tp_size": 2}, "--cuda-graph-backend-prefill full at --tp-size 2"),
    ({"cuda_graph_backend_prefill": "full", "speculative_algorithm": "DSPARK"},
     "--cuda-graph-backend-prefill full with --speculative-algorithm"),
    ({"enable_multimodal": False, "mm_enable_dp_encoder": True},                      # --language-model-only
     "--language-model-only and --mm-enable-dp-encoder are mutually exclusive"),
]


@pytest.mark.parametrize("flags,named", REFUSED, ids=[n for _, n in REFUSED])
def test_values_the_runtime_cannot_serve_are_refused_at_start_up(resolve, flags: dict[str, Any], named: str) -> None:
    with pytest.raises(overrides.ServerArgsRefused) as e:
        resolve("cpu", **flags)
    message = str(e.value)
    assert f"\n  {named}: " in message and message.startswith("sglang-dsv41: DeepSeek-V4.1 cannot be served")


def test_refusal_names_the_rule_and_every_bad_flag(resolve) -> None:
    with pytest.raises(overrides.ServerArgsRefused) as e:
        resolve("cpu", page_size=5, kv_cache_dtype="fp8_e4m3", tp_size=3)
    message = str(e.value)
    assert "use --page-size 2" in message and "use one of auto, bf16" in message
    assert "runtime supports TP1/TP2/TP4/TP8 only" in message and "must divide o_groups" in message
    assert message.count("\n  --") == 3


def test_tp_size_the_checkpoint_cannot_shard_is_refused_naming_the_model_rule(resolve) -> None:
    """TP 4 is in the profile, but the tiny checkpoint has o_groups 2: the model's sharding rule."""
    with pytest.raises(overrides.ServerArgsRefused, match=r"--tp-size 4: tensor parallel size 4 must divide "
                                                          r"o_groups \(2\)"):
        resolve("cpu", tp_size=4)
    assert resolve("cpu", tp_size=2).tp_size == 2


def test_provider_without_the_hook_record_raises() -> None:
    class Pristine:
        device, tp_size = "cpu", 1

    with pytest.raises(RuntimeError, match="did not run"):
        overrides.deepseek_v41_overrides(Pristine(), None)


def test_provider_is_in_sglangs_registry_once(resolve) -> None:
    from sglang.srt.arg_groups.overrides import _MODEL_OVERRIDE_FNS

    plugin.register()                              # idempotent: registered once
    assert _MODEL_OVERRIDE_FNS["DeepseekV41ForCausalLM"].count(overrides.deepseek_v41_overrides) == 1


def test_the_hook_runs_where_the_record_is_still_the_users(resolve) -> None:
    """`ServerArgs.__post_init__` calls the hooked `_handle_cuda_graph_config` after the device is
    resolved and before SGLang fills backends and memory or collects model overrides."""
    from sglang.srt.server_args import ServerArgs

    source = inspect.getsource(inspect.unwrap(ServerArgs.__post_init__))
    order = [source.index(f"self.{name}(") for name in (
        "_handle_missing_default_values", "_handle_cuda_graph_config", "_handle_cpu_backends",
        "_handle_gpu_memory_settings", "_handle_model_specific_adjustments")]
    assert order == sorted(order)


def test_declared_flags_are_sglang_flags_of_their_fields(resolve) -> None:
    from sglang.srt.server_args import ServerArgs

    ap = argparse.ArgumentParser()
    ServerArgs.add_cli_args(ap)
    for f in CURRENT_RUNTIME.flags:
        action = ap._option_string_actions[f.flag]
        assert action.dest == f.dest, f.flag
        if f.value is not None:
            assert ap.parse_args(["--model-path", "x", *f.args()]).__dict__[f.dest] == f.default_for(), f.flag


def test_parser_defaults_are_the_names_the_api_registers(resolve) -> None:
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from sglang_dsv41.api import reasoning_parser, tool_parser

    assert REASONING_PARSER == reasoning_parser.PARSER_NAMES[0] and TOOL_CALL_PARSER == tool_parser.PARSER_NAMES[0]
    assert REASONING_PARSER in ReasoningParser.DetectorMap and TOOL_CALL_PARSER in FunctionCallParser.ToolCallParserEnum


def test_other_architectures_are_untouched(resolve, tmp_path: Path) -> None:
    """A non-V4.1 checkpoint resolves SGLang's own defaults (no record, no parsers, page size 1)."""
    import json

    from sglang.srt.server_args import ServerArgs

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
    sa = ServerArgs(model_path=str(tmp_path), device="cpu", skip_tokenizer_init=True)
    assert not hasattr(sa, overrides.GIVEN_ATTR)
    assert sa.page_size == 1 and sa.reasoning_parser is None and sa.swa_full_tokens_ratio == 0.8


def test_dspark_on_cuda_resolves_with_the_bundled_draft(resolve, tiny_checkpoint: Path) -> None:
    """SGLang's own DSPARK argument handling finds the draft bundled in the V4.1 checkpoint
    (top-level dspark_* fields, runtime/hf_config.py): draft path = model path, γ + 1 = 6 tokens."""
    sa = resolve("cuda", speculative_algorithm="DSPARK")
    assert sa.speculative_draft_model_path == str(tiny_checkpoint)
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps, sa.speculative_eagle_topk) == (6, 1, 1)
