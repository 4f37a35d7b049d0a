"""Triton 3.6's interpreter under our tests (test-only; compiled kernels are not affected).

Two wraps, both installed by `install` in every test process (`tests/conftest.py`) and in the scripts
`tests/interp_run.py` runs; they change only what the interpreter does. The guard tests (`tests/test_triton_interp_compat.py`) fail when a wrapped
function moves or stops doing what the wrap assumes.

* NumPy ≥ 2.4 (`TENSOR_PATCHER`): the interpreter turns each integer kernel argument into a
  one-element 1-D array and gives its tensors `__index__ = int(data)`. NumPy 2.4 no longer converts
  a 1-D array to a Python int, so every `range(…, E, …)` over a runtime argument raises "only
  0-dimensional arrays can be converted to Python scalars" (session 16, the H200 machine's NumPy
  2.4.6). The wrap makes `__index__` read the single element.
* Nested device calls (`LANG_PATCHER`, `GRID_CALL`): every call of a `@triton.jit` helper inside a
  kernel re-runs the language patcher, which scans `triton.language` with `inspect.getmembers`
  (under a millisecond a call). Inside a launch that has already patched the same language modules the rescan
  finds nothing left to patch (the builtins it looks for are already wrapped) and only re-sets the
  same stateless attributes, so the wrap skips it. A third of the interpreter's time in a forward
  of the tiny checkpoint went there (docs/validation.md, "CI time").
"""
from __future__ import annotations

import inspect

TENSOR_PATCHER = "triton.runtime.interpreter._patch_lang_tensor"
LANG_PATCHER = "triton.runtime.interpreter._patch_lang"
GRID_CALL = "triton.runtime.interpreter.GridExecutor.__call__"


def numpy_needs_index_fix() -> bool:
    import numpy as np

    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


def install() -> bool:
    """Install both wraps once (the index fix only where NumPy needs it); True when installed.
    Raises when a target is missing."""
    if numpy_needs_index_fix():
        install_index_fix()
    install_nested_call_skip()
    return True


def install_index_fix() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_dsv41_index_item", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._dsv41_index_item = True
    interpreter._patch_lang_tensor = patch_lang_tensor


class _NothingToRestore:
    """The scope of a skipped patch."""

    def restore(self) -> None:
        """Nothing was patched, so nothing is restored."""


def install_nested_call_skip() -> None:
    """Within one launch (`GridExecutor.__call__`), the first language patch is real; a later one
    whose function sees only language modules already patched is skipped. Outside a launch, and for
    a helper that sees a module the launch did not patch, the patcher runs as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "_dsv41_nested_skip", False):
        return
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launch = {"pending": False, "patched": None}      # the live launch's patched language modules (ids)

    seen: dict[object, tuple[int, frozenset[int]]] = {}   # fn -> (len of its globals, language module ids)

    def langs_seen_by(fn) -> frozenset[int]:
        known = seen.get(fn)
        if known is None or known[0] != len(fn.__globals__):
            ids = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))
            seen[fn] = known = (len(fn.__globals__), ids)
        return known[1]

    def patch_lang_once(fn):
        langs = langs_seen_by(fn)
        if launch["patched"] is not None and langs <= launch["patched"]:
            return _NothingToRestore()
        scope = patch_lang(fn)
        if launch["pending"]:
            launch.update(pending=False, patched=langs)
        elif launch["patched"] is not None:
            launch["patched"] = launch["patched"] | langs
        return scope

    def grid_call_tracked(self, *args, **kwargs):
        saved = dict(launch)
        launch.update(pending=True, patched=None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch.update(saved)

    patch_lang_once._dsv41_nested_skip = True
    patch_lang_once._dsv41_original, grid_call_tracked._dsv41_original = patch_lang, grid_call
    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = grid_call_tracked
