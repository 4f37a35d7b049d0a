"""What the sglang-dsv41 plugin provides to the launcher, and how each card option maps to it.

The card (seed 004) and the launch blog promise options that stock SGLang 0.5.17 does not
have: the model class itself, the V4.1 reasoning and tool-call parsers, Engram host placement,
text-only serving, encoder data-parallel, SWA bounded replay, the FP4 (`v41`) KV layout, V4.1
DSpark. Each is a *capability* the plugin must provide; the launcher maps a capability to the
flag or environment variable the plugin reads, and emits it only when the plugin says it
provides it.

Contract with the plugin: the module `sglang_dsv41.plugin` (the `sglang.srt.plugins` entry
point's module) exposes `LAUNCH_CAPABILITIES`, an iterable of the names in `CAPABILITIES`.
"model" additionally needs that entry point to be installed, since SGLang loads the plugin
through it (spec `runtime.md` §B). A capability the plugin does not list is *unavailable*:
the launcher prints it, never drops it silently (`launch.py` decides what to do).

What the *runtime* can serve (TP sizes, vision, CUDA graphs, …) is a separate declaration,
`sglang_dsv41.runtime.requirements.CURRENT_RUNTIME`; `command.runtime_limits` checks a config
against it.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
from dataclasses import dataclass

PLUGIN_MODULE = "sglang_dsv41.plugin"
PLUGIN_GROUP = "sglang.srt.plugins"
DIST_NAME = "sglang-dsv41"
#: The names `sglang_dsv41.api.register` registers the V4.1 parsers under (first spelling of
#: `api.reasoning_parser.PARSER_NAMES` / `api.tool_parser.PARSER_NAMES`; a test pins the match —
#: they are repeated here so a dry run does not import SGLang).
REASONING_PARSER = "deepseek-v41"
TOOL_CALL_PARSER = "deepseek-v41"


@dataclass(frozen=True)
class Capability:
    name: str
    what: str  # the card/blog option, in the user's words
    args: tuple[str, ...] = ()  # SGLang CLI arguments emitted when available
    env: tuple[tuple[str, str], ...] = ()  # environment emitted when available
    why_not_stock: str = ""  # why stock 0.5.17 alone cannot do it


CAPABILITIES: dict[str, Capability] = {c.name: c for c in (
    Capability("model", "DeepSeek-V4.1 model, config and chat encoding in SGLang 0.5.17",
               why_not_stock="0.5.17 knows DeepSeek-V4 only; model_type deepseek_v41 needs the plugin's config, "
                             "model class and chat-encoding hooks, loaded through its sglang.srt.plugins entry point"),
    Capability("engram_host_table", "Engram tables in pinned host memory, layout per_rank "
                                    "(card: --engram-config cpu_offload)",
               env=(("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1"),),
               why_not_stock="0.5.17 has no Engram at all; 0.5.23 switches the host table with "
                             "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE (runtime.md §A.7)"),
    Capability("text_only", "text-only serving, no vision tower (card: --language-model-only)",
               args=("--language-model-only",),
               why_not_stock="0.5.17 has no --language-model-only (the plugin adds it to SGLang's parser); its "
                             "--language-only is encoder/prefill/decode disaggregation (needs encoder servers, refused "
                             "for this architecture)"),
    Capability("encoder_data_parallel", "vision encoder data-parallel (card: --mm-encoder-tp-mode data)",
               args=("--mm-enable-dp-encoder",),
               why_not_stock="0.5.17 has --mm-enable-dp-encoder, but only the plugin's ViT can honour it "
                             "(the V4.1 ViT is replicated per rank and splits a batch's images over the TP ranks: "
                             "runtime/vision_batch.py; runtime.md §A.10)"),
    Capability("bounded_replay_encoder", "encoder SWA bounded replay (blog: experimental)",
               env=(("SGLANG_DSV41_ENCODER_SWA_BOUNDED_REPLAY", "1"),),
               why_not_stock="0.5.23's --enable-encoder-swa-bounded-replay does not exist in 0.5.17"),
    Capability("bounded_replay_decoder", "decoder SWA bounded replay (blog: experimental)",
               env=(("SGLANG_DSV41_DECODER_SWA_BOUNDED_REPLAY", "1"),),
               why_not_stock="0.5.23's --enable-decoder-swa-bounded-replay does not exist in 0.5.17"),
    Capability("kv_layout_v41", "FP4 compressed KV layout (v41 / v41_fp4, 890 B/token)",
               env=(("SGLANG_DSV4_KV_LAYOUT", "v41"),),
               why_not_stock="0.5.17 has only the v4 layout; v41 needs the plugin's pools and FlashMLA/AITER "
                             "kernels newer than 0.5.17's pins (runtime.md §A.3, risk R1)"),
    Capability("reasoning_parser", "V4.1 reasoning split (reasoning_content; grammars applied after the trace)",
               args=("--reasoning-parser", REASONING_PARSER),
               why_not_stock="0.5.17's deepseek-v4 detector is V4's; the plugin registers its own V4.1 detector "
                             "(a DSML call opened inside the trace ends it, thinking-off replies stay content) and "
                             "refuses V4/V3 parsers for V4.1 at start-up (docs/api.md)"),
    Capability("tool_parser", "V4.1 tool calls (DSML with space-prefixed tags)",
               args=("--tool-call-parser", TOOL_CALL_PARSER),
               why_not_stock="0.5.17's deepseekv4 parser expects '<｜DSML｜tool_calls>'; V4.1 writes "
                             "'<｜DSML｜ calls>' (runtime.md §A.10)"),
    Capability("dspark", "DSpark speculative decoding for V4.1",
               why_not_stock="0.5.17's DSPARK worker drives V4 drafts; V4.1 needs the plugin's draft class, draft "
                             "pool, verify forward and Engram-history commit (runtime.md §A.8; docs/dspark.md)"),
)}


def plugin_entry_points() -> list[md.EntryPoint]:
    """`sglang.srt.plugins` entry points installed by the sglang-dsv41 distribution."""
    return [ep for ep in md.entry_points(group=PLUGIN_GROUP)
            if ep.dist is not None and ep.dist.name.replace("_", "-").lower() == DIST_NAME]


def available_capabilities() -> frozenset[str]:
    """Names the installed plugin declares (empty when the plugin module does not exist yet)."""
    try:
        mod = importlib.import_module(PLUGIN_MODULE)
    except ModuleNotFoundError as e:
        if e.name != PLUGIN_MODULE:
            raise  # the plugin exists but one of its imports is missing: that is a real error
        return frozenset()
    declared = frozenset(getattr(mod, "LAUNCH_CAPABILITIES", ()))
    unknown = declared - CAPABILITIES.keys()
    if unknown:
        raise RuntimeError(f"{PLUGIN_MODULE}.LAUNCH_CAPABILITIES names unknown capabilities {sorted(unknown)}; "
                           f"known: {sorted(CAPABILITIES)}")
    if "model" in declared and not plugin_entry_points():
        declared -= {"model"}  # declared but not installed: SGLang would never load it
    return declared
