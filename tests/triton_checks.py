"""Checks shared by the Triton kernel tests (CPU machines, no GPU needed).

* `run_kernel_cases_in_interpreter` — run a test file's `kernel_case` tests in a child pytest with
  `TRITON_INTERPRET=1` (the variable must be set before triton is imported, hence the child) and
  assert they all passed, none skipped or failed (the child may have run ahead of the test on a spare
  core: `child_runs`).
* `compile_for_sm90` — build a kernel for Hopper (sm_90) with Triton's bundled ptxas and return
  it with `cuobjdump -res-usage`'s line for it (registers, stack, local memory: spills show up as
  STACK/LOCAL > 0).
* `same_bits` / `flips_within_bound` — bitwise equality (signs of zero, NaN == NaN) and the kernels' "rare one-ulp
  flips" bound (`kernels/fused_elementwise.py`, "fp64 results").
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import child_runs
import torch


def kernel_cases_argv(test_file: str | Path) -> tuple[str, ...]:
    """The child pytest arguments of `run_kernel_cases_in_interpreter` (also what conftest prefetches)."""
    return child_runs.interpreter_argv(test_file, "-k", "kernel_case")


def run_kernel_cases_in_interpreter(test_file: str | Path, *, min_passed: int, exact: bool = False) -> str:
    """Child `pytest -k kernel_case test_file` under the interpreter; ≥ `min_passed` (or exactly,
    with `exact`) must pass and nothing may fail, error or skip. Returns the child's stdout."""
    proc = child_runs.run(kernel_cases_argv(test_file), timeout_s=600)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed, tail
    count = int(passed.group(1))
    assert (count == min_passed) if exact else (count >= min_passed), f"{count} kernel cases passed\n{tail}"
    assert not re.search(r"\d+ (failed|skipped|error)", proc.stdout), tail
    return proc.stdout


def compile_for_sm90(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any],
                     options: dict[str, Any], attrs: dict | None = None) -> tuple[Any, str]:
    """(compiled kernel, its `cuobjdump -res-usage` line) for sm_90; `signature` maps every argument
    name to a Triton type string ("constexpr" for the constexprs); `attrs` e.g. the 16-byte
    divisibility the launcher specialises aligned arguments with ({(i,): [["tt.divisibility", 16]]})."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=options)
    cubin = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"{kernel.__name__}_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        usage = subprocess.run([str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"),
                                "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    finally:
        cubin.unlink()
    lines = [line.strip() for line in usage.splitlines() if "REG:" in line]
    assert len(lines) == 1, usage
    return compiled, lines[0]


def no_spills(usage_line: str) -> bool:
    """True when the resource line shows no stack frame and no local memory (no register spills)."""
    return "STACK:0 " in usage_line + " " and "LOCAL:0 " in usage_line + " "


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values with equal signs of zero; NaN == NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    both_nan = a.isnan() & b.isnan()
    return bool(((a == b) & (torch.signbit(a) == torch.signbit(b)) | both_nan).all())


def flips_within_bound(got: torch.Tensor, want: torch.Tensor, bf16_ulps: bool) -> bool:
    """Equal except rare one-ulp flips: every difference ≤ one ulp (BF16 or fp32) of the reference value, and at
    most n·2⁻²⁰ + 1 of them."""
    diff = got != want
    if not bool(diff.any()):
        return True
    _, e = torch.frexp(want.abs().clamp(min=2.0**-126))
    ulp = torch.ldexp(torch.ones_like(want), e - (8 if bf16_ulps else 24))
    return bool(((got - want).abs() <= ulp).all()) and int(diff.sum()) <= want.numel() * 2.0**-20 + 1
