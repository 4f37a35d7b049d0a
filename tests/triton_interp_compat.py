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
* Type bookkeeping (`install_type_fast_paths`): the interpreter runs the language front end for every
  operation of every program, and a quarter of its time went to values nobody reads there: each
  `tl.tuple` (every tensor's shape is one) built its `tuple_type` and each `tuple_type` and
  `block_type` its display `name` string, and `_get_np_dtype` rebuilt its 19-entry dtype table per
  call. The wraps compute a tuple's type and those names when first read (from the same fields,
  which nothing changes after construction but `tuple._setitem`, which sets a new type) and build
  the table once. Every value anyone reads is the one Triton's own code gives (compiled kernels
  included: the same front end); the guard tests pin the replaced constructors' source.
"""
from __future__ import annotations

import inspect

TENSOR_PATCHER = "triton.runtime.interpreter._patch_lang_tensor"
LANG_PATCHER = "triton.runtime.interpreter._patch_lang"
GRID_CALL = "triton.runtime.interpreter.GridExecutor.__call__"
NP_DTYPE = "triton.runtime.interpreter._get_np_dtype"


def numpy_needs_index_fix() -> bool:
    import numpy as np

    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


def install() -> bool:
    """Install the wraps once (the index fix only where NumPy needs it); True when installed.
    Raises when a target is missing."""
    if numpy_needs_index_fix():
        install_index_fix()
    install_nested_call_skip()
    install_type_fast_paths()
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


def _tuple_type_name(self) -> str:
    """`tuple_type.name` as Triton 3.6's constructor sets it."""
    return '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'


def _block_type_name(self) -> str:
    """`block_type.name` as Triton 3.6's constructor sets it."""
    return f'<{self.shape}, {self.element_ty}>'


def _lazy_name(compute) -> property:
    """A `name` computed on first read and kept; a subclass may still assign its own."""

    def get(self) -> str:
        name = self.__dict__.get("_dsv41_name")
        if name is None:
            name = self._dsv41_name = compute(self)
        return name

    def set_(self, value: str) -> None:
        self._dsv41_name = value
    return property(get, set_)


def _tuple_type_of(self):
    """`tl.tuple.type` when its constructor was given none: `_type_for_tuple_values`, computed on
    first read and kept."""
    from triton.language import core

    t = self.__dict__.get("_dsv41_type")
    if t is None:
        t = self._dsv41_type = core._type_for_tuple_values(self.values)
    return t


def _set_tuple_type(self, value) -> None:
    self._dsv41_type = value


def install_type_fast_paths() -> None:
    """Lazy `tl.tuple.type`, `tuple_type.name` and `block_type.name`; `_get_np_dtype` off a table
    built once (module doc). The constructors below are Triton 3.6's less those assignments."""
    import numpy as np
    import triton.language as tl
    from triton.language import core
    from triton.runtime import interpreter

    if getattr(interpreter._get_np_dtype, "_dsv41_table", False):
        return
    validate_block_shape = core.validate_block_shape
    originals = {"tuple": core.tuple.__init__, "tuple_type": core.tuple_type.__init__,
                 "block_type": core.block_type.__init__, "np_dtype": interpreter._get_np_dtype}

    def tuple_init(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self.type = type
        elif type is not None:  # make_template in ASTFunction.deserialize may pass us a list/tuple
            self.type = core.tuple_type(type)

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    def block_type_init(self, element_ty, shape):
        self.element_ty = element_ty
        assert (isinstance(shape, (list, core.tuple)))
        self.shape = core.tuple(core._unwrap_shape(shape))
        if not self.shape:
            raise TypeError('0d block_type is forbidden')
        self.numel = validate_block_shape(self.shape)

    table: dict = {}
    scalars = (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15)
    get_np_dtype = originals["np_dtype"]

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return np.dtype(np.uint64)
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return np.dtype(np.uint64)
            tt_dtype = tt_dtype.element_ty
        if not table:
            table.update((t, get_np_dtype(t)) for t in scalars)
        return table[tt_dtype]

    for fn, key in ((tuple_init, "tuple"), (tuple_type_init, "tuple_type"), (block_type_init, "block_type"),
                    (np_dtype, "np_dtype")):
        fn._dsv41_original = originals[key]
    np_dtype._dsv41_table = True
    core.tuple.__init__ = tuple_init
    core.tuple.type = property(_tuple_type_of, _set_tuple_type)
    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = _lazy_name(_tuple_type_name)
    core.block_type.__init__ = block_type_init
    core.block_type.name = _lazy_name(_block_type_name)
    interpreter._get_np_dtype = np_dtype
