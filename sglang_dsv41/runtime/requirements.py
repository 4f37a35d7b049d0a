"""What the current runtime needs from SGLang 0.5.17 and what it can serve — declared once.

The plugin applies the declared server-argument defaults inside SGLang itself
(`sglang_dsv41/overrides.py`: a plain `python -m sglang.launch_server --model-path <V4.1>` gets
them), and refuses there, at start-up, what the runtime cannot serve. `sglang-dsv41 launch`,
`doctor` and the planner read the same declaration, so the defaults, the limits users are told
about and the values the server resolves cannot disagree (docs/runtime.md "Server defaults and
start-up refusals"; docs/deploy.md "Runtime limits").

Invariants
----------
* Each `ServerFlag` names an SGLang CLI flag whose `ServerArgs` field is `ServerFlag.dest`
  (the flag without ``--``, dashes as underscores) and its typed default (`True` for a switch).
* `RuntimeProfile.server_args(device, given)` returns, as CLI arguments, the declared defaults
  on that device that `given` does not already set — a flag the user (or a deployment config)
  sets itself always wins; `RuntimeProfile.defaults(device, tp_size, hicache_storage)` returns the
  same as `{dest: value}` for the in-server override.
* A flag with a `storage_default` takes it instead of `default` when a HiCache storage (L3)
  backend is configured (`--enable-hierarchical-cache` and `--hicache-storage-backend`): the page
  size (`STORAGE_PAGE_SIZE`, docs/hicache.md "L3 write throughput").
* Every limit has a plain reason (`RuntimeProfile.reasons`), phrased for a user who asked for
  more ("runtime supports TP1/TP2/TP4/TP8 only for now (...)"); nothing here imports torch or
  SGLang.
* `CURRENT_RUNTIME` is the profile of the code in `runtime/` today; when the runtime grows
  (Triton kernels, TP, vision, CUDA graphs) this declaration changes with it.
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
#: SGLang page size with a HiCache storage (L3) backend: L3 stores one object (a file for `file`) per
#: page per host pool, and its cost is per object, so 2-token pages made the write-through to L3
#: crawl (docs/hicache.md "L3 write throughput"); a multiple of every compress ratio (2).
STORAGE_PAGE_SIZE = 64
HICACHE_FLAG = "--enable-hierarchical-cache"
HICACHE_STORAGE_FLAG = "--hicache-storage-backend"
#: SGLang's prefill CUDA-graph backend on CUDA at TP 1 (`runtime/prefill_graph.py`) and its token buckets
PREFILL_GRAPH_BACKEND = "full"
PREFILL_GRAPH_TOKENS = (4, 8, 16, 32, 64, 128, 256)
#: decode CUDA graphs cover batches 1..this by default (`--cuda-graph-max-bs-decode`)
DECODE_GRAPH_MAX_BS = 256
#: the `ServerArgs` fields of the prefill-graph default (all or none apply: `overrides.py`)
PREFILL_GRAPH_FIELDS = ("cuda_graph_backend_prefill", "cuda_graph_bs_prefill", "disable_chunked_prefix_cache")
#: SWA pool tokens per full-pool token (SGLang `--swa-full-tokens-ratio`; see the flag's reason).
SWA_FULL_TOKENS_RATIO = 0.1
#: Share of GPU memory for weights + KV pool on CUDA (SGLang `--mem-fraction-static`; see the flag's reason).
CUDA_MEM_FRACTION_STATIC = 0.85
#: CUDA KV-pool cap in context lengths (`overrides.py`: bounds SGLang's token-sized eager buffers;
#: Flash's 1M context makes it 268M tokens, far above what memory gives it).
CUDA_TOKENS_PER_CONTEXT = 256
#: The names `sglang_dsv41.api.register` registers the V4.1 parsers under (first spelling of
#: `api.reasoning_parser.PARSER_NAMES` / `api.tool_parser.PARSER_NAMES`; tests/test_overrides.py
#: pins the match — repeated here because this module imports no SGLang code).
REASONING_PARSER = "deepseek-v41"
TOOL_CALL_PARSER = "deepseek-v41"


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
    """One SGLang server flag the runtime needs on some devices, its typed default and why."""

    flag: str
    default: object  # typed ServerArgs value; True for a switch
    devices: tuple[Device, ...]
    why: str
    multi_gpu_only: bool = False  # only when the tensor-parallel size is > 1
    single_gpu_only: bool = False  # only when the tensor-parallel size is 1
    storage_default: object = None  # the default instead when a HiCache storage backend is set (None: `default`)

    @property
    def dest(self) -> str:
        """The `ServerArgs` field the flag sets."""
        return self.flag[2:].replace("-", "_")

    def default_for(self, hicache_storage: bool = False) -> object:
        """The typed default, with or without a HiCache storage (L3) backend (a list for a tuple)."""
        default = self.storage_default if hicache_storage and self.storage_default is not None else self.default
        return list(default) if isinstance(default, tuple) else default

    def value_for(self, hicache_storage: bool = False) -> str | None:
        """The CLI value (None for a switch; space-separated for a list)."""
        default = self.default_for(hicache_storage)
        if isinstance(default, list):
            return " ".join(map(str, default))
        return None if default is True else str(default)

    @property
    def value(self) -> str | None:
        """The CLI value without a storage backend (None for a switch)."""
        return self.value_for(False)

    def wanted(self, device: Device, tp_size: int) -> bool:
        """Whether the runtime needs this flag on `device` at tensor-parallel size `tp_size`."""
        return (device in self.devices and (tp_size > 1 or not self.multi_gpu_only)
                and (tp_size == 1 or not self.single_gpu_only))

    def applies(self, device: Device, given: Sequence[str]) -> bool:
        """Whether the flag is wanted and the CLI arguments `given` do not set it themselves."""
        if has_flag(given, self.flag):
            return False
        tp = flag_value(given, TP_FLAGS)
        return self.wanted(device, int(tp) if tp is not None and tp.isdigit() else 1)

    def args(self, hicache_storage: bool = False) -> list[str]:
        value = self.value_for(hicache_storage)
        return [self.flag] if value is None else [self.flag, *value.split(" ")]


def uses_hicache_storage(args: Sequence[str]) -> bool:
    """Whether CLI arguments `args` configure a HiCache storage (L3) backend."""
    return has_flag(args, HICACHE_FLAG) and flag_value(args, (HICACHE_STORAGE_FLAG,)) is not None


def prefill_stays_eager(args: Sequence[str]) -> bool:
    """Whether CLI arguments `args` keep prefill eager, so the prefill-graph defaults do not apply:
    prefill graphs turned off, DSpark, or a PD role (`overrides.prefill_graph_defaults` in-server)."""
    mode = flag_value(args, ("--disaggregation-mode",))
    return (any(has_flag(args, f) for f in ("--disable-prefill-cuda-graph", "--disable-cuda-graph",
                                            "--speculative-algorithm"))
            or flag_value(args, ("--cuda-graph-backend-prefill",)) == "disabled"
            or mode not in (None, "null"))


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
    pd_vision: bool = False  # image requests through prefill/decode disaggregation
    attention_backends: tuple[str, ...] = ()  # SGLang --attention-backend values the runtime accepts
    pd_transfer_backends: tuple[str, ...] = ("mooncake", "mooncake_tcp", "nixl")  # deploy `pd.transfer_backend`s
    reasons: dict[str, str] = field(default_factory=dict)  # limit name -> why, for refusals

    def server_args(self, device: Device, given: Sequence[str] = ()) -> list[str]:
        """The runtime's flags for `device` that `given` does not set already (user flags win)."""
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        storage = uses_hicache_storage(given)
        return [a for f in self.applicable(device, given) for a in f.args(storage)]

    def applicable(self, device: Device, given: Sequence[str] = ()) -> list[ServerFlag]:
        """The flags `server_args` emits for `device` and CLI arguments `given`, in declaration order."""
        eager_prefill = prefill_stays_eager(given)
        return [f for f in self.flags
                if f.applies(device, given) and not (eager_prefill and f.dest in PREFILL_GRAPH_FIELDS)]

    def defaults(self, device: Device, tp_size: int = 1, hicache_storage: bool = False) -> dict[str, object]:
        """`{ServerArgs field: value}` of the flags wanted on `device` at `tp_size` (declaration order),
        with or without a HiCache storage (L3) backend."""
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        return {f.dest: f.default_for(hicache_storage) for f in self.flags if f.wanted(device, tp_size)}

    def supports_tp(self, tp: int) -> bool:
        return tp in self.tp_sizes

    def tp_reason(self) -> str:
        sizes = "/".join(f"TP{n}" for n in self.tp_sizes)
        return f"runtime supports {sizes} only for now ({self.reasons['tensor_parallel']})"

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
            lines.append(f"server defaults on {d}: {' '.join(self.server_args(d)) or '(none)'}")
        return lines


TORCH_PATH = RuntimeProfile(
    name="torch path",
    doc="docs/runtime.md",
    flags=(
        ServerFlag("--attention-backend", "torch_native", ("cpu",),
                   "the model computes its own attention from its slot caches; SGLang's backend only has to "
                   "construct, and torch_native accepts the V4.1 pool"),
        ServerFlag("--attention-backend", GRAPH_BACKEND_NAME, ("cuda",),
                   "torch_native plus the decode CUDA-graph hooks SGLang's graph runner calls "
                   "(runtime/graph_backend.py); the model computes its own attention"),
        ServerFlag("--page-size", PAGE_SIZE, ("cpu", "cuda"),
                   "a ratio-2 compressed entry spans the rows of 2 consecutive token slots, so pages must be "
                   "even; 2 is the smallest such size: prefix hits are page-aligned (at most 1 token "
                   "recomputed) and SGLang's SWA eviction keeps max(window, page) = window tokens; with a "
                   f"HiCache storage backend {STORAGE_PAGE_SIZE}: L3 stores one object per page per host pool and "
                   "pays per object, which at 2-token pages made the write-through to L3 crawl",
                   storage_default=STORAGE_PAGE_SIZE),
        ServerFlag("--swa-full-tokens-ratio", SWA_FULL_TOKENS_RATIO, ("cpu", "cuda"),
                   "an SWA token costs L·2·head_dim bytes (Flash 40 KiB) against 896 B of global KV; SGLang's "
                   "default 0.8 would spend 97 % of the KV budget on SWA slots, while a decoding request needs "
                   "only window + page of them (0.1 covers requests from ~1,300 tokens up at Flash)"),
        ServerFlag("--cuda-graph-max-bs-decode", DECODE_GRAPH_MAX_BS, ("cuda",),
                   "decode runs as CUDA graphs (static decode layout, runtime/batch.py) for every batch of "
                   "1-256 requests; the 36 sizes of a 4-layer Flash-width server captured in 9.6 s with "
                   "0.75 GB of graph memory on an H200 (docs/performance.md, session 21)"),
        ServerFlag("--cuda-graph-backend-prefill", PREFILL_GRAPH_BACKEND, ("cuda",),
                   "extends of up to 256 tokens replay one CUDA graph of the whole body per token bucket "
                   "(static extend layout, runtime/prefill_graph.py); eager they are host-bound (docs/prefill_graphs.md). "
                   "SGLang's breakable default would need a break around every batch-dependent step; the "
                   "declared default gives way to PD and DSpark (eager there)",
                   single_gpu_only=True),
        ServerFlag("--cuda-graph-bs-prefill", PREFILL_GRAPH_TOKENS, ("cuda",),
                   "the prefill graphs' token buckets: longer extends run eagerly, where the BF16 prefill "
                   "workspace pays (runtime/attention_prefill.py); SGLang pads at most 2× the live tokens",
                   single_gpu_only=True),
        ServerFlag("--disable-chunked-prefix-cache", True, ("cuda",),
                   "SGLang's full prefill runner otherwise captures MLA prefix-chunk variants, which the V4.1 "
                   "attention (sparse over its own caches) neither has nor needs", single_gpu_only=True),
        ServerFlag("--disable-cuda-graph", True, ("cuda",),
                   "tensor parallel > 1 decodes eagerly until graph capture with its collectives is "
                   "validated on GPUs (the static forward at TP 2 equals TP 1 on CPU)", multi_gpu_only=True),
        ServerFlag("--mem-fraction-static", CUDA_MEM_FRACTION_STATIC, ("cuda",),
                   "SGLang's automatic fraction (0.907 on an H200) leaves too little for the runtime's fp32 "
                   "activations and SGLang's eager/graph buffers, sized by the 8K prefill chunk: a plain "
                   "launch of the tiny checkpoint ran out of memory building them (docs/validation.md)"),
        ServerFlag("--sampling-backend", "pytorch", ("cuda",),
                   "flashinfer's sampler JIT-compiles with nvcc on a fresh machine (minutes); the torch sampler "
                   "is exact for greedy and fast enough for the torch path"),
        ServerFlag("--max-total-tokens", 16384, ("cpu",),
                   "SGLang's CPU engine otherwise sizes the KV pool from all free RAM"),
        ServerFlag("--sleep-on-idle", True, ("cpu",),
                   "otherwise the CPU scheduler busy-polls a core"),
        ServerFlag("--reasoning-parser", REASONING_PARSER, ("cpu", "cuda"),
                   "thinking is on by default (model card): the trace belongs in reasoning_content, which "
                   "SGLang fills only with a reasoning parser; without one the trace lands in content"),
        ServerFlag("--tool-call-parser", TOOL_CALL_PARSER, ("cpu", "cuda"),
                   "V4.1 writes DSML tool calls; without the parser they reach the client as text in content"),
    ),
    tp_sizes=(1, 2, 4, 8),
    vision=True,
    cuda_graphs=True,
    cuda_graph_tp_sizes=(1,),
    prefill_cuda_graphs=True,
    pd_disaggregation=True,
    kv_cache_dtypes=("auto", "bf16"),
    attention_backends=("torch_native", GRAPH_BACKEND_NAME),
    pd_transfer_backends=("mooncake", "mooncake_tcp"),
    reasons={
        "tensor_parallel": "attention is sharded by whole output groups, so --tp-size must divide o_groups and "
                           "the head count (the model checks this at start-up, runtime/tensor_parallel.py)",
        "dp_attention": "the runtime shards attention over the whole TP group, every rank computing the same "
                        "tokens; SGLang's DP attention gives each rank its own requests, which the runtime does not "
                        "gather; serve with plain --tp-size",
        "vision": "the runtime serves images from a checkpoint with a vision_config (ViT + aligner on the torch "
                  "path, replicated on every TP rank, docs/vision.md); features.text_only: true "
                  "(--language-model-only) skips the tower and refuses image requests",
        "cuda_graphs": "the runtime captures decode CUDA graphs and `full` prefill graphs (extends up to 256 "
                       "tokens) at TP 1 only (static layouts); TP > 1 runs eagerly until graph capture with its "
                       "collectives is validated on GPUs (the plugin defaults --disable-cuda-graph there)",
        "prefill_graph_backend": "the runtime's prefill graphs are SGLang's `full` backend (one graph of the whole "
                                 "body per token bucket, runtime/prefill_graph.py); `breakable` and `tc_piecewise` "
                                 "would capture its batch-dependent steps as constants",
        "pd_vision": "image requests through prefill/decode disaggregation are not built or tested (the decode "
                     "side's image spans, docs/vision.md); set features.text_only: true for a PD deployment",
        "pd_disaggregation": "the V4.1 pool's PD transfer is built and tested over Mooncake only (equal TP on "
                             "both sides, docs/pd.md); other transfer backends are refused at start-up",
        "kv_cache_dtype": "the runtime's pool stores BF16 SWA rows and packed FP4 global rows (896 B/token at "
                          "Flash, already compressed): a KV dtype other than bf16 (e.g. fp8_e4m3) is refused at "
                          "start-up",
        "attention_backend": "the model computes its own attention from its slot caches; SGLang's backend only "
                             "has to construct over the V4.1 pool (torch_native) and, for "
                             f"decode CUDA graphs, answer the graph runner ({GRAPH_BACKEND_NAME})",
        "page_size": "a ratio-2 compressed entry spans the rows of 2 consecutive token slots, which must share a "
                     "page (phase-2 contracts §2), so the page size must be a multiple of the largest compress "
                     "ratio of a kv source",
        "hybrid_swa": "the runtime's caches are SGLang's hybrid-SWA pool (packed rows + SWA rows); "
                      "--disable-hybrid-swa-memory would give it a pool it cannot read",
    },
)

#: The runtime in `sglang_dsv41/runtime/` today.
CURRENT_RUNTIME: RuntimeProfile = TORCH_PATH
