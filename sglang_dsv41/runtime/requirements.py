"""What the current runtime needs from SGLang 0.5.17 and what it can serve — declared once.

`sglang-dsv41 serve`, `sglang-dsv41 launch` and `sglang-dsv41 doctor` all read this module, so
the SGLang flags the model needs and the limits users are told about cannot disagree
(docs/runtime.md "What is torch-path-only for now"; docs/deploy.md "Runtime limits").

Invariants
----------
* `RuntimeProfile.server_args(device, given)` returns the flags the runtime needs on that
  device that `given` does not already set — a flag the user (or a deployment config) sets
  itself always wins, and is never repeated.
* Every limit has a plain reason (`RuntimeProfile.reasons`), phrased for a user who asked for
  more ("runtime supports TP1/TP2/TP4/TP8 only for now (...)"); nothing here imports torch or
  SGLang.
* `CURRENT_RUNTIME` is the profile of the code in `runtime/` today; when the runtime grows
  (Triton kernels, TP, vision, CUDA graphs) this declaration changes with it, and the launcher's
  golden dry-runs (`tests/golden/launch/`) show the difference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")
TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
#: `runtime/graph_backend.BACKEND_NAME` (kept here as a literal: this module imports no SGLang code)
GRAPH_BACKEND_NAME = "dsv41"
DP_ATTENTION_FLAG = "--enable-dp-attention"
#: SGLang page size the runtime asks for: even, so a ratio-2 entry's 2 token rows share a page
#: (phase-2 contracts §2); the smallest such value (see the `--page-size` flag's reason).
PAGE_SIZE = 2
#: SWA pool tokens per full-pool token (SGLang `--swa-full-tokens-ratio`; see the flag's reason).
SWA_FULL_TOKENS_RATIO = 0.1


def has_flag(args: Sequence[str], flag: str) -> bool:
    """Whether `flag` appears in `args` as `--flag` or `--flag=value`."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the last of `flags` given in `args` (`--f v` or `--f=v`), else None."""
    value = None
    for i, a in enumerate(args):
        for f in flags:
            if a == f and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(f + "="):
                value = a.split("=", 1)[1]
    return value


@dataclass(frozen=True)
class ServerFlag:
    """One SGLang server flag the runtime needs on some devices, and why."""

    flag: str
    value: str | None  # None: a switch
    devices: tuple[Device, ...]
    why: str
    multi_gpu_only: bool = False  # only when the given args ask for --tp-size > 1

    def applies(self, device: Device, given: Sequence[str]) -> bool:
        if device not in self.devices or has_flag(given, self.flag):
            return False
        if self.multi_gpu_only:
            tp = flag_value(given, TP_FLAGS)
            return tp is not None and tp.isdigit() and int(tp) > 1
        return True

    def args(self) -> list[str]:
        return [self.flag] if self.value is None else [self.flag, self.value]


@dataclass(frozen=True)
class RuntimeProfile:
    """The SGLang flags a runtime needs and the features it provides (see the module doc)."""

    name: str
    doc: str  # where users read more
    flags: tuple[ServerFlag, ...]
    tp_sizes: tuple[int, ...]
    vision: bool
    cuda_graphs: bool
    pd_disaggregation: bool
    kv_cache_dtypes: tuple[str, ...]  # SGLang --kv-cache-dtype values the runtime accepts
    cuda_graph_tp_sizes: tuple[int, ...] = (1, 2, 4, 8)  # TP sizes whose decode is captured
    prefill_cuda_graphs: bool = True
    dp_attention: bool = False  # SGLang --enable-dp-attention (each rank its own requests)
    reasons: dict[str, str] = field(default_factory=dict)  # limit name -> why, for refusals

    def server_args(self, device: Device, given: Sequence[str] = ()) -> list[str]:
        """The runtime's flags for `device` that `given` does not set already (user flags win)."""
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        out: list[str] = []
        for f in self.flags:
            if f.applies(device, given):
                out += f.args()
        return out

    def supports_tp(self, tp: int) -> bool:
        return tp in self.tp_sizes

    def tp_reason(self) -> str:
        sizes = "/".join(f"TP{n}" for n in self.tp_sizes)
        return f"runtime supports {sizes} only for now ({self.reasons['tensor_parallel']})"

    def check_server_args(self, args: Sequence[str]) -> None:
        """Raise ValueError when `args` ask for a tensor-parallel size or DP attention the runtime
        cannot run."""
        tp = flag_value(args, TP_FLAGS)
        if tp is not None and (not tp.isdigit() or not self.supports_tp(int(tp))):
            raise ValueError(f"--tp-size {tp}: {self.tp_reason()}")
        if has_flag(args, DP_ATTENTION_FLAG) and not self.dp_attention:
            raise ValueError(f"{DP_ATTENTION_FLAG}: {self.reasons['dp_attention']}")

    def graph_summary(self) -> str:
        if not self.cuda_graphs:
            return "no"
        prefill = "decode + prefill" if self.prefill_cuda_graphs else "decode"
        return f"{prefill} at TP {'/'.join(map(str, self.cuda_graph_tp_sizes))}"

    def summary(self) -> list[str]:
        """One line per property, for `doctor` and the docs."""
        yes_no = {True: "yes", False: "no"}
        lines = [f"tensor parallel sizes: {', '.join(map(str, self.tp_sizes))}",
                 f"vision (image input): {yes_no[self.vision]}",
                 f"CUDA graphs: {self.graph_summary()}",
                 f"PD disaggregation: {yes_no[self.pd_disaggregation]}",
                 f"DP attention: {yes_no[self.dp_attention]}",
                 f"--kv-cache-dtype: {', '.join(self.kv_cache_dtypes)}"]
        for d in DEVICES:
            lines.append(f"SGLang flags on {d}: {' '.join(self.server_args(d)) or '(none)'}")
        return lines


TORCH_PATH = RuntimeProfile(
    name="torch path",
    doc="docs/runtime.md",
    flags=(
        ServerFlag("--attention-backend", "torch_native", ("cpu",),
                   "the model computes its own attention from its slot caches; SGLang's backend only has to "
                   "construct, and torch_native accepts the single-KV-head, v_head_dim = 0 pool"),
        ServerFlag("--attention-backend", GRAPH_BACKEND_NAME, ("cuda",),
                   "torch_native plus the decode CUDA-graph hooks SGLang's graph runner calls "
                   "(runtime/graph_backend.py); the model computes its own attention"),
        ServerFlag("--page-size", str(PAGE_SIZE), ("cpu", "cuda"),
                   "a ratio-2 compressed entry spans the rows of 2 consecutive token slots, so pages must be "
                   "even; 2 is the smallest such size: prefix hits are page-aligned (at most 1 token "
                   "recomputed) and SGLang's SWA eviction keeps max(window, page) = window tokens"),
        ServerFlag("--swa-full-tokens-ratio", str(SWA_FULL_TOKENS_RATIO), ("cpu", "cuda"),
                   "an SWA token costs L·2·head_dim bytes (Flash 40 KiB) against 890 B of global KV; SGLang's "
                   "default 0.8 would spend 97 % of the KV budget on SWA slots, while a decoding request needs "
                   "only window + page of them (0.1 covers requests from ~1,300 tokens up at Flash)"),
        ServerFlag("--cuda-graph-max-bs-decode", "16", ("cuda",),
                   "decode runs as CUDA graphs (static decode layout, runtime/batch.py); each captured batch "
                   "size is one more capture at start-up and the static indexer width is the context "
                   "length, so a modest ceiling keeps start-up and graph memory small"),
        ServerFlag("--disable-cuda-graph", None, ("cuda",),
                   "tensor parallel > 1 decodes eagerly until graph capture with its collectives is "
                   "validated on GPUs (the static forward at TP 2 equals TP 1 on CPU)", multi_gpu_only=True),
        ServerFlag("--sampling-backend", "pytorch", ("cuda",),
                   "flashinfer's sampler JIT-compiles with nvcc on a fresh machine (minutes); the torch sampler "
                   "is exact for greedy and fast enough for the torch path"),
        ServerFlag("--max-total-tokens", "16384", ("cpu",),
                   "SGLang's CPU engine otherwise sizes the KV pool from all free RAM"),
        ServerFlag("--sleep-on-idle", None, ("cpu",),
                   "otherwise the CPU scheduler busy-polls a core"),
    ),
    tp_sizes=(1, 2, 4, 8),
    vision=False,
    cuda_graphs=True,
    cuda_graph_tp_sizes=(1,),
    prefill_cuda_graphs=False,
    pd_disaggregation=False,
    kv_cache_dtypes=("auto", "bf16"),
    reasons={
        "tensor_parallel": "attention is sharded by whole output groups, so --tp-size must divide o_groups and "
                           "the head count (the model checks this at start-up, runtime/tensor_parallel.py)",
        "dp_attention": "the runtime shards attention over the whole TP group, every rank computing the same "
                        "tokens; SGLang's DP attention gives each rank its own requests, which the runtime does not "
                        "gather; serve with plain --tp-size",
        "vision": "the runtime serves text only for now: vision tensors are not loaded and image requests are "
                  "refused; set features.text_only: true to serve text",
        "cuda_graphs": "the runtime captures decode CUDA graphs at TP 1 only (static decode layout); prefill runs "
                       "eagerly, and TP > 1 eagerly until graph capture with its collectives is validated on "
                       "GPUs (the launcher adds --disable-cuda-graph there)",
        "pd_disaggregation": "the runtime keeps request-scoped state beside SGLang's pool (the pending first token "
                             "of a ratio-2 pair) and cannot transfer it between prefill and decode servers yet",
        "kv_cache_dtype": "the runtime needs SGLang's pool in bf16: its global rows hold packed FP4 entries "
                          "(890 B/token at Flash, already compressed) and its SWA rows BF16 values; a pool of another "
                          "dtype (e.g. fp8_e4m3) is refused at start-up",
    },
)

#: The runtime in `sglang_dsv41/runtime/` today.
CURRENT_RUNTIME: RuntimeProfile = TORCH_PATH
