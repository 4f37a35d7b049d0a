"""The scheduler's switch interval with a HiCache storage tier (runtime/hicache_gil.py; docs/hicache.md
"L3 and the GIL"): set by the stack build only when a storage backend is configured, to
`SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS` (opt-in on every device), left alone when unset or
`off`, a bad value refused naming the variable, logged each way. The server side (the line in a storage server's log, from
its scheduler process) is asserted in tests/test_runtime_hicache_storage_server.py."""
from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from sglang_dsv41.runtime import hicache_gil, hicache_stack


@pytest.fixture(autouse=True)
def _restore_interval():
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


def test_opt_in_on_every_device_and_set_only_with_storage(caplog) -> None:
    sys.setswitchinterval(0.005)
    caplog.set_level(logging.INFO, logger=hicache_gil.__name__)
    assert hicache_gil.apply(None, "cuda", {hicache_gil.ENV: "0.2"}) is None
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert hicache_gil.apply("file", "cpu", {}) is None and sys.getswitchinterval() == pytest.approx(0.005)
    assert "left at 5.000 ms (SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=unset, device cpu)" in caplog.text
    assert hicache_gil.apply("file", "cuda", {}) is None and sys.getswitchinterval() == pytest.approx(0.005)
    assert "(SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=unset, device cuda)" in caplog.text
    assert hicache_gil.TRIAL_MS < 5.0
    got = hicache_gil.apply("file", "cuda", {hicache_gil.ENV: str(hicache_gil.TRIAL_MS)})
    assert got == pytest.approx(hicache_gil.TRIAL_MS / 1e3) and sys.getswitchinterval() == pytest.approx(got)
    assert "switch interval 5.000 -> 0.200 ms" in caplog.text


def test_env_sets_or_turns_it_off(caplog) -> None:
    sys.setswitchinterval(0.005)
    caplog.set_level(logging.INFO, logger=hicache_gil.__name__)
    assert hicache_gil.apply("file", "cpu", {hicache_gil.ENV: "0.5"}) == pytest.approx(0.0005)   # the variable wins on CPU
    sys.setswitchinterval(0.005)
    assert hicache_gil.apply("mooncake", "cuda", {hicache_gil.ENV: "OFF"}) is None
    assert sys.getswitchinterval() == pytest.approx(0.005) and "left at 5.000 ms" in caplog.text


@pytest.mark.parametrize("bad", ["0", "-1", "fast", "nan", "1e9"])
def test_a_bad_value_is_refused_naming_the_variable(bad) -> None:
    with pytest.raises(RuntimeError, match=hicache_gil.ENV):
        hicache_gil.apply("file", "cuda", {hicache_gil.ENV: bad})


def test_the_stack_build_applies_it_with_its_storage_backend(monkeypatch) -> None:
    seen = []

    class Reached(Exception):
        pass

    def fake(backend, device):
        seen.append((backend, device))
        raise Reached

    monkeypatch.setattr(hicache_gil, "apply", fake)
    args = SimpleNamespace(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_io_backend="kernel",
                           hicache_write_policy="write_through", device="cuda")
    with pytest.raises(Reached):
        hicache_stack.DeepseekV41StackStrategy().build(cache=None, kvcache=None, params=None, server_args=args,
                                                       load_cache_event=None, storage_backend="file")
    assert seen == [("file", "cuda")]
