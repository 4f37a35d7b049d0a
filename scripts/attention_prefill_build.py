"""The sm_90 builds of the prefill attention kernels at the Flash shape, on a CPU machine (Triton's bundled
ptxas; no GPU): per layout and configuration, shared memory, registers and spills (`cuobjdump -res-usage`),
and the key loop's schedule in the TTGIR — the order of its cp.async copies (C), waits (Wn: wait until n
copy groups are left in flight) and tensor-core products (D). docs/performance.md "Session 45".

    python scripts/attention_prefill_build.py [--alt FILE]   (FILE: another version of
    kernels/sparse_attention_prefill.py, e.g. `git show 8895f06:kernels/sparse_attention_prefill.py`)
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

POINTERS = {"q_ptr": "*bf16", "swa_ptr": "*bf16", "comp_ptr": "*bf16", "swa_slots_ptr": "*i32",
            "comp_slots_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16", "part_acc_ptr": "*bf16",
            "part_ml_ptr": "*bf16"}


def loop_schedule(ttgir: str) -> str:
    """C / Wn / D in program order from the first loop on."""
    marks = []
    for line in ttgir[ttgir.index("scf.for"):].splitlines():
        if "ttg.async_wait" in line:
            marks.append("W" + re.search(r"num = (\d+)", line).group(1))
        elif "async_copy_global_to_local" in line:
            marks.append("C")
        elif "ttng.warp_group_dot " in line:
            marks.append("D")
    return "".join(marks)


def build(kernel, consts: dict, num_warps: int, num_stages: int) -> dict:
    from triton_checks import compile_for_sm90
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n == "qk_scale_log2" else "i32")
           for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n != "tiles_per_split"}
    compiled, usage = compile_for_sm90(kernel, sig, consts, {"num_warps": num_warps, "num_stages": num_stages}, attrs)
    return dict(shared=compiled.metadata.shared, regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack=int(re.search(r"STACK:(\d+)", usage).group(1)), schedule=loop_schedule(compiled.asm["ttgir"]))


def load_alt(path: Path):
    spec = importlib.util.spec_from_file_location("sglang_dsv41.kernels.sparse_attention_prefill_alt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alt", type=Path, default=None)
    args = ap.parse_args()
    from sglang_dsv41.kernels import sparse_attention_prefill as sap
    from sglang_dsv41.kernels import sparse_attention_prefill_heads as sah
    keys = dict(BLOCK_H=64, BLOCK_P=256, BLOCK_N=sap.BLOCK_N, HAS_COMP=True, NUM_SPLITS=1, DOT_FP32=False)
    rows = {}
    modules = {"keys": sap} | ({"keys_alt": load_alt(args.alt)} if args.alt else {})
    for label, mod in modules.items():
        for pv in ("split", "bf16"):
            rows[f"{label} pv={pv} 8 warps 2 stages"] = build(mod._prefill_attn_kernel,
                                                              keys | dict(PV_MODE=sap.PrefillAttentionConfig.PV_MODES[pv]),
                                                              8, 2)
    for pv, stages, keys in (("split", 2, 32), ("split", 3, 32), ("split", 5, 32), ("split", 5, 16),
                             ("split", 7, 16), ("split2", 2, 64), ("bf16", 2, 64), ("bf16", 5, 32), ("bf16", 5, 16)):
        consts = dict(BLOCK_H=64, BLOCK_P=256, KEYS=keys, HAS_COMP=True, DOT_FP32=False,
                      PV_MODE=sap.PrefillAttentionConfig.PV_MODES[pv])
        rows[f"heads pv={pv} {keys} keys {stages} stages"] = build(sah._prefill_attn_heads_kernel, consts, 8, stages)
    for name, r in rows.items():
        print(f"{name:32s} shared {r['shared']:7d} B  regs {r['regs']:3d}  spills {r['stack']:4d} B  loop {r['schedule']}")


if __name__ == "__main__":
    main()
