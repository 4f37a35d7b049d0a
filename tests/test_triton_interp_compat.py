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


# Triton 3.6's constructors the type fast paths replace (`triton_interp_compat.install_type_fast_paths`): the
# replacements are these less the marked assignments, which become lazy. A Triton that changes them fails here.
PRISTINE_INITS = {
    "tuple": '''def __init__(self, args: Sequence, type: Optional[tuple_type] = None):
    self.values = [i for i in args]
    if isinstance(type, tuple_type):
        self.type = type
    elif type is not None:  # make_template in ASTFunction.deserialize may pass us a list/tuple
        self.type = tuple_type(type)
    else:
        self.type = _type_for_tuple_values(self.values)  # lazy
''',
    "tuple_type": '''def __init__(self, types, fields=None):
    self.types = types
    self.fields = fields or [''] * len(types)
    self.name = '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'  # lazy
''',
    "block_type": '''def __init__(self, element_ty: dtype, shape: List):
    self.element_ty = element_ty

    # Note that block_type's shape is a list of int
    # while tensor's shape is a list of constexpr.
    assert (isinstance(shape, (list, tuple)))

    # shape can be empty ([]) when an input is a 0D tensor.
    self.shape = tuple(_unwrap_shape(shape))
    if not self.shape:
        raise TypeError('0d block_type is forbidden')

    self.numel = validate_block_shape(self.shape)
    self.name = f'<{self.shape}, {self.element_ty}>'  # lazy
''',
}


def _classes():
    from triton.language import core

    return {"tuple": core.tuple, "tuple_type": core.tuple_type, "block_type": core.block_type}


def test_type_fast_path_targets_are_triton_36s() -> None:
    """Fails when Triton changes a constructor the fast paths replace, or the dtype table."""
    import textwrap

    from triton.language import core

    compat.install_type_fast_paths()
    for key, cls in _classes().items():
        source = textwrap.dedent(inspect.getsource(_pristine(cls.__init__)))
        assert source == PRISTINE_INITS[key].replace("  # lazy", ""), (key, source)
    assert core.tuple.__init__ is not _pristine(core.tuple.__init__)          # installed
    table = inspect.getsource(_pristine(_resolve(compat.NP_DTYPE)))
    assert table.count(": np.dtype(") == 18 and "return np_types[tt_dtype.element_ty]" in table, table


def test_type_fast_paths_give_tritons_values() -> None:
    """Types built through the replaced constructors read as the ones Triton's own build: names,
    tuple types, equality, hashes; the dtype table maps every dtype as `_get_np_dtype` does."""
    import triton.language as tl
    from triton.language import core
    from triton.runtime import interpreter

    compat.install_type_fast_paths()
    compat.install_type_fast_paths()                   # idempotent

    def pristine(cls, *args):
        obj = cls.__new__(cls)
        _pristine(cls.__init__)(obj, *args)             # the eager assignments, through the setters
        return obj

    fields = ["a", "b"]
    cases = [(core.block_type, (tl.float32, [4, 8])), (core.block_type, (tl.pointer_type(tl.bfloat16), [16])),
             (core.tuple_type, ([tl.int32, tl.float16],)), (core.tuple_type, ([tl.int32, tl.int64], fields)),
             (core.tuple, ([core.constexpr(3), 5, tl.float32],)),
             (core.tuple, ([1, 2], core.tuple_type([core.constexpr_type(1), core.constexpr_type(2)], fields))),
             (core.tuple, ([1, 2], [tl.int32, tl.int32]))]
    for cls, args in cases:
        lazy, eager = cls(*args), pristine(cls, *args)
        assert "_dsv41_name" not in lazy.__dict__ and "_dsv41_type" not in lazy.__dict__ or cls is core.tuple
        if cls is core.tuple:
            assert lazy.type == eager.type and str(lazy.type) == str(eager.type) and lazy == eager
        else:
            assert lazy.name == eager.name and str(lazy) == str(eager) and lazy == eager
            assert lazy.mangle() == eager.mangle()
        if cls is core.block_type:
            assert lazy.shape == eager.shape and lazy.numel == eager.numel
    with pytest.raises(TypeError, match="0d block_type"):
        core.block_type(tl.float32, [])
    t = core.tuple([1, 2])
    t._setitem(0, 7)                                   # sets a new type, as before
    assert t.type == core.tuple([7, 2]).type

    get = _pristine(interpreter._get_np_dtype)
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15]
    for ty in [*scalars, *(core.block_type(s, [2, 4]) for s in scalars), tl.pointer_type(tl.float32),
               core.block_type(tl.pointer_type(tl.int8), [8])]:
        assert interpreter._get_np_dtype(ty) == get(ty), ty
    for bad in (tl.void, core.block_type(tl.void, [2])):
        with pytest.raises(KeyError):
            get(bad)
        with pytest.raises(KeyError):
            interpreter._get_np_dtype(bad)
