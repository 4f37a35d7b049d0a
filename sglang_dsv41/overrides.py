"""DeepSeek-V4.1's SGLang server-argument defaults and start-up refusals, inside SGLang itself.

A plain ``python -m sglang.launch_server --model-path <V4.1 checkpoint>`` resolves what the torch
path needs (`runtime/requirements.CURRENT_RUNTIME`, the one declaration the wrappers, `doctor`
and the planner also read): page size 2, the attention backend (``torch_native`` on CPU,
``dsv41`` on CUDA), ``--swa-full-tokens-ratio 0.1``, the V4.1 reasoning and tool-call parsers,
and the device's memory / graph / sampling settings; with a HiCache storage backend the page size
is ``STORAGE_PAGE_SIZE`` (64) instead. docs/runtime.md "Server defaults and
start-up refusals" lists them.

How, in SGLang 0.5.17's resolution (`ServerArgs.__post_init__`), in the main process (the plugin
is loaded before the arguments are parsed; scheduler processes receive the resolved object):

1. `resolve_server_args_hook` — BEFORE `ServerArgs._handle_cuda_graph_config` (HookRegistry entry
   in `sglang_dsv41.hooks`), i.e. after the device and model path are resolved and before SGLang
   fills any backend, memory or CUDA-graph value. For a V4.1 checkpoint it records the values the
   user gave (`given_values`: a field differing from its `ServerArgs` default), refuses what the
   runtime cannot serve (`refusals`; `ValueError` naming each flag), and sets the declared defaults
   whose fields SGLang's override registry does not accept (not ``resolvable``: the parsers,
   ``max_total_tokens``, ``sleep_on_idle``, the CUDA-graph flags — the latter must be in place
   before SGLang resolves its graph configuration, which the registry's declarations reach too
   late).
2. `deepseek_v41_overrides` — the provider registered with SGLang's own registry
   (`register_model_override("DeepseekV41ForCausalLM")`): declares the defaults of the resolvable
   fields (page size, attention backend, SWA ratio, sampling backend), which SGLang's later
   passes read through its declaration overlay.

On CUDA the KV pool is capped at `CUDA_TOKENS_PER_CONTEXT` × the context length tokens (an upper
bound only: SGLang takes the smaller of it and what memory allows). SGLang 0.5.17 sizes its eager
runner's token buffers by the pool's token count, and a small checkpoint's tiny rows would give
hundreds of millions of tokens: the tiny checkpoint's plain launch ran out of memory there.

Invariants: a value the user gave is never replaced (it is refused when the runtime cannot serve
it); nothing happens for any other architecture; a provider without the hook's record raises
instead of guessing what the user gave. A field given with exactly its SGLang default (e.g.
``--swa-full-tokens-ratio 0.8``) cannot be told apart from an absent flag — SGLang keeps no
record of the command line — and gets the declared default.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from .runtime.hf_config import ARCHITECTURE
from .runtime.requirements import (CUDA_TOKENS_PER_CONTEXT, CURRENT_RUNTIME, DEVICES, PAGE_SIZE, PREFILL_GRAPH_BACKEND,
                                   PREFILL_GRAPH_FIELDS, RuntimeProfile)

logger = logging.getLogger(__name__)

#: `ServerArgs` attribute holding the user's values of the fields in `WATCHED_FIELDS` (set by the hook).
GIVEN_ATTR = "_dsv41_given"
#: Fields the refusals read, besides the declared defaults' own fields.
CHECKED_FIELDS = ("page_size", "kv_cache_dtype", "tp_size", "enable_dp_attention", "attention_backend",
                  "prefill_attention_backend", "decode_attention_backend", "disable_hybrid_swa_memory",
                  "speculative_algorithm", "disable_prefill_cuda_graph")
WATCHED_FIELDS = tuple(dict.fromkeys((*(f.dest for f in CURRENT_RUNTIME.flags), *CHECKED_FIELDS)))
_BACKEND_FLAGS = {"attention_backend": "--attention-backend",
                  "prefill_attention_backend": "--prefill-attention-backend",
                  "decode_attention_backend": "--decode-attention-backend"}


class ServerArgsRefused(ValueError):
    """Server arguments the V4.1 runtime cannot serve; the message names every flag to change."""


def is_v41(server_args: Any) -> bool:
    """Whether `server_args` serves a DeepSeek-V4.1 checkpoint (architecture of its HF config)."""
    from sglang.srt.server_args import ConnectorType, parse_connector_type

    if parse_connector_type(server_args.model_path) == ConnectorType.INSTANCE:
        return False
    archs = getattr(server_args.get_model_config().hf_config, "architectures", None) or []
    return bool(archs) and archs[0] == ARCHITECTURE


def given_values(server_args: Any, names: tuple[str, ...] = WATCHED_FIELDS) -> dict[str, Any]:
    """`{field: value}` of the `names` whose value differs from the `ServerArgs` class default."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(server_args))}
    return {n: getattr(server_args, n) for n in names
            if defaults.get(n, dataclasses.MISSING) is dataclasses.MISSING or getattr(server_args, n) != defaults[n]}


def runtime_device(server_args: Any) -> str:
    device = str(server_args.device).split(":")[0]
    if device not in DEVICES:
        raise ServerArgsRefused(f"sglang-dsv41: --device {device}: the DeepSeek-V4.1 torch path runs on "
                                f"{' or '.join(DEVICES)} only")
    return device


def refusals(given: dict[str, Any], text_config: Any, device: str,
             profile: RuntimeProfile = CURRENT_RUNTIME) -> list[str]:
    """One message per user value the runtime cannot serve, each naming its flag (empty: all fine)."""
    from .runtime.kv_rows import required_page_multiple
    from .runtime.tensor_parallel import ShardPlan, TensorParallelError

    out: list[str] = []
    page = given.get("page_size")
    multiple = required_page_multiple(text_config)
    if page is not None and (page < 1 or page % multiple):
        out.append(f"--page-size {page}: {profile.reasons['page_size']} (this checkpoint: {multiple}); "
                   f"use --page-size {PAGE_SIZE} or another multiple of {multiple}")
    dtype = given.get("kv_cache_dtype")
    if dtype is not None and dtype not in profile.kv_cache_dtypes:
        out.append(f"--kv-cache-dtype {dtype}: {profile.reasons['kv_cache_dtype']}; use one of "
                   f"{', '.join(profile.kv_cache_dtypes)}")
    tp = given.get("tp_size")
    if tp is not None:
        if not profile.supports_tp(tp):
            out.append(f"--tp-size {tp}: {profile.tp_reason()}")
        else:
            try:
                ShardPlan.for_config(text_config, 0, tp)
            except TensorParallelError as e:
                out.append(f"--tp-size {tp}: {e}")
    if given.get("enable_dp_attention") and not profile.dp_attention:
        out.append(f"--enable-dp-attention: {profile.reasons['dp_attention']}")
    default_backend = profile.defaults(device).get("attention_backend")
    for name, flag in _BACKEND_FLAGS.items():
        backend = given.get(name)
        if backend is not None and backend not in profile.attention_backends:
            out.append(f"{flag} {backend}: {profile.reasons['attention_backend']}; leave it unset (default "
                       f"{default_backend} on {device}) or use one of {', '.join(profile.attention_backends)}")
    if given.get("disable_hybrid_swa_memory"):
        out.append(f"--disable-hybrid-swa-memory: {profile.reasons['hybrid_swa']}")
    out += speculative_refusals(given.get("speculative_algorithm"), text_config, device)
    out += prefill_graph_refusals(given, profile)
    return out


def prefill_graph_refusals(given: dict[str, Any], profile: RuntimeProfile = CURRENT_RUNTIME) -> list[str]:
    """`--cuda-graph-backend-prefill`: `full` (at TP 1, without DSpark) or `disabled` only."""
    backend = given.get("cuda_graph_backend_prefill")
    flag = f"--cuda-graph-backend-prefill {backend}"
    if backend in (None, PREFILL_GRAPH_BACKEND, "disabled"):
        if backend == PREFILL_GRAPH_BACKEND and (given.get("tp_size") or 1) > 1:
            return [f"{flag} at --tp-size {given['tp_size']}: {profile.reasons['cuda_graphs']}"]
        if backend == PREFILL_GRAPH_BACKEND and given.get("speculative_algorithm") is not None:
            return [f"{flag} with --speculative-algorithm: the DSpark target's captured hidden states are not "
                    "sliced out of a prefill graph yet; drop one of them"]
        return []
    return [f"{flag}: {profile.reasons['prefill_graph_backend']}; use {PREFILL_GRAPH_BACKEND} or disabled"]


def prefill_graph_defaults(server_args: Any, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The declared defaults with the prefill-graph ones (`PREFILL_GRAPH_FIELDS`) settled: none when the
    user turned prefill graphs off; buckets and flags but the user's backend when they chose `full`;
    `disabled` (logged) for PD and DSpark, whose prefill stays eager."""
    if PREFILL_GRAPH_FIELDS[0] not in defaults:
        return defaults                                             # CPU, or TP > 1
    rest = {k: v for k, v in defaults.items() if k not in PREFILL_GRAPH_FIELDS}
    backend = given.get("cuda_graph_backend_prefill")
    if backend == "disabled" or given.get("disable_prefill_cuda_graph") or given.get("disable_cuda_graph"):
        return rest
    if backend is not None:
        return defaults
    eager_because = [why for why, on in (
        (f"--disaggregation-mode {server_args.disaggregation_mode}", server_args.disaggregation_mode != "null"),
        ("--speculative-algorithm", server_args.speculative_algorithm is not None)) if on]
    if eager_because:
        logger.info("sglang-dsv41: prefill runs eagerly (no prefill CUDA graphs) with %s", ", ".join(eager_because))
        return {**rest, PREFILL_GRAPH_FIELDS[0]: "disabled"}
    return defaults


#: Why SGLang 0.5.17's DSpark worker cannot run on a CPU server (docs/dspark.md "CPU").
DSPARK_CPU_REASON = ("SGLang 0.5.17's DSpark worker is CUDA-only: its argument handler refuses any non-CUDA "
                     "device (speculative_hook._handle_dspark), its accept and cache-location steps are Triton "
                     "kernels (accept_greedy_triton, assign_extend_cache_locs_func) and it records tensors on "
                     "CUDA streams (Tensor.record_stream); serve without --speculative-algorithm on CPU")


def speculative_refusals(algorithm: Any, text_config: Any, device: str) -> list[str]:
    """DSpark is V4.1's only speculative method, on CUDA only, for a checkpoint with DSpark stages."""
    if algorithm is None:
        return []
    name = str(getattr(algorithm, "name", algorithm)).upper()
    flag = f"--speculative-algorithm {name}"
    if name != "DSPARK":
        return [f"{flag}: DeepSeek-V4.1's only speculative method is its bundled DSpark draft "
                "(--speculative-algorithm DSPARK)"]
    if text_config.num_nextn_predict_layers < 1:
        return [f"{flag}: this checkpoint has no DSpark stages (num_nextn_predict_layers = 0)"]
    if device != "cuda":
        return [f"{flag} on {device}: {DSPARK_CPU_REASON}"]
    return []


def _resolvable() -> frozenset[str]:
    from sglang.srt.arg_groups.arg_utils import resolvable_fields
    from sglang.srt.server_args import ServerArgs

    return resolvable_fields(ServerArgs)


def _tp_size(server_args: Any) -> int:
    return int(server_args.tp_size or 1)


def hicache_storage(server_args: Any) -> bool:
    """Whether `server_args` configure a HiCache storage (L3) backend (the page size's default
    depends on it: `requirements.STORAGE_PAGE_SIZE`)."""
    return bool(getattr(server_args, "enable_hierarchical_cache", False)
                and getattr(server_args, "hicache_storage_backend", None))


def runtime_defaults(server_args: Any) -> dict[str, Any]:
    """The declared defaults for `server_args`' device, TP size and HiCache storage setting."""
    return CURRENT_RUNTIME.defaults(runtime_device(server_args), _tp_size(server_args), hicache_storage(server_args))


def resolve_server_args_hook(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `ServerArgs._handle_cuda_graph_config`: record, refuse, set the non-resolvable
    defaults (module doc, step 1). Other architectures: nothing."""
    if not is_v41(server_args):
        return None
    given = given_values(server_args)
    object.__setattr__(server_args, GIVEN_ATTR, given)
    device = runtime_device(server_args)
    parsed = server_args.get_model_config().hf_config.parsed()
    problems = refusals(given, parsed.text, device) + vision_refusals(server_args, parsed.has_vision)
    if problems:
        raise ServerArgsRefused("sglang-dsv41: DeepSeek-V4.1 cannot be served with these server arguments:\n  "
                                + "\n  ".join(problems))
    from .runtime.hicache_stack import resolve_storage_backend

    resolve_storage_backend(server_args)              # --hicache-storage-backend mooncake: ours (docs/hicache.md)
    if not parsed.has_vision or server_args.enable_multimodal is False:
        # text only: no multimodal processor, so image requests are refused (api/request_guard.py)
        server_args.enable_multimodal = False
        server_args.get_model_config().is_multimodal = False
    resolvable = _resolvable()
    applied = {}
    for name, value in prefill_graph_defaults(server_args, given, runtime_defaults(server_args)).items():
        if name not in resolvable and name not in given:
            setattr(server_args, name, value)
            applied[name] = value
    if device == "cuda" and "max_total_tokens" not in given:
        cap = CUDA_TOKENS_PER_CONTEXT * int(server_args.get_model_config().context_len)
        server_args.max_total_tokens = applied["max_total_tokens"] = cap
    if applied:
        logger.info("sglang-dsv41: DeepSeek-V4.1 defaults on %s: %s", device, applied)
    return None


def add_cli_args_hook(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `ServerArgs.add_cli_args`: `--language-model-only` (the card's text-only mode) stores
    ``enable_multimodal = False`` — an existing field, so every process receives it (docs/vision.md)."""
    if any("--language-model-only" in a.option_strings for a in parser._actions):
        return None
    parser.add_argument("--language-model-only", dest="enable_multimodal", action="store_const", const=False,
                        help="sglang-dsv41: serve DeepSeek-V4.1 as a text model: the vision tower and its "
                             "weights are not loaded, and image requests are refused with 400.")
    return None


def vision_refusals(server_args: Any, has_vision: bool) -> list[str]:
    """Start-up refusals of the vision modes and of `--limit-mm-data-per-request` (docs/vision.md)."""
    if server_args.enable_multimodal is False and getattr(server_args, "mm_enable_dp_encoder", False):
        return ["--language-model-only and --mm-enable-dp-encoder are mutually exclusive: text-only mode "
                "has no vision encoder to run data-parallel; drop one of them"]
    if server_args.enable_multimodal and not has_vision:
        return ["--enable-multimodal: this checkpoint has no vision_config (no vision tower)"]
    return _image_limit_refusals(getattr(server_args, "limit_mm_data_per_request", None),
                                 has_vision and server_args.enable_multimodal is not False)


def _image_limit_refusals(limit: Any, serves_images: bool) -> list[str]:
    """`--limit-mm-data-per-request` for V4.1: '{"image": N}', N ≥ 1, on a server that takes images."""
    if not limit:
        return []
    flag = "--limit-mm-data-per-request"
    if isinstance(limit, str):
        try:
            limit = json.loads(limit)
        except ValueError:
            return [f"{flag} {limit!r} is not JSON; write '{{\"image\": N}}'"]
    if not isinstance(limit, dict):
        return [f"{flag} must be a JSON object such as '{{\"image\": N}}', got {limit!r}"]
    if not serves_images:
        return [f"{flag} on a text-only server (--language-model-only, or a checkpoint without vision_config): "
                "every image is refused already; drop the limit"]
    other = sorted(set(limit) - {"image"})
    if other:
        return [f"{flag}: DeepSeek-V4.1 takes images only, not {', '.join(other)}; write '{{\"image\": N}}'"]
    n = limit.get("image")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return [f"{flag}: the image limit must be an integer ≥ 1, got {n!r} (no images at all: use "
                "--language-model-only)"]
    return []


def deepseek_v41_overrides(server_args: Any, hf_config: Any) -> dict:
    """SGLang override provider for `DeepseekV41ForCausalLM`: the declared defaults of the
    resolvable fields the user did not give (module doc, step 2). Reads, never writes."""
    given = getattr(server_args, GIVEN_ATTR, None)
    if given is None:
        raise RuntimeError("sglang-dsv41: the server-args hook (sglang_dsv41.hooks, "
                           "ServerArgs._handle_cuda_graph_config) did not run, so the values the user gave "
                           "are unknown; is the plugin's runtime area installed?")
    resolvable = _resolvable()
    declared = {name: value
                for name, value in runtime_defaults(server_args).items()
                if name in resolvable and name not in given}
    if declared:
        logger.info("sglang-dsv41: DeepSeek-V4.1 declared defaults: %s", declared)
    return declared


_registered = False


def register() -> None:
    """Register `deepseek_v41_overrides` with SGLang's model-override registry (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.overrides import register_model_override

    register_model_override(ARCHITECTURE)(deepseek_v41_overrides)
    _registered = True
