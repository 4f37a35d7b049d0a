"""The interpreter wraps' targets exist and the wraps work (tests/triton_interp_compat.py)."""
from __future__ import annotations

import importlib
import importlib.util
import inspect

import numpy as np
import pytest
import torch
import triton_interp_compat as compat

NESTED_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def twice(x):
    return x + x


@triton.jit
def add_twice_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, twice(twice(x)) + twice(x))


@triton.jit
def failing_kernel(x_ptr, BLOCK: tl.constexpr):
    x = twice(tl.load(x_ptr + tl.arange(0, BLOCK)))
    tl.static_assert(BLOCK < 0, "fails inside the grid")
'''


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _pristine(fn):
    return getattr(fn, "_dsv41_original", fn)


def test_target_exists_and_sets_index() -> None:
    """Fails when Triton moves or renames the tensor patcher the shim wraps, or stops setting
    `__index__` through `scope.set_attr` there (what the wrapper overrides)."""
    module, name = compat.TENSOR_PATCHER.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    if not getattr(fn, "_dsv41_index_item", False):
        src = inspect.getsource(fn)
        assert 'set_attr(tensor, "__index__"' in src, src[:400]
    assert list(inspect.signature(fn).parameters) == ["tensor", "scope"]


def test_wrapped_index_reads_a_one_element_array() -> None:
    from triton.runtime import interpreter

    saved = interpreter._patch_lang_tensor
    try:
        compat.install_index_fix()
        compat.install_index_fix()                     # idempotent

        class Scope:
            def set_attr(self, obj, attr, value):
                setattr(obj, attr, value)

        class Handle:
            data = np.array([7], dtype=np.int32)

        class T:
            handle = Handle()

        interpreter._patch_lang_tensor(T, Scope())
        assert range(0, T(), 2) == range(0, 7, 2)
    finally:
        interpreter._patch_lang_tensor = saved


def test_nested_call_targets_patch_as_the_wrap_assumes() -> None:
    """Fails when Triton moves the language patcher or the launch, or when a launch stops patching
    once around its grid and restoring after it, or a device call stops re-patching on entry."""
    from triton.runtime import interpreter

    patcher, grid_call = _resolve(compat.LANG_PATCHER), _resolve(compat.GRID_CALL)
    assert list(inspect.signature(_pristine(patcher)).parameters) == ["fn"]
    launch = inspect.getsource(_pristine(grid_call))
    assert "patch_scope = _patch_lang(self.fn)" in launch and "patch_scope.restore()" in launch
    assert launch.index("_patch_lang(self.fn)") < launch.index("for x in range(grid[0])") < launch.index(
        "patch_scope.restore()")
    assert "_patch_lang(self.fn)" in inspect.getsource(interpreter.InterpretedFunction.__call__)
    assert "_patch_builtin" in inspect.getsource(_pristine(patcher))


@pytest.fixture
def nested_kernel(tmp_path, monkeypatch):
    """`add_twice_kernel` (helpers called 3× per program) decorated as an interpreter function, with
    the language patcher counting its real runs; the wraps are taken off again afterwards."""
    from triton.runtime import interpreter

    (tmp_path / "interp_nested_kernel.py").write_text(NESTED_KERNEL)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("interp_nested_kernel", tmp_path / "interp_nested_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert isinstance(mod.add_twice_kernel, interpreter.InterpretedFunction)
    saved = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patcher = _pristine(interpreter._patch_lang)
    runs = []

    def counting(fn):
        runs.append(fn.__name__)
        return patcher(fn)

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = counting, _pristine(interpreter.GridExecutor.__call__)
    yield mod, runs
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = saved


def _launch(mod, programs: int = 4, block: int = 8) -> torch.Tensor:
    x = torch.arange(programs * block, dtype=torch.float32)
    out = torch.empty_like(x)
    mod.add_twice_kernel[(programs,)](x, out, BLOCK=block)
    torch.testing.assert_close(out, 6 * x)
    return out


def test_without_the_wrap_every_device_call_rescans(nested_kernel) -> None:
    mod, runs = nested_kernel
    _launch(mod)
    assert runs.count("add_twice_kernel") == 1 and runs.count("twice") == 3 * 4


def test_with_the_wrap_a_launch_patches_once_and_restores(nested_kernel) -> None:
    import triton.language as tl

    mod, runs = nested_kernel
    load = tl.load
    compat.install_nested_call_skip()
    compat.install_nested_call_skip()                  # idempotent
    _launch(mod)
    assert runs == ["add_twice_kernel"]
    assert tl.load is load                             # the launch's scope was restored
    _launch(mod, programs=2)                           # the next launch patches again
    assert runs == ["add_twice_kernel"] * 2
    with pytest.raises(Exception, match="fails inside the grid"):
        mod.failing_kernel[(2,)](torch.zeros(8), BLOCK=8)
    assert tl.load is load
    _launch(mod)                                       # a failed launch leaves no live state
    assert runs == ["add_twice_kernel"] * 2 + ["failing_kernel", "add_twice_kernel"]
