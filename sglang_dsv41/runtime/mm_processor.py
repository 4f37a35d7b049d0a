"""Image requests on SGLang 0.5.17's multimodal path (integration.md §4; issue 17 item 1).

Registration (`register`, from the plugin; no patch — SGLang's own registries):
* our architecture joins `model_config.multimodal_model_archs` (read at call time), so a V4.1
  server is multimodal unless `--language-model-only` (`enable_multimodal = False`) or a
  checkpoint without `vision_config` (`overrides.resolve_server_args_hook`) switches it off;
* `DeepseekV41ImageProcessor` joins `PROCESSOR_MAPPING` under a class named like our model class
  (`get_mm_processor` matches `__name__` against the architectures);
* `_CUSTOMIZED_MM_PROCESSOR["deepseek_v41"]` returns the checkpoint tokenizer (V4.1 has no HF
  processor).

The processor takes the chat encoder's token ids (`prefer_tokenized_input`), loads each image
(`image_io.load_image`: a bad image is a `ValueError`, SGLang answers 400), plans and patchifies it
(`vision_preprocess.preprocess_image`, spec §5.1), and expands the i-th `image_token_id` to the i-th
image's span (`num_tokens` ids). Each item carries the BF16-valued patches (fp32), the span's
inclusive offsets and the grid; `DeepseekV41ForCausalLM.pad_input_ids` then writes the item's
hash pad value (≥ 1,000,000) over its span, so the radix cache keys encode image content.
"""
from __future__ import annotations

import asyncio
from typing import Any

import torch

from ..config import DeepseekV41Config
from ..vision_preprocess import ImageGrid, ImageGridError, PreprocessedImage, preprocess_image
from .hf_config import ARCHITECTURE, MODEL_TYPE
from .image_io import load_image

#: `MultimodalDataItem.model_specific_data` key of the planned grid (`ImageGrid` fields)
GRID_KEY = "dsv41_grid"


def grid_of(item: Any) -> ImageGrid:
    return ImageGrid(**item.model_specific_data[GRID_KEY])


def preprocessed_of(item: Any) -> PreprocessedImage:
    """The `PreprocessedImage` an item carries (patches back to BF16: they are BF16 values)."""
    feature = item.feature
    if not isinstance(feature, torch.Tensor):
        feature = torch.as_tensor(feature)
    return PreprocessedImage(patches=feature.to(torch.bfloat16), grid=grid_of(item))


def expand_placeholders(ids: list[int], grids: list[ImageGrid], image_id: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Each `image_id` → its image's span; returns the ids and inclusive (start, end) per image."""
    count = sum(1 for t in ids if t == image_id)
    if count != len(grids):
        raise ValueError(f"the prompt has {count} image placeholder(s) for {len(grids)} image(s)")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    it = iter(grids)
    for t in ids:
        if t != image_id:
            out.append(int(t))
            continue
        n = next(it).num_tokens
        spans.append((len(out), len(out) + n - 1))
        out.extend([image_id] * n)
    return out, spans


def _base_processor():
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    return BaseMultimodalProcessor


class _ModelName:
    """A class named as our architecture: `PROCESSOR_MAPPING` keys are matched by `__name__`."""


_ModelName.__name__ = ARCHITECTURE


def make_processor_class() -> type:
    """`DeepseekV41ImageProcessor` (SGLang's base class is imported only when registering)."""

    class DeepseekV41ImageProcessor(_base_processor()):
        models = [_ModelName]
        prefer_tokenized_input = True
        preserve_processor_input_ids = True
        gpu_image_decode = False

        def __init__(self, hf_config, server_args, _processor, *args, **kwargs) -> None:
            super().__init__(hf_config, server_args, _processor, *args, **kwargs)
            self.cfg: DeepseekV41Config = hf_config.parsed()
            if self.cfg.vision is None:
                raise ValueError("sglang-dsv41: this checkpoint has no vision_config; it cannot take images")
            self.image_token_id = self.cfg.image_token_id

        def _prepare(self, image_data: list[Any]) -> list[PreprocessedImage]:
            out = []
            for i, data in enumerate(image_data):
                img = load_image(data, where=f"image {i}")
                try:
                    out.append(preprocess_image(img, self.cfg.vision))
                except ImageGridError as err:
                    raise ValueError(f"image {i}: {err}") from err
            return out

        async def process_mm_data_async(self, image_data, input_text, request_obj, *args, **kwargs):
            from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalProcessorOutput

            if getattr(request_obj, "video_data", None) or getattr(request_obj, "audio_data", None):
                raise ValueError("DeepSeek-V4.1 takes image input only (no video or audio)")
            if not image_data:
                return None
            if isinstance(input_text, str) or input_text is None:
                raise ValueError("image requests need the chat encoder's token ids (use /v1/chat/completions "
                                 "or send input_ids with one image placeholder per image)")
            images = image_data if isinstance(image_data, list) else [image_data]
            pres = await asyncio.get_running_loop().run_in_executor(self.io_executor, self._prepare, images)
            ids, spans = expand_placeholders(list(input_text), [p.grid for p in pres], self.image_token_id)
            items = []
            for pre, span in zip(pres, spans):
                item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[span], feature=pre.patches.float())
                item.model_specific_data[GRID_KEY] = dict(vars(pre.grid))
                items.append(item)
            return MultimodalProcessorOutput(mm_items=items, input_ids=ids, im_token_id=self.image_token_id)

    return DeepseekV41ImageProcessor


class TokenizerAsProcessor:
    """`_CUSTOMIZED_MM_PROCESSOR` entry: V4.1 has no HF processor, its "processor" is the tokenizer."""

    @classmethod
    def from_pretrained(cls, name: str, *args, trust_remote_code: bool = False, revision=None, **kwargs):
        from sglang.srt.utils.hf_transformers import get_tokenizer

        return get_tokenizer(name, trust_remote_code=trust_remote_code, revision=revision)


def register() -> None:
    """The three registrations of the module doc (idempotent)."""
    from sglang.srt.configs import model_config
    from sglang.srt.managers.multimodal_processor import PROCESSOR_MAPPING
    from sglang.srt.multimodal.customized_mm_processor_utils import _CUSTOMIZED_MM_PROCESSOR

    if ARCHITECTURE not in model_config.multimodal_model_archs:
        model_config.multimodal_model_archs.append(ARCHITECTURE)
    for cls in list(PROCESSOR_MAPPING):
        if cls.__name__ == ARCHITECTURE:
            del PROCESSOR_MAPPING[cls]
    PROCESSOR_MAPPING[_ModelName] = make_processor_class()
    _CUSTOMIZED_MM_PROCESSOR[MODEL_TYPE] = TokenizerAsProcessor
