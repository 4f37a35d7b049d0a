"""The HookRegistry table (`sglang_dsv41.hooks.HOOKS`): every target still exists in SGLang 0.5.17
with the parameters its hook was written for, every implementation resolves, installing applies
and verifies them, and a hook that cannot be applied is an error, not a log line."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from sglang_dsv41 import hooks

KINDS = {"before", "after", "around", "replace"}


@pytest.fixture(scope="module")
def installed():
    from sglang_dsv41.api.register import register_api

    register_api()
    return hooks.specs_for(("api",))


@pytest.mark.parametrize("spec", hooks.HOOKS, ids=lambda s: s.target)
def test_target_exists_with_expected_signature(spec):
    target = inspect.unwrap(hooks.resolve_target(spec.target))
    assert callable(target), spec.target
    params = tuple(inspect.signature(target).parameters)
    owner_path, _, name = spec.target.rpartition(".")
    owner = hooks.resolve_target(owner_path)
    if inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, name), classmethod) \
            and not inspect.ismethod(target):
        params = params[1:]       # a hooked classmethod unwraps to its function: drop `cls` (as when bound)
    assert params == spec.params, (
        f"{spec.target} changed its signature; re-check {spec.impl}")


@pytest.mark.parametrize("spec", hooks.HOOKS, ids=lambda s: s.target)
def test_spec_is_well_formed(spec):
    assert spec.kind in KINDS and spec.area and spec.why
    impl = spec.implementation()
    assert callable(impl)
    first = next(iter(inspect.signature(impl).parameters))
    assert first == {"around": "original", "after": "result"}.get(spec.kind, first)


def test_one_entry_per_target_and_impl():
    keys = [(s.target, s.impl) for s in hooks.HOOKS]
    assert len(keys) == len(set(keys))


def test_install_applies_and_is_idempotent(installed):
    assert installed and all(hooks.is_applied(s) for s in installed)
    before = {s.target: hooks.resolve_target(s.target) for s in installed}
    hooks.install_hooks(("api",))
    assert {s.target: hooks.resolve_target(s.target) for s in installed} == before  # no re-wrap


def test_unapplied_hook_is_an_error(installed, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    bogus = hooks.HookSpec(
        target="sglang.srt.entrypoints.openai.chat_encoding.no_such_function", kind="around",
        impl="sglang_dsv41.api.serving:resolve_chat_encoding_spec_hook", params=(),
        area="test-only", why="must fail")
    monkeypatch.setattr(hooks, "HOOKS", hooks.HOOKS + (bogus,))
    try:
        with pytest.raises(RuntimeError, match="no_such_function"):
            hooks.install_hooks(("test-only",))
    finally:
        HookRegistry._hooks.pop(bogus.target, None)
        hooks._installed.discard((bogus.target, bogus.impl))


def test_resolve_chat_encoding_spec_hook(installed):
    from sglang.srt.entrypoints.openai.chat_encoding import resolve_chat_encoding_spec

    def config(model_type, arch="DeepseekV4ForCausalLM"):
        return SimpleNamespace(model_type=model_type, architectures=[arch])
    assert resolve_chat_encoding_spec(hf_config=config("deepseek_v41"), tokenizer=None) == "dsv41"
    # the plugin's own architecture name (sglang_dsv41/plugin.py) also contains "DeepseekV4"
    assert resolve_chat_encoding_spec(hf_config=config("deepseek_v41", "DeepseekV41ForCausalLM"),
                                      tokenizer=None) == "dsv41"
    assert resolve_chat_encoding_spec(hf_config=config("deepseek_v4"), tokenizer=None) == "dsv4"
    assert resolve_chat_encoding_spec(hf_config=config("deepseek_v41"), tokenizer=None,
                                      tool_call_parser="deepseekv4") == "dsv41"


def test_reasoning_parser_init_hook_follows_the_request(installed):
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    off = SimpleNamespace(chat_template_kwargs={"thinking": False, "enable_thinking": False})
    on = SimpleNamespace(chat_template_kwargs={"thinking": True, "enable_thinking": True})
    # positional arguments, as OpenAIServingChat passes them
    assert ReasoningParser("deepseek-v41", True, True, off).detector.force_reasoning is False
    assert ReasoningParser("deepseek_v41", True, False, on).detector.force_reasoning is True
    # other parsers and requests without a decision are left alone
    assert ReasoningParser("deepseek-v4", True, True, off).detector.force_reasoning is True
    assert ReasoningParser("deepseek-v41", True, True, None).detector.force_reasoning is True


def test_setup_http_server_hook_installs_middleware_for_v41_only(installed):
    from sglang.srt.entrypoints import http_server

    from sglang_dsv41.api.http_middleware import ChatReasoningMiddleware
    from sglang_dsv41.api.serving import setup_http_server_hook

    def original(server_args, tokenizer_manager, template_manager, port_args, scheduler_infos,
                 subprocess_watchdog, execute_warmup_func=None, launch_callback=None):
        return "ran"

    from fastapi.exceptions import RequestValidationError

    from sglang_dsv41.api.http_guard import ErrorScrubMiddleware, GenerateGuardMiddleware

    def manager(model_type):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)),
                               served_model_name="/root/.cache/sglang-dsv41/tiny-seed0")

    def args():
        return SimpleNamespace(model_path="/root/.cache/sglang-dsv41/tiny-seed0",
                               served_model_name="/root/.cache/sglang-dsv41/tiny-seed0")

    app = http_server.app
    ours = lambda: [m.cls for m in app.user_middleware
                    if m.cls in (ChatReasoningMiddleware, GenerateGuardMiddleware, ErrorScrubMiddleware)]
    saved, saved_handlers = list(app.user_middleware), dict(app.exception_handlers)
    try:
        tm = manager("llama")
        assert setup_http_server_hook(original, args(), tm, None, None, [{}], None) == "ran"
        assert not ours() and tm.served_model_name.startswith("/")
        assert not getattr(app.exception_handlers[RequestValidationError], "sglang_dsv41", False)
        tm, sa = manager("deepseek_v41"), args()
        assert setup_http_server_hook(original, sa, tm, None, None, [{}], None) == "ran"
        assert sorted(c.__name__ for c in ours()) == ["ChatReasoningMiddleware", "ErrorScrubMiddleware",
                                                      "GenerateGuardMiddleware"]
        assert app.user_middleware[0].cls is ErrorScrubMiddleware      # outermost: sees every error
        assert app.exception_handlers[RequestValidationError].sglang_dsv41
        assert tm.served_model_name == "tiny-seed0"
        named = SimpleNamespace(model_path="/ckpt", served_model_name="my-model")
        tm = manager("deepseek_v41")
        tm.served_model_name = "my-model"
        setup_http_server_hook(original, named, tm, None, None, [{}], None)
        assert tm.served_model_name == "my-model"      # the operator's name is kept
    finally:
        app.user_middleware[:] = saved
        app.exception_handlers.clear()
        app.exception_handlers.update(saved_handlers)


# ---- runtime area: pool hooks (runtime/sglang_pool.py, runtime/sglang_hooks.py) ------------------------------------------
@pytest.fixture(scope="module")
def runtime_hooks():
    return hooks.install_hooks(("runtime",))


def _cpu_allocator(pages: int, page_size: int):
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(pages * page_size, page_size, torch.bfloat16, "cpu", None, False)


def test_runtime_pool_hooks_are_applied(runtime_hooks):
    targets = {s.target.rsplit(".", 2)[-2] + "." + s.target.rsplit(".", 1)[-1] for s in runtime_hooks}
    assert targets == {"pool_configurator.create_memory_pool_configurator",
                       "KVCacheConfigurator._build_token_to_kv_pool", "ForwardBatch.init_new",
                       "PagedTokenToKVPoolAllocator.alloc_extend", "PagedTokenToKVPoolAllocator.alloc_decode",
                       "ServerArgs._handle_cuda_graph_config", "ServerArgs.add_cli_args", "utils.setup_state_kv_args",
                       "utils.get_dsv4_c128_state_indices", "ScheduleBatchDisaggregationDecodeMixin.prepare_for_prebuilt",
                       "CommonKVBootstrapServer._setup_routes", "CommonKVManager.register_to_bootstrap",
                       "CommonKVManager.try_ensure_parallel_info", "Scheduler.on_idle",
                       "ModelConfig._config_draft_model", "draft_worker_common._resolve_draft_attention_backend_fallback",
                       "DSparkWorkerV2._commit_target_mamba_states_after_verify", "UnifiedRadixCache.load_back"}
    assert all(hooks.is_applied(s) for s in runtime_hooks)


def test_language_model_only_flag_is_registered(runtime_hooks):
    """`--language-model-only` (docs/vision.md) parses into enable_multimodal=False; absent, None."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "x", "--language-model-only"]).enable_multimodal is False
    assert parser.parse_args(["--model-path", "x"]).enable_multimodal is None


def test_vision_refusals():
    from types import SimpleNamespace

    from sglang_dsv41.overrides import vision_refusals

    both = SimpleNamespace(enable_multimodal=False, mm_enable_dp_encoder=True)
    assert "mutually exclusive" in vision_refusals(both, has_vision=True)[0]
    assert vision_refusals(SimpleNamespace(enable_multimodal=None, mm_enable_dp_encoder=True), True) == []
    assert "no vision_config" in vision_refusals(SimpleNamespace(enable_multimodal=True,
                                                                 mm_enable_dp_encoder=False), False)[0]
    # --limit-mm-data-per-request (docs/vision.md): '{"image": N}' with N >= 1, on a server that takes images
    def limit(value, enable=None, has_vision=True):
        args = SimpleNamespace(enable_multimodal=enable, mm_enable_dp_encoder=False, limit_mm_data_per_request=value)
        return vision_refusals(args, has_vision)

    assert limit({"image": 4}) == limit('{"image": 1}') == limit(None) == []
    assert "takes images only, not video" in limit({"image": 2, "video": 1})[0]
    assert "integer ≥ 1, got 0" in limit({"image": 0})[0] and "integer ≥ 1, got '2'" in limit({"image": "2"})[0]
    assert "is not JSON" in limit("{image: 2}")[0] and "must be a JSON object" in limit("[2]")[0]
    assert "on a text-only server" in limit({"image": 2}, enable=False)[0]
    assert "on a text-only server" in limit({"image": 2}, has_vision=False)[0]


@pytest.mark.parametrize("page_size", [2, 4])
def test_cpu_paged_alloc_extend_equals_sglangs_naive_rule(runtime_hooks, page_size):
    """The CPU allocation (SGLang's Triton kernel cannot run without a GPU) gives the slots of
    SGLang's own torch reference `alloc_extend_naive`, and consumes the same pages."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    alloc = _cpu_allocator(64, page_size)
    alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages), generator=torch.Generator().manual_seed(0))]
    free_before = alloc.free_pages.clone()
    # request 0: fresh; 1: prefix ends mid-page (odd); 2: prefix ends on a page boundary; 3: extend within its page
    prefix = torch.tensor([0, 3, 2 * page_size, 5])
    seq = torch.tensor([7, 3 + 2 * page_size + 1, 3 * page_size + 1, 6])
    last = torch.tensor([-1, 10 * page_size + 2, 11 * page_size + page_size - 1, 12 * page_size])
    n = int((seq - prefix).sum())
    got = alloc.alloc_extend(prefix, prefix, seq, seq, last, n)
    want = torch.empty(n, dtype=torch.int64)
    alloc_extend_naive(prefix, seq, last, free_before, want, page_size, "cpu")
    assert torch.equal(got, want)
    used = int(((seq + page_size - 1) // page_size - (prefix + page_size - 1) // page_size).sum())
    assert torch.equal(alloc.free_pages, free_before[used:])


def test_cpu_paged_alloc_decode_continues_the_page_or_opens_one(runtime_hooks):
    import torch

    page_size = 4
    alloc = _cpu_allocator(16, page_size)
    free_before = alloc.free_pages.clone()
    seq = torch.tensor([6, 5, 9, 8])            # new token at position seq-1: 5, 4 (page start), 8 (start), 7
    last = torch.tensor([41, 43, 23, 30])
    got = alloc.alloc_decode(seq, seq, last)
    assert got.tolist() == [42, int(free_before[0]) * page_size, int(free_before[1]) * page_size, 31]
    assert torch.equal(alloc.free_pages, free_before[2:])
    alloc.free_pages = alloc.free_pages[:0]
    assert alloc.alloc_decode(torch.tensor([5]), torch.tensor([5]), torch.tensor([3])) is None
