"""Whether `kernels/topk_select.py` at a commit and in the working tree compile to the same sm_90 instructions.

No GPU: Triton's bundled ptxas builds both versions' top-k kernels (bisect and radix) at the launch
configurations the runtime uses (a 4,096-column span writing candidates, resident 8,192 and chunked 65,536-column
rows, with row lengths), strips the debug sections and line records (a refactor into inlined helpers changes
only those) and compares the instruction streams. A structural change that prints IDENTICAL for every case runs
the same machine code as the commit's, whose GPU tests then cover it (docs/validation.md).

    python scripts/topk_ptx_compare.py COMMIT
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("_topk_rows_radix_kernel", 4096, True), ("_topk_rows_radix_kernel", 8192, False),
         ("_topk_rows_radix_kernel", 65536, False), ("_topk_rows_kernel", 4096, True),
         ("_topk_rows_kernel", 8192, False), ("_topk_rows_kernel", 65536, False)]
DEBUG = re.compile(r"^\s*(\.loc|\.file|//|\.b8|\.b32|\.section)|DW_AT|debug_|^\$L__tmp\d+:$")


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"sglang_dsv41.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def instructions(module, kernel: str, width: int, candidates: bool) -> tuple[str, str]:
    """(digest of the instruction stream, registers and stack) of one case's sm_90 build."""
    sys.path.insert(0, str(ROOT / "tests"))
    from triton_checks import compile_for_sm90

    block, resident, warps = module.launch_blocks(width)
    kern = getattr(module, kernel)
    consts = dict(BLOCK=block, RESIDENT=resident, WBLOCK=min(block, module.WRITE_BLOCK), HAS_LEN=True,
                  CAND=candidates)
    if not candidates:
        consts["SEGS"] = 1                                   # a whole row a program, as the launcher specialises
    pointers = {"s_ptr": "*fp32", "out_ptr": "*i64", "len_ptr": "*i64", "val_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in kern.arg_names}
    warps = module.radix_warps(block, resident, 1) if "radix" in kernel else warps
    compiled, usage = compile_for_sm90(kern, sig, consts, {"num_warps": warps})
    lines = [re.sub(r"\$L__tmp\d+", "TMP", re.sub(r"_topk_rows\w*", "K", line))
             for line in compiled.asm["ptx"].splitlines() if line.strip() and not DEBUG.search(line.strip())]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest(), " ".join(usage.split()[:2])


def main() -> int:
    commit = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        old_path = Path(tmp) / "topk_select_old.py"
        old_path.write_text(subprocess.run(["git", "show", f"{commit}:kernels/topk_select.py"], cwd=ROOT, check=True,
                                           capture_output=True, text=True).stdout)
        old, new = load(old_path, "topk_select_old"), load(ROOT / "kernels" / "topk_select.py", "topk_select_new")
        same = True
        for kernel, width, candidates in CASES:
            (a, usage_a), (b, usage_b) = (instructions(m, kernel, width, candidates) for m in (old, new))
            same &= a == b
            print(f"{kernel} width {width} candidates {candidates}: {'IDENTICAL' if a == b else 'DIFFERENT'} "
                  f"({usage_a} / {usage_b})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
