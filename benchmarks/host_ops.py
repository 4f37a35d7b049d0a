"""Host work of one eager forward of the CUDA serving path, counted per file:line — on CPU or CUDA.

The forward is the one `benchmarks/hit_extend.py` builds (tiny checkpoint, serving mode:
`deterministic=False`, MXFP4 routed experts, E4M3 dense weights; one request extending N tokens
after a prefix of L cached tokens). Per case it counts, over one forward after a warm-up one:
* `aten_ops`, `by_file`, `by_line`: every aten op by its innermost repository frame
  (`sglang_dsv41/…` or `kernels/…`), from a TorchDispatchMode;
* `launches`, `launches_by_line`: Triton kernel launches (`JITFunction.run`, on CPU the
  interpreter's `InterpretedFunction.run`) by the repository frame that issued them;
* `host_syncs`: ops that wait for a CUDA device (`SYNC_OPS`: `.item()`, `nonzero`, …) by site
  (counted on CPU tensors too: the same ops would wait on CUDA).

`--device cpu` (default, no GPU): the CUDA path's code on CPU tensors — `TritonBackend`,
`KernelAttentionOps`, `TritonMhc` and `_moe_cuda` picked as on CUDA, every Triton kernel run by
Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported); the aten ops the
interpreter issues inside a launch are not counted (a compiled launch has none). What differs
from CUDA: `triton_kernels.matmul_ogs` (the two MXFP4 expert GEMMs, Hopper only) is a shape-only
stand-in counted as one launch each; the routing plan takes its CUDA form (the fused order kernel
and triton_kernels' metadata kernel, interpreted); `BatchLayout.host_checks` is off as on CUDA.
`--device cuda`: the real kernels (run on the H200 by scripts/gpu/hit_extend.sh's machine).

  python benchmarks/host_ops.py --model-path /tmp/tiny --out /tmp/out/host_ops.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = f"{ROOT}/kernels/"
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select",
            "aten.repeat_interleave.Tensor", "aten._unique2", "aten.unique")
CASES = ((64, 32), (2048, 32), (2048, 1))


def repo_site(stack=None) -> str:
    """`file:line` of the innermost frame in this repository's package or kernels ("?" if none):
    `runtime/x.py:12`, `kernels/y.py:34` (a checkout's `kernels/` or an installed
    `sglang_dsv41/kernels/`)."""
    for f in reversed(stack if stack is not None else traceback.extract_stack()):
        name = f.filename
        if name.startswith(KERNELS):
            return f"kernels/{name[len(KERNELS):]}:{f.lineno}"
        at = name.rfind("/sglang_dsv41/")
        if at >= 0:
            return f"{name[at + len('/sglang_dsv41/'):]}:{f.lineno}"
    return "?"


class HostCounter:
    """Counts aten ops and Triton launches by repository site while entered (module doc)."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.ops: collections.Counter = collections.Counter()
        self.names: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.syncs: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        self.inside_launch = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter.inside_launch:
                    where = repo_site()
                    name = str(func)
                    counter.ops[where] += 1
                    counter.names[where][name] += 1
                    if name.startswith(SYNC_OPS) and any(isinstance(a, torch.Tensor) for a in args):
                        counter.syncs[f"{name} {where}"] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def launched(self) -> contextlib.AbstractContextManager:
        """Inside a kernel launch: count it (by the issuing site), not the ops it issues."""
        counter = self

        @contextlib.contextmanager
        def scope():
            if not counter.inside_launch:
                counter.launches[repo_site()] += 1
            counter.inside_launch += 1
            try:
                yield
            finally:
                counter.inside_launch -= 1
        return scope()

    def result(self) -> dict:
        by_file: collections.Counter = collections.Counter()
        for where, n in self.ops.items():
            by_file[where.rsplit(":", 1)[0]] += n
        return {"aten_ops": sum(self.ops.values()), "launches": sum(self.launches.values()),
                "host_syncs": sum(self.syncs.values()), "host_sync_sites": dict(self.syncs),
                "by_file": dict(by_file.most_common()),
                "by_line": {w: {"ops": n, "names": dict(self.names[w].most_common(4))}
                            for w, n in self.ops.most_common()},
                "launches_by_line": dict(self.launches.most_common())}


ACTIVE: list[HostCounter] = []


def patch_launches() -> None:
    """Route every Triton launch (compiled and interpreted) through the active counter."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if not ACTIVE:
                return _original(self, *args, **kwargs)
            with ACTIVE[-1].launched():
                return _original(self, *args, **kwargs)
        cls.run = run


def fake_matmul_ogs(x, w, bias, routing_data, gather_indx=None, precision_config=None, fused_activation=None, **_):
    """Shape-only `matmul_ogs` (CPU: the MXFP4 GEMMs are Hopper only): zeros of the output shape."""
    import torch

    rows = gather_indx.src_indx.shape[0] if gather_indx is not None else x.shape[0]
    n = w.shape[-1] // (2 if fused_activation is not None else 1)
    ctx = ACTIVE[-1].launched() if ACTIVE else contextlib.nullcontext()
    with ctx:
        return torch.zeros(rows, n, dtype=torch.bfloat16, device=x.device)


def cpu_as_cuda() -> None:
    """Pick the CUDA implementations for CPU tensors (module doc); kernels in the interpreter."""
    from sglang_dsv41.kernels import indexer as KI
    from sglang_dsv41.kernels import moe_mxfp4 as mx
    from sglang_dsv41.kernels import moe_routing_plan as rp
    from sglang_dsv41.kernels import sparse_attention as KA
    from sglang_dsv41.runtime import attention_ops, mhc_ops, moe_ops
    from sglang_dsv41.runtime import backend as B
    from sglang_dsv41.runtime import triton_backend as TB
    from sglang_dsv41.runtime import engram_table as ET
    from sglang_dsv41.runtime import forward as FW
    from sglang_dsv41.runtime.batch import BatchLayout
    from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm
    from sglang_dsv41.runtime.dense_weights import DenseWeightCache

    if not (KA._is_interpreted() and KI.INTERPRETED):
        raise RuntimeError("host_ops --device cpu needs TRITON_INTERPRET=1 before triton is imported")
    rows = B.bf16_gemm_for(False)
    FW.backend_for = lambda device, weights, det: TB.TritonBackend(
        BlockedBf16Gemm(DenseWeightCache.from_weights(weights), whole_rows=True,
                        triton_rows=rows == "triton", unpadded=rows == "direct"), device_types=("cpu",),
        fp8_gemm=B.fp8_gemm_for(False))
    FW.ops_for = lambda device, acc, det, heads=None, hd=None: attention_ops.KernelAttentionOps(KA, KI, deterministic=False)
    FW.mhc_for = lambda device, acc, det: mhc_ops.TritonMhc(deterministic=False)
    FW.moe_for = lambda device: moe_ops._moe_cuda
    check = mx._check_call
    mx._check_call = lambda x, ids, experts: check(x, ids, experts) if x.is_cuda else None
    mx.matmul_ogs = fake_matmul_ogs
    plan = mx.make_routing_plan
    mx.make_routing_plan = lambda ids, n, *, allow_absent=False, fused=None, check_ids=True: plan(
        ids, n, allow_absent=allow_absent, fused=0 < ids.numel() <= mx.FUSED_ORDER_MAX_SLOTS if fused is None else fused,
        check_ids=check_ids)
    rp.make_ragged_tensor_metadata_torch = rp.make_ragged_tensor_metadata
    BatchLayout.host_checks = property(lambda self: False)          # as on CUDA (`BatchLayout.host_checks`)
    ET.gathers_in_kernel = lambda ids: True                             # device tables' lookups as on CUDA


def count_case(engine, prefix: int, n: int) -> dict:
    from hit_extend import make_case

    ids, layout, caches = make_case(engine, prefix, n)
    engine.hidden_states(ids, layout, caches)                   # warm-up (builds, caches)
    counter = HostCounter()
    ACTIVE.append(counter)
    try:
        with counter.mode:
            engine.hidden_states(ids, layout, caches)
    finally:
        ACTIVE.pop()
    return {"prefix": prefix, "new_tokens": n, **counter.result()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--cases", type=int, nargs="+", default=[x for c in CASES for x in c],
                   help="PREFIX N pairs (default: 64 32 2048 32 2048 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from hit_extend import build_engine

    patch_launches()
    if a.device == "cpu":
        cpu_as_cuda()
        torch.set_num_threads(1)
    engine = build_engine(a.model_path, torch.device(a.device)) if a.device == "cuda" else build_cpu_engine(a.model_path)
    rows = []
    pairs = list(zip(a.cases[::2], a.cases[1::2]))
    for L, n in pairs:
        rows.append(count_case(engine, L, n))
        r = rows[-1]
        print(f"prefix {L:6d} new {n:5d}: aten ops {r['aten_ops']:5d}  launches {r['launches']:5d}  "
              f"host syncs {r['host_syncs']}", flush=True)
        print("  by file:", r["by_file"], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"model_path": a.model_path, "device": a.device, "cases": rows}, indent=1))
    return 0


def build_cpu_engine(model_path: str):
    """`hit_extend.build_engine`'s serving model, built on CPU with the CUDA weight forms."""
    import torch
    from sglang_dsv41.checkpoint.reader import CheckpointReader
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype

    cfg = DeepseekV41Config.from_file(model_path)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(model_path))
    with fp32_default_dtype(), torch.device("cpu"), CheckpointReader(model_path) as reader:
        engine = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map), experts_mxfp4=True,
                                          dense_fp8=True, deterministic=False)
        engine.load_weights((name, reader.get(name)) for name in reader.names())
    return engine


if __name__ == "__main__":
    raise SystemExit(main())
