"""Vision settings of a deployment config: what the schema refuses and what the planner counts.

The card (seed 004): a 32-layer ViT + 3× aligner in front of the text stack, at most 1024 tokens
per image, no limit on images per prompt; Text only (`--language-model-only`) skips the tower,
Encoder parallel runs it data-parallel, the two are mutually exclusive. SGLang 0.5.17 caps images
per request with `--limit-mm-data-per-request '{"image": N}'` (its tokenizer manager answers
"Image count M exceeds limit N per request."), emitted from `features.max_images_per_request`.

Invariants
----------
* Vision switches are set through `features`, never through `serving.extra_args`: the planner
  sizes weights and image tokens from `features`, so a raw flag would make plan and server
  disagree. A raw `--limit-mm-data-per-request` is refused with the field to use instead.
* `schema_problems` needs no checkpoint; `checkpoint_problems` needs its `vision_config`
  (the per-image token cap). Both return messages that name the fields (schema invariant).
* `image_span_tokens(vcfg)` is the prompt length of one image at the token cap, square grid:
  n·(n+1)+2 with n = ⌊√max_image_tokens⌋ (start + n rows of n patches and a newline + end;
  docs/vision.md). Wider or taller images at the cap have fewer or more rows; the planner's
  budget is this square figure, the refusal uses the shortest possible span (cap + 3).
* `vit_activation_bytes(vcfg, H, backend)` is the peak of live tensors while one call of
  `runtime/vision.VisionTower.encode_many` runs, for the attention backend the deployment selects
  (`runtime/vision_calls.auto_backend`: ``triton`` on a GPU, ``sdpa`` on CPU). A call packs images
  up to `vision_calls.call_patch_budget` patches and calls run one after another, so the peak is
  one full call's whatever the image count (default: N = k²·cap patches, one image at the cap).
  Derived stage by stage from the code (docs/vision.md "ViT activation memory");
  tests/test_vision_activation.py holds it to the live bytes counted on CPU, and
  `benchmarks/vision.py --vit` to `torch.cuda.max_memory_allocated` on the GPU.
* `vision_activation` adds what a prefill batch holds besides: the span cache's rows
  (`vision_batch.SpanCache`, up to 16 images' spans) and the batch's image rows (positions inside
  one prefill chunk, twice: the pieces and their concatenation), H fp32 values per row. With
  `features.encoder_data_parallel` at TP > 1 (`--mm-enable-dp-encoder`: each rank encodes its share
  of the batch's images, then one all-gather) also the gather: every rank's padded block and the
  gathered result, at most twice the batch's image rows.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..config import VisionConfig
from ..runtime.vision_calls import VARLEN_BACKENDS, auto_backend, call_patch_budget

if TYPE_CHECKING:
    from ..config import DeepseekV41Config
    from .schema import DeploymentConfig

LIMIT_FLAG = "--limit-mm-data-per-request"
#: raw server flags that switch vision modes; `features` sets them (module invariants)
FEATURE_FLAGS = {"--language-model-only": "features.text_only: true",
                 "--enable-multimodal": "features.text_only: false (the default)",
                 "--mm-enable-dp-encoder": "features.encoder_data_parallel: true",
                 LIMIT_FLAG: "features.max_images_per_request: N"}


def limit_args(max_images: int | None) -> list[str]:
    """SGLang's per-request image cap for `features.max_images_per_request` ([] when unset)."""
    return [] if max_images is None else [LIMIT_FLAG, f'{{"image": {max_images}}}']


def schema_problems(dc: "DeploymentConfig") -> list[str]:
    """Vision rules a config breaks without looking at the checkpoint."""
    f, out = dc.features, []
    if f.text_only and f.encoder_data_parallel:
        out.append("features.text_only and features.encoder_data_parallel are mutually exclusive: text-only skips "
                   "the vision encoder, so there is no encoder to run data-parallel (card: 'mutually exclusive "
                   "with Text only')")
    if f.text_only and f.max_images_per_request is not None:
        out.append(f"features.max_images_per_request {f.max_images_per_request} with features.text_only: a text-only "
                   "server refuses every image; drop one of them")
    extra = [*dc.serving.extra_args]
    if dc.pd is not None:
        extra += [*dc.pd.prefill.extra_args, *dc.pd.decode.extra_args]
    for flag, field in FEATURE_FLAGS.items():
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            out.append(f"{flag} in extra_args: set {field} instead (the planner sizes the vision tower and image "
                       "tokens from features, and the launcher emits the flag)")
    return out


def image_span_tokens(vcfg: VisionConfig) -> int:
    """Prompt tokens of one square image at the token cap (module invariants)."""
    n = math.isqrt(vcfg.max_image_tokens)
    return n * (n + 1) + 2


def serves_vision(dc: "DeploymentConfig", cfg: "DeepseekV41Config") -> bool:
    """Whether the deployment loads the tower: a checkpoint with a vision_config, not text-only."""
    return cfg.has_vision and not dc.features.text_only


def image_budget(dc: "DeploymentConfig", cfg: "DeepseekV41Config") -> dict[str, object] | None:
    """The image part of one request's prompt, for the plan (None when vision is not served):
    `images` is `features.max_images_per_request` (None: no cap, the card's default; the tokens
    are then those of one image), `tokens_per_image` the square span at the cap."""
    if not serves_vision(dc, cfg):
        return None
    assert cfg.vision is not None
    span = image_span_tokens(cfg.vision)
    n = dc.features.max_images_per_request
    return {"images": n, "tokens_per_image": span, "tokens": span * (n or 1),
            "max_image_tokens": cfg.vision.max_image_tokens}


#: images whose span rows `runtime/vision_batch.SpanCache` keeps (its default capacity)
SPAN_CACHE_IMAGES = 16


def vit_activation_bytes(vcfg: VisionConfig, text_hidden: int, backend: str, *, patches: int | None = None,
                         longest: int | None = None, tokens: int | None = None, span_tokens: int | None = None,
                         images: int | None = None) -> int:
    """Peak live bytes of one ViT call of `images` images (default: one per k²·cap patches) and
    `patches` patches (default: the call budget), its longest image `longest` patches (default:
    min(patches, k²·cap)), `tokens` aligner rows Σ n_h·n_w (default: patches / k²) and
    `span_tokens` output rows (default: the square cap span per image). Intermediates are fp32 (4 B) holding BF16 values; with a
    varlen backend (``triton``, ``fa3``) every linear also holds BF16 copies of its input, weight and
    output; with ``sdpa`` each image's attention holds its heads × L × L fp32 scores and softmax and
    the softmax's heads × L × L bool mask. Stage terms: docs/vision.md "ViT activation memory"."""
    if backend not in ("sdpa", *VARLEN_BACKENDS):
        raise ValueError(f"unknown ViT attention backend {backend!r}")
    k, p, d, i, hd, h = (vcfg.downsample_ratio, vcfg.patch_size, vcfg.hidden_size, vcfg.intermediate_size,
                         vcfg.head_dim, vcfg.num_attention_heads)
    n = call_patch_budget(vcfg) if patches is None else patches
    cap_patches = k * k * vcfg.max_image_tokens
    lo = min(n, cap_patches) if longest is None else longest
    t = -(-n // (k * k)) if tokens is None else tokens     # aligner rows: the unfold's padded grid / k²
    m = -(-n // cap_patches) if images is None else images
    s = span_tokens if span_tokens is not None else m * image_span_tokens(vcfg)
    hh = text_hidden
    nd, ni, th = n * d, n * i, t * hh
    layer_base = 4 * nd + 4 * n * hd + 4 * (m + 1)         # residual x, RoPE cos + sin, int32 cu_seqlens
    if backend == "sdpa":                                  # fp32 GEMM out, its BF16 rounding, the fp32 copy
        embed = 12 * n * p * p + 10 * nd
        attention = max(38 * nd, 28 * nd + 4 * lo * d + 9 * h * lo * lo)
        mlp = 4 * nd + max(20 * ni, 12 * ni + 10 * nd)
        aligner = 4 * nd + max(8 * k * k * t * d, 4 * k * k * t * d + 10 * th, 18 * th)
    else:                                                  # BF16 operands: input, weight, output copies
        embed = 6 * n * p * p + max(6 * d * p * p + 2 * d + 2 * nd, 6 * nd)
        attention = max(4 * nd + max(8 * nd + 6 * d * d + 6 * d, 18 * nd), 30 * nd,
                        32 * nd + (4 * h * n if backend == "fa3" else 0),
                        28 * nd + max(4 * nd + 2 * d * d + 2 * d, 6 * nd))
        mlp = 4 * nd + max(2 * nd + 4 * i * d + 4 * ni, 12 * ni, 18 * ni, 2 * nd + 14 * ni + 2 * i * d, 6 * nd + 12 * ni)
        aligner = 4 * nd + max(8 * k * k * t * d, 6 * k * k * t * d + 2 * k * k * d * hh + 2 * hh + 2 * th,
                               4 * k * k * t * d + 6 * th, 14 * th, 12 * th + 2 * hh * hh + 2 * hh)
    norm = 10 * nd
    span = 4 * th + 8 * s * hh
    return max(embed, layer_base + max(norm, attention, mlp), aligner, span)


def planned_vit_backend(dc: "DeploymentConfig") -> str:
    """The ViT attention backend the deployment's server selects (``auto`` by device)."""
    return auto_backend("cpu" if dc.hardware.kind.is_cpu else "cuda")


def vision_activation(dc: "DeploymentConfig", cfg: "DeepseekV41Config", prefill_tokens: int,
                      backend: str | None = None) -> dict[str, object] | None:
    """The vision part of one prefill batch's activation memory per rank (None: no vision served).
    `images_per_batch`: images at the cap whose spans one chunk of `prefill_tokens` can overlap
    (capped by features.max_images_per_request × serving.max_running_requests when both are set);
    the ViT encodes them in calls of at most `call_patch_budget` patches, so its peak is one call's.
    `backend`: the ViT attention backend (default: the one the deployment's server selects)."""
    if not serves_vision(dc, cfg):
        return None
    assert cfg.vision is not None
    span, hidden = image_span_tokens(cfg.vision), cfg.text.hidden_size
    images = -(-prefill_tokens // (cfg.vision.max_image_tokens + 3)) + 1
    n, running = dc.features.max_images_per_request, dc.serving.max_running_requests
    if n is not None and running is not None:
        images = min(images, n * running)
    backend = backend or planned_vit_backend(dc)
    vit = vit_activation_bytes(cfg.vision, hidden, backend)
    cache = min(images, SPAN_CACHE_IMAGES) * span * hidden * 4
    rows = 2 * min(prefill_tokens, images * span) * hidden * 4
    dp = dc.features.encoder_data_parallel and dc.parallel.tp > 1
    gather = 2 * images * span * hidden * 4 if dp else 0
    return {"images_per_batch": images, "prefill_tokens": prefill_tokens, "vit_peak_bytes": vit,
            "span_cache_bytes": cache, "batch_rows_bytes": rows, "encoder_gather_bytes": gather,
            "encoder": (f"data-parallel over {dc.parallel.tp} ranks" if dp else
                        "every rank encodes every image" + (" (encoder_data_parallel is a no-op at TP 1)"
                                                            if dc.features.encoder_data_parallel else "")),
            "total_bytes": vit + cache + rows + gather,
            "vit_backend": backend, "vit_call_patches": call_patch_budget(cfg.vision),
            "attention": ("varlen (no score matrix)" if backend in VARLEN_BACKENDS
                          else "SDPA math, per image (heads·L² scores)")}


def checkpoint_problems(dc: "DeploymentConfig", cfg: "DeepseekV41Config") -> list[str]:
    """Vision rules that need the checkpoint's config.json."""
    f, out = dc.features, []
    if cfg.vision is None:
        if f.encoder_data_parallel:
            out.append("features.encoder_data_parallel: the checkpoint has no vision tower")
        if f.max_images_per_request is not None:
            out.append("features.max_images_per_request: the checkpoint has no vision tower (no vision_config)")
        return out
    n = f.max_images_per_request
    context = dc.serving.context_length or cfg.text.max_position_embeddings
    shortest = cfg.vision.max_image_tokens + 3          # one row of the cap + newline, start, end
    if n is not None and n * shortest > context:
        out.append(f"features.max_images_per_request {n}: {n} image(s) at the {cfg.vision.max_image_tokens}-token cap "
                   f"need at least {n * shortest:,} prompt tokens, above the {context:,}-token context "
                   f"(serving.context_length); lower the image count or raise the context")
    return out


__all__ = ["FEATURE_FLAGS", "LIMIT_FLAG", "SPAN_CACHE_IMAGES", "checkpoint_problems", "image_budget", "image_span_tokens", "limit_args",
           "planned_vit_backend", "schema_problems", "serves_vision", "vision_activation", "vit_activation_bytes"]
