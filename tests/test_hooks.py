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
    assert tuple(inspect.signature(target).parameters) == spec.params, (
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

    def manager(model_type):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)))

    ours = lambda: [m for m in http_server.app.user_middleware if m.cls is ChatReasoningMiddleware]
    saved = list(http_server.app.user_middleware)
    try:
        assert setup_http_server_hook(original, None, manager("llama"), None, None, [{}], None) == "ran"
        assert not ours()
        assert setup_http_server_hook(original, None, manager("deepseek_v41"), None, None, [{}], None) == "ran"
        assert len(ours()) == 1
    finally:
        http_server.app.user_middleware[:] = saved
