"""SGLang plugin entry point: `[project.entry-points."sglang.srt.plugins"] dsv41 = "sglang_dsv41.plugin:register"`.

SGLang 0.5.17 runs `register()` in the main process before argument parsing and again in every
scheduler process (runtime.md §B "The general-purpose hook"; cpu.md §4). It registers:

1. the V4.1 config class for `model_type = "deepseek_v41"` in transformers' `AutoConfig` and in
   SGLang's `_CONFIG_REGISTRY` (`runtime/hf_config.py`);
2. our model class under the architecture `DeepseekV41ForCausalLM` in SGLang's `ModelRegistry`
   (`runtime/model.py`), and its DSpark draft under `DeepseekV41ForCausalLMDSpark`
   (`runtime/dspark_model.py`);
3. the runtime's HookRegistry entries (area "runtime" of `sglang_dsv41.hooks`), installed and
   verified: SGLang sizes and builds our KV pool (`create_memory_pool_configurator`,
   `KVCacheConfigurator._build_token_to_kv_pool`; `runtime/kv_pool.py`), and the paged
   allocator's `alloc_extend` / `alloc_decode` run in torch on CPU servers (SGLang's are Triton
   kernels);
4. our HiCache stack strategy, first in SGLang's hybrid-pool assembler (`runtime/hicache_stack.py`;
   docs/hicache.md), so `--enable-hierarchical-cache` mirrors the V4.1 pool in host pools of ours;
5. the attention backend `dsv41` (`runtime/graph_backend.py`: torch_native plus the decode
   CUDA-graph hooks) in SGLang's `--attention-backend` choices and backend registry;
6. the chat API (`sglang_dsv41.api.register.register_api()`: parsers and chat hooks), when that
   module is installed;
7. the model's server-argument defaults in SGLang's override registry and its start-up refusals
   (`sglang_dsv41/overrides.py`; its hook is one of the runtime area's), so a plain
   `python -m sglang.launch_server --model-path <V4.1>` needs no extra flag.
8. image input (`runtime/mm_processor.py`, docs/vision.md): our architecture as multimodal, our
   image processor and the tokenizer as its "processor", in SGLang's own registries; the
   `--language-model-only` flag is added to SGLang's parser by a runtime-area hook
   (`overrides.add_cli_args_hook`).

Architecture name — we keep `DeepseekV41ForCausalLM` (upstream 0.5.23 rewrites it to
`DeepseekV4ForCausalLM`). Reason: in 0.5.17 every path keyed on the V4 architecture name is
written for V4's layout and kernels — `is_deepseek_v4()` selects the DSV4 pool configurator and
`DeepSeekV4TokenToKVPool` (ratios 4/128 only), the `dsv4` attention backend (FlashMLA, CUDA),
page size 256, an fp8 KV dtype, V4 server-arg defaults, the V4 chat encoder and the DSpark/NextN
draft renames. Our torch-path model computes its own attention over its own row layout in SGLang's
pool (packed FP4 rows + BF16 SWA rows, `runtime/kv_pool.py`, docs/runtime.md), so none of these may engage;
a distinct architecture gets SGLang's generic decoder paths only, and the SGLang-facing config
(`DeepseekV41HFConfig`) hides the attributes that would trigger attribute-keyed special cases
(DSA/MLA, MTP, multimodal, FP8). `tests/test_runtime_plugin.py` pins this: a V4.1 checkpoint
resolves to our class, no V4 predicate is true for it, and stock SGLang without the plugin
refuses the checkpoint.

What `sglang-dsv41 launch` may ask of this plugin is `LAUNCH_CAPABILITIES` (names defined in
`deploy/capabilities.py`); what the runtime behind the model class can serve (TP 1/2/4/8, no DP
attention, text only, decode CUDA graphs at TP 1, the server defaults it declares) is
`runtime/requirements.CURRENT_RUNTIME`.

No silent fallback: SGLang's loader catches `Exception` from a plugin and carries on, which
would leave a V4.1 checkpoint unserved with a misleading error — so every failure here (wrong
SGLang version, import error, registration error) is raised as `PluginLoadError`, a
`SystemExit`, which SGLang does not catch: the process stops with our message.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging

logger = logging.getLogger(__name__)

#: The only SGLang release this plugin is written against (hooks pin its internals).
SUPPORTED_SGLANG_VERSION = "0.5.17"
API_REGISTER_MODULE = "sglang_dsv41.api.register"

#: What this plugin provides to `sglang-dsv41 launch` (capability names of `deploy/capabilities.py`):
#: * ``model`` — config + model class (`register_config`, `register_model`) and the V4.1 chat
#:   encoding (`api.register.register_api`: deepseek-recipe prompts, effort, start-up checks);
#: * ``reasoning_parser`` / ``tool_parser`` — the V4.1 detectors `register_api` registers as
#:   ``deepseek-v41`` / ``deepseek_v41`` (docs/api.md);
#: * ``engram_host_table`` — the Engram tables in pinned host memory, read by the GPU through UVA,
#:   switched on by ``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1`` (upstream 0.5.23's spelling) in the
#:   **per_rank** layout only (``SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=per_rank``: each TP rank
#:   pins its own block of rows, the lookup keeps its masked lookup + all-reduce; spec runtime.md
#:   §A.7). The runtime refuses ``shared`` (one memfd mapping for the TP group), and so does the
#:   deployment schema.
#: * ``text_only`` — the card's ``--language-model-only``, a real CLI flag the plugin adds to SGLang's
#:   parser (`overrides.add_cli_args_hook`): no vision tower, image requests refused (docs/vision.md).
#: * ``encoder_data_parallel`` — SGLang's own ``--mm-enable-dp-encoder``: at TP > 1 the images of a
#:   batch are split over the ranks and all-gathered (`runtime/vision_batch.encode_images`); at TP 1
#:   it changes nothing (SGLang warns so).
#: * ``dspark`` — SGLang's own ``--speculative-algorithm DSPARK`` worker with the plugin's V4.1 draft
#:   class, draft pool, verify forward and Engram-history commit (docs/dspark.md); greedy output equal
#:   to plain greedy on the H200 with CUDA graphs (tiny checkpoint, sessions 9 and 10; docs/validation.md).
#: Not provided, so a launch that needs them is refused: the FP4 KV layout (``kv_layout_v41``) and
#: SWA bounded replay (``bounded_replay_encoder`` / ``_decoder``).
#: TP sizes other than 1/2/4/8, DP attention and CUDA graphs are limits of the runtime
#: (`runtime/requirements.py`), not capabilities.
LAUNCH_CAPABILITIES: tuple[str, ...] = ("model", "reasoning_parser", "tool_parser", "engram_host_table", "text_only",
                                        "encoder_data_parallel", "dspark")


class PluginLoadError(SystemExit):
    """The plugin cannot load. A `SystemExit` so SGLang's plugin loader cannot swallow it."""

    def __init__(self, message: str) -> None:
        super().__init__(f"sglang-dsv41: {message}")

    @property
    def message(self) -> str:
        return str(self.code)


def installed_sglang_version() -> str:
    """Version of the installed SGLang distribution (read from its metadata, no import)."""
    return importlib.metadata.version("sglang")


def check_sglang_version(found: str | None = None) -> None:
    """Raise `PluginLoadError` naming both versions unless SGLang is exactly 0.5.17."""
    found = installed_sglang_version() if found is None else found
    if found != SUPPORTED_SGLANG_VERSION:
        raise PluginLoadError(
            f"this plugin supports SGLang {SUPPORTED_SGLANG_VERSION} only, but SGLang {found} is "
            f"installed. Install sglang=={SUPPORTED_SGLANG_VERSION} (pip install "
            f"'sglang=={SUPPORTED_SGLANG_VERSION}') or a sglang-dsv41 release built for SGLang {found}.")


def register_config() -> None:
    """`deepseek_v41` → `DeepseekV41HFConfig` in transformers' AutoConfig and SGLang's registry."""
    from sglang.srt.utils.hf_transformers import common
    from transformers import AutoConfig

    from .runtime.hf_config import MODEL_TYPE, DeepseekV41HFConfig

    common._CONFIG_REGISTRY[MODEL_TYPE] = DeepseekV41HFConfig
    try:
        AutoConfig.register(MODEL_TYPE, DeepseekV41HFConfig)
    except ValueError as e:  # a second register() in the same process
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        # the lazy mapping's inherited `.get` reads only transformers' built-in table
        present = CONFIG_MAPPING[MODEL_TYPE] if MODEL_TYPE in CONFIG_MAPPING else None
        if present is not DeepseekV41HFConfig:
            raise PluginLoadError(f"model_type {MODEL_TYPE!r} is already registered by another "
                                  f"package ({present}): {e}") from e


def register_model() -> None:
    """Our model classes in SGLang's ModelRegistry: `DeepseekV41ForCausalLM` and its DSpark draft
    `DeepseekV41ForCausalLMDSpark` (chosen by the `_config_draft_model` hook, docs/dspark.md)."""
    from sglang.srt.models.registry import ModelRegistry

    from .runtime.hf_config import ARCHITECTURE
    from .runtime.model import DeepseekV41ForCausalLM

    from .runtime.dspark_model import DRAFT_ARCHITECTURE, DeepseekV41ForCausalLMDSpark

    for arch, cls in ((ARCHITECTURE, DeepseekV41ForCausalLM), (DRAFT_ARCHITECTURE, DeepseekV41ForCausalLMDSpark)):
        present = ModelRegistry.models.get(arch)
        if present is not None and present is not cls:
            raise PluginLoadError(f"architecture {arch} is already registered by {present!r}")
        ModelRegistry.models[arch] = cls


def register_runtime_hooks() -> None:
    """Install and verify the runtime area's hooks (`sglang_dsv41.hooks.HOOKS`)."""
    from . import hooks

    hooks.install_hooks(("runtime",))


def register_hicache_strategy() -> None:
    """Our HiCache host stack first in SGLang's hybrid-pool assembler (`runtime/hicache_stack.py`)."""
    from .runtime import hicache_stack

    hicache_stack.register()


def register_api_if_present() -> bool:
    """Call `sglang_dsv41.api.register.register_api()` if that module is installed."""
    if importlib.util.find_spec(API_REGISTER_MODULE) is None:
        logger.info("sglang-dsv41: %s not installed; chat API hooks not registered", API_REGISTER_MODULE)
        return False
    importlib.import_module(API_REGISTER_MODULE).register_api()
    return True


def register_graph_backend() -> None:
    """`--attention-backend dsv41` (torch_native + the decode CUDA-graph hooks,
    `runtime/graph_backend.py`) in SGLang's choices and registry of this process."""
    from .runtime import graph_backend

    graph_backend.register()


def register_server_defaults() -> None:
    """The V4.1 server-argument defaults in SGLang's model-override registry (`overrides.py`)."""
    from . import overrides

    overrides.register()


def register_vision() -> None:
    """Our image processor, tokenizer-as-processor and multimodal architecture in SGLang's
    registries (`runtime/mm_processor.py`)."""
    from .runtime import mm_processor

    mm_processor.register()


def register() -> None:
    """Entry point run by SGLang in every process; idempotent. Any failure stops the process."""
    check_sglang_version()
    try:
        register_config()
        register_model()
        register_runtime_hooks()
        register_hicache_strategy()
        register_graph_backend()
        register_server_defaults()
        register_vision()
        register_api_if_present()
    except PluginLoadError:
        raise
    except Exception as e:  # import or registration error: never let SGLang carry on without us
        logger.exception("sglang-dsv41 plugin failed to register")
        raise PluginLoadError(f"plugin registration failed: {type(e).__name__}: {e}") from e
    logger.info("sglang-dsv41: registered %s (SGLang %s)", "DeepseekV41ForCausalLM", SUPPORTED_SGLANG_VERSION)
