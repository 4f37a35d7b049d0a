"""Triton 3.6's interpreter under NumPy ≥ 2.4 (test-only; the compiled kernels are not affected).

The interpreter turns each integer kernel argument into a one-element 1-D array and gives its
tensors `__index__ = int(data)`. NumPy 2.4 no longer converts a 1-D array to a Python int, so
every `range(…, E, …)` over a runtime argument raises "only 0-dimensional arrays can be converted
to Python scalars" (our CPU kernel tests on the H200 machine's NumPy 2.4.6, session 16). `install`
wraps the interpreter's tensor patcher so that `__index__` reads the single element. The guard
test (`tests/test_triton_interp_compat.py`) fails when the wrapped function moves.
"""
from __future__ import annotations

import os

TARGET = "triton.runtime.interpreter._patch_lang_tensor"


def needed() -> bool:
    import numpy as np

    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    return os.environ.get("TRITON_INTERPRET") == "1" and (major, minor) >= (2, 4)


def install() -> bool:
    """Wrap the patcher once; True when it is (now) wrapped. Raises when the target is missing."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_dsv41_index_item", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._dsv41_index_item = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
