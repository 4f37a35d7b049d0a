"""Every HookRegistry patch sglang-dsv41 applies to SGLang 0.5.17 internals — one table.

SGLang's plugin framework (`sglang.srt.plugins.hook_registry.HookRegistry`, spec `runtime.md`
§B) wraps a dotted target with a BEFORE / AFTER / AROUND / REPLACE hook. Patches of SGLang
internals are fragile against refactors, so they all live in `HOOKS` below, each with:

* ``target``  — the dotted path of the patched function or method;
* ``kind``    — the `HookType` (hook signatures: BEFORE ``fn(*a, **k)``; AFTER
  ``fn(result, *a, **k)``; AROUND ``fn(original, *a, **k)``; REPLACE ``fn(*a, **k)``);
* ``impl``    — ``"module:function"`` of our hook implementation (imported only when installed);
* ``params``  — the target's parameter names in SGLang 0.5.17; `tests/test_hooks.py` fails when a
  target moved or its signature changed, so an SGLang upgrade cannot silently disable a hook;
* ``area``    — the owning area (``api``, ``runtime``, …) and ``why`` — what breaks without it.

To add a hook: append a `HookSpec`, put the implementation in your area's module, add a
behaviour test. `install_hooks` registers the entries of the given areas, applies them, and then
*verifies* that each target is wrapped by its implementation: `HookRegistry.apply_hooks` only
logs a failed patch, and a silently missing hook would, for example, encode V4.1 prompts with
the V4 encoder. Note that HookRegistry skips targets it already patched, so all hooks on one
target must be installed in the same `install_hooks` call.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Iterable

_SERVING_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_API_IMPL = "sglang_dsv41.api.serving"
_RUNTIME_IMPL = "sglang_dsv41.runtime.sglang_hooks"
_DSPARK_IMPL = "sglang_dsv41.runtime.dspark_hooks"
_PD_LAYOUT = "sglang_dsv41.runtime.pd_layout"
_PD_STATE = "sglang_dsv41.runtime.pd_state"
_DISAGG = "sglang.srt.disaggregation"


@dataclass(frozen=True)
class HookSpec:
    target: str
    kind: str  # "before" | "after" | "around" | "replace"
    impl: str
    params: tuple[str, ...]
    area: str
    why: str

    def implementation(self) -> Callable:
        module, _, name = self.impl.partition(":")
        return getattr(importlib.import_module(module), name)


HOOKS: tuple[HookSpec, ...] = (
    HookSpec(
        target="sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec",
        kind="around", impl=f"{_API_IMPL}:resolve_chat_encoding_spec_hook",
        params=("hf_config", "tokenizer", "tool_call_parser"), area="api",
        why="V4.1 (model_type deepseek_v41) must be rendered by deepseek-recipe's V4.1 encoder; "
            "SGLang would otherwise pick its V4 encoder (wrong tool tags and effort)."),
    HookSpec(
        target=f"{_SERVING_CHAT}.__init__", kind="after",
        impl=f"{_API_IMPL}:serving_chat_init_hook",
        params=("self", "tokenizer_manager", "template_manager"), area="api",
        why="start-up checks (parsers, --chat-template, effort table, default kwargs) and the "
            "prompt-token encoder."),
    HookSpec(
        target=f"{_SERVING_CHAT}._convert_to_internal_request", kind="around",
        impl=f"{_API_IMPL}:convert_to_internal_request_hook",
        params=("self", "request", "raw_request"), area="api",
        why="resolves thinking/effort per the card (400 on bad input) and passes token ids to "
            "the multimodal path."),
    HookSpec(
        target=f"{_SERVING_CHAT}._apply_jinja_template", kind="around",
        impl=f"{_API_IMPL}:apply_jinja_template_hook",
        params=("self", "request", "tools", "is_multimodal"), area="api",
        why="renders the prompt with deepseek-recipe's V4.1 encoder instead of a jinja template."),
    HookSpec(
        target=f"{_SERVING_CHAT}._get_reasoning_from_request", kind="around",
        impl=f"{_API_IMPL}:get_reasoning_from_request_hook",
        params=("self", "request"), area="api",
        why="reasoning parser and reasoning grammar must follow the resolved thinking mode "
            "(SGLang's default is thinking off; the card's is on)."),
    HookSpec(
        target="sglang.srt.parser.reasoning_parser.ReasoningParser.__init__", kind="around",
        impl=f"{_API_IMPL}:reasoning_parser_init_hook",
        params=("self", "model_type", "stream_reasoning", "force_reasoning", "request", "tokenizer"),
        area="api",
        why="a tokenizer chat template detected as always-thinking would otherwise route a "
            "non-thinking reply into reasoning_content."),
    HookSpec(
        target="sglang.srt.entrypoints.http_server._setup_and_run_http_server", kind="around",
        impl=f"{_API_IMPL}:setup_http_server_hook",
        params=("server_args", "tokenizer_manager", "template_manager", "port_args",
                "scheduler_infos", "subprocess_watchdog", "execute_warmup_func",
                "launch_callback"),
        area="api",
        why="installs the middleware that validates reasoning fields before SGLang's pydantic "
            "model (integer top-level efforts, card-worded 400s)."),
    HookSpec(
        target="sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion."
               "_convert_to_internal_request",
        kind="around", impl=f"{_API_IMPL}:completion_convert_hook",
        params=("self", "request", "raw_request"), area="api",
        why="token-id prompts outside the vocabulary kill the scheduler (negative, >= vocab) or "
            "are read as image tokens (>= 1,000,000); logprobs > 20 and bad sampling parameters "
            "must be a 400 before a stream starts (api/request_guard.py)."),
    HookSpec(
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        kind="before", impl=f"{_API_IMPL}:validate_one_request_hook",
        params=("self", "obj", "input_ids"), area="api",
        why="every path into the scheduler (HTTP, Engine, batches): an id outside the "
            "vocabulary raises inside the scheduler loop and takes the whole server down."),
    HookSpec(
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog",
        kind="around", impl=f"{_API_IMPL}:sigterm_watchdog_hook",
        params=("self",), area="api",
        why="SGLang drains on SIGTERM without a bound and then SIGKILLs its own process tree "
            "(exit status -9 after a clean drain); api/shutdown.py bounds the drain and exits 0."),
    HookSpec(
        target="sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.allocate_vocab_mask",
        kind="around", impl="sglang_dsv41.api.cpu_grammar:allocate_vocab_mask_hook",
        params=("self", "vocab_size", "batch_size", "device"), area="api",
        why="SGLang pins the grammar bitmask (needs a CUDA driver): the first tool_choice "
            "required/named or response_format request kills a CPU server."),
    HookSpec(
        target="sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask",
        kind="around", impl="sglang_dsv41.api.cpu_grammar:apply_vocab_mask_hook",
        params=("self", "logits", "vocab_mask"), area="api",
        why="SGLang applies the grammar bitmask only to GPU logits (RuntimeError on CPU, which "
            "kills a CPU server); xgrammar's CPU kernel does it."),
    HookSpec(
        target="sglang.srt.server_args.ServerArgs._handle_cuda_graph_config",
        kind="before", impl="sglang_dsv41.overrides:resolve_server_args_hook",
        params=("self",), area="runtime",
        why="a plain `python -m sglang.launch_server` of a V4.1 checkpoint must refuse at start-up what "
            "the runtime cannot serve, record what the user gave (SGLang fills backends before its model "
            "overrides run) and set the defaults outside SGLang's override whitelist (parsers, memory, "
            "CUDA-graph flags, needed before SGLang resolves its graph configuration)."),
    HookSpec(
        target="sglang.srt.server_args.ServerArgs.add_cli_args",
        kind="after", impl="sglang_dsv41.overrides:add_cli_args_hook",
        params=("parser",), area="runtime",
        why="registers the card's `--language-model-only` flag (SGLang 0.5.17 has none): it sets "
            "enable_multimodal=False, so the vision tower and its weights are skipped and image requests get a 400."),
    HookSpec(
        target="sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
        kind="around", impl="sglang_dsv41.runtime.sglang_pool:memory_pool_configurator_hook",
        params=("kvc",), area="runtime",
        why="SGLang sizes hybrid-SWA pools from per-layer K/V head dims; the V4.1 pool holds a 16-B-aligned "
            "latent row and index-key row per full token (Flash 720 + 176 = 896 B) plus L bf16 SWA rows per SWA token, which only our "
            "configurator budgets (and logs); it also refuses flags the pool cannot be built for."),
    HookSpec(
        target="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool",
        kind="around", impl="sglang_dsv41.runtime.sglang_pool:build_token_to_kv_pool_hook",
        params=("self", "sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"), area="runtime",
        why="builds our DeepseekV41KVPool (a SWAKVPool with FULL = global KV rows, SWA = per-layer SWA rows, "
            "plus the pair ring) instead of SGLang's MHA sub-pools, which would need a fake layer and "
            "zero-width V buffers to hold the V4.1 rows."),
    HookSpec(
        target="sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        kind="after", impl=f"{_RUNTIME_IMPL}:attach_engram_history_hook",
        params=("batch", "model_runner", "capture_hidden_mode", "return_hidden_states_before_norm"),
        area="runtime",
        why="an extend's Engram n-gram history (the ids before its chunk) comes from the request's own "
            "token ids; without it a prefix hit or re-prefill has no history and the forward refuses it."),
    HookSpec(
        target="sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend",
        kind="around", impl=f"{_RUNTIME_IMPL}:paged_alloc_extend_hook",
        params=("self", "prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc",
                "extend_num_tokens", "num_new_pages"),
        area="runtime",
        why="the runtime needs an even --page-size and SGLang's paged allocator runs a Triton kernel, "
            "which fails without a GPU: a CPU server would die on its first prefill."),
    HookSpec(
        target="sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode",
        kind="around", impl=f"{_RUNTIME_IMPL}:paged_alloc_decode_hook",
        params=("self", "seq_lens", "seq_lens_cpu", "last_loc"), area="runtime",
        why="as alloc_extend: the paged decode allocation is a Triton kernel; a CPU server would die "
            "on its first decode step."),
    HookSpec(
        target="sglang.srt.configs.model_config.ModelConfig._config_draft_model",
        kind="after", impl=f"{_DSPARK_IMPL}:config_draft_model_hook",
        params=("self",), area="runtime",
        why="SGLang renames only the V4 architecture to a DSpark draft class; without this the DSPARK draft "
            "worker of a V4.1 checkpoint would load the 40-layer target class as its draft (docs/dspark.md)."),
    HookSpec(
        target="sglang.srt.speculative.draft_worker_common._resolve_draft_attention_backend_fallback",
        kind="around", impl=f"{_DSPARK_IMPL}:draft_attention_backend_hook",
        params=("draft_server_args", "algo_label"), area="runtime",
        why="SGLang replaces a draft attention backend outside its list by flashinfer, which would build its "
            "metadata over the V4.1 draft pool; the V4.1 draft reads its pool through the runtime's own backend."),
    HookSpec(
        target="sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2."
               "_commit_target_mamba_states_after_verify",
        kind="after", impl=f"{_DSPARK_IMPL}:commit_after_verify_hook",
        params=("self", "batch", "seq_lens_pre_verify", "seq_lens_post_verify", "commit_lens"), area="runtime",
        why="the worker's only post-accept call into the target's state (a no-op unless the model is Mamba-like); "
            "the V4.1 target commits its Engram history there to anchor + accepted drafts (docs/dspark.md)."),
)

HOOKS += (
    # ---- PD disaggregation of the V4.1 pool (docs/pd.md, runtime/pd_state.py, runtime/pd_layout.py) ----
    HookSpec(
        target=f"{_DISAGG}.utils.setup_state_kv_args", kind="after",
        impl=f"{_PD_LAYOUT}:setup_state_kv_args_hook",
        params=("kv_args", "token_to_kv_pool", "draft_token_to_kv_pool", "total_kv_layers", "req_to_token_pool"),
        area="runtime",
        why="SGLang registers whatever the pool lists: zero-size regions break Mooncake transfers and an odd "
            "buffer count loses its last buffer in the K/V halving (a DSpark draft pool's odd stage count is "
            "padded here); the layout fingerprint for the bootstrap "
            "handshake is taken here, and the pool selected for the pair-ring index rule."),
    HookSpec(
        target=f"{_DISAGG}.utils.get_dsv4_c128_state_indices", kind="around",
        impl=f"{_PD_STATE}:c128_state_indices_hook",
        params=("req_pool_idx", "seq_len", "online", "ring_size"), area="runtime",
        why="the pair ring travels as SGLang's request-scoped C128_STATE component; SGLang's index rule is "
            "V4's 128-token ring, the V4.1 pool needs the boundary row (N odd: the pending pair of N - 1) of "
            "each side's own ring (prefill.py and decode.py import the function by name: HookRegistry "
            "propagates the patch to them)."),
    HookSpec(
        target=f"{_DISAGG}.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin.prepare_for_prebuilt",
        kind="after", impl=f"{_PD_STATE}:prepare_for_prebuilt_hook", params=("self",), area="runtime",
        why="a transferred request's first decode step reads its pending-pair position and Engram history "
            "ring, which follow from the prompt ids and are not transferred; without them the CPU forward "
            "refuses the request as stale."),
    HookSpec(
        target=f"{_DISAGG}.common.conn.CommonKVBootstrapServer._setup_routes", kind="after",
        impl=f"{_PD_LAYOUT}:bootstrap_routes_hook", params=("self",), area="runtime",
        why="the prefill's bootstrap server serves its layout fingerprint (SGLang checks only page size and "
            "KV dtype between peers)."),
    HookSpec(
        target=f"{_DISAGG}.common.conn.CommonKVManager.register_to_bootstrap", kind="after",
        impl=f"{_PD_LAYOUT}:register_to_bootstrap_hook", params=("self",), area="runtime",
        why="the prefill publishes its layout fingerprint next to SGLang's parallel info."),
    HookSpec(
        target=f"{_DISAGG}.common.conn.CommonKVManager.try_ensure_parallel_info", kind="around",
        impl=f"{_PD_LAYOUT}:try_ensure_parallel_info_hook", params=("self", "bootstrap_addr"), area="runtime",
        why="a decode server must refuse a prefill with another layout (item sizes, ratios, page size, TP, "
            "DSpark context) instead of copying bytes into the wrong rows."),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.on_idle", kind="after",
        impl="sglang_dsv41.runtime.pd_cpu:on_idle_hook", params=("self",), area="runtime",
        why="a CPU PD server whose requests only wait on the peer spins its event loop at full speed (on_idle "
            "returns at once unless fully idle), taking a core from the peer's forward: concurrent PD requests "
            "serialised on CPU (docs/pd.md)."),
)

HOOKS += (
    # ---- HiCache of the V4.1 pool (docs/hicache.md, runtime/hicache_swa_bound.py) ----
    HookSpec(
        target="sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.load_back", kind="around",
        impl="sglang_dsv41.runtime.hicache_swa_bound:load_back_hook", params=("self", "node_id", "mem_quota", "req"),
        area="runtime",
        why="SGLang restores the whole host SWA chunk of each host-only ancestor until the window is covered "
            "(SGLang#31771): a chunk longer than the window would take that many slots of the small SWA device "
            "pool; the hook splits it first so a load-back restores at most the window, page-rounded."),
    HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.on_idle", kind="after",
        impl="sglang_dsv41.runtime.hicache_idle:on_idle_hook", params=("self",), area="runtime",
        why="a request waiting for its storage prefetch, or pages on their way to storage, keep the event loop "
            "spinning (on_idle returns at once unless fully idle, and idle sleeps only with --sleep-on-idle); the "
            "loop then takes the GIL from the storage threads at every file and torch call: an L3 hit's page "
            "reads cost ~40x their cost alone, a page file's write ~80x (docs/hicache.md)."),
)

_installed: set[tuple[str, str]] = set()


def _hook_type(kind: str):
    from sglang.srt.plugins.hook_registry import HookType

    return HookType(kind)


def specs_for(areas: Iterable[str] | None = None) -> list[HookSpec]:
    wanted = None if areas is None else set(areas)
    return [s for s in HOOKS if wanted is None or s.area in wanted]


def resolve_target(target: str) -> Callable:
    """The current object at ``target`` (imports its module)."""
    return pkgutil.resolve_name(target)


def _wrapping_hooks(fn: Callable) -> list[Callable]:
    """Hook callables found in the closures of a HookRegistry wrapper chain."""
    found = []
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:
                continue
        fn = getattr(fn, "__wrapped__", None)
    return found


def is_applied(spec: HookSpec) -> bool:
    """True when the object at ``spec.target`` is a HookRegistry wrapper around ``spec.impl``."""
    try:
        current = resolve_target(spec.target)
    except (ImportError, AttributeError, ValueError):
        return False  # the target moved or vanished
    return spec.implementation() in _wrapping_hooks(current)


def install_hooks(areas: Iterable[str] | None = None) -> list[HookSpec]:
    """Register, apply and verify the hooks of ``areas`` (all if None). Idempotent.

    Raises RuntimeError naming every hook that is not in place after applying.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    specs = specs_for(areas)
    for spec in specs:
        key = (spec.target, spec.impl)
        if key not in _installed:
            HookRegistry.register(spec.target, spec.implementation(), _hook_type(spec.kind))
            _installed.add(key)
    HookRegistry.apply_hooks()
    missing = [s.target for s in specs if not is_applied(s)]
    if missing:
        raise RuntimeError(f"sglang-dsv41: SGLang hooks not applied (see the HookRegistry log): "
                           f"{missing}")
    return specs
