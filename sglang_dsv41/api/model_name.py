"""The model id a DeepSeek-V4.1 server reports (``/v1/models``, the ``model`` of responses) when
no ``--served-model-name`` is given (issue 20 item 5).

SGLang 0.5.17 then uses ``--model-path``, which for `sglang-dsv41 serve` is a local cache path
(``/root/.cache/sglang-dsv41/tiny-seed0``): it leaks the server's file layout to clients. The id
is instead the checkpoint's name: ``org/name`` for a Hugging Face cache snapshot
(``…/models--org--name/snapshots/<rev>``), the directory name for any other local path, and the
value unchanged when it is not a local path (a hub id such as ``deepseek-ai/DeepSeek-V4.1-Flash``).
"""
from __future__ import annotations

from pathlib import PurePath

_HF_CACHE_PREFIX = "models--"


def public_model_name(model_path: str) -> str:
    if not model_path.startswith(("/", "./", "../", "~")):
        return model_path
    parts = PurePath(model_path.rstrip("/")).parts
    for i, part in enumerate(parts):
        if part.startswith(_HF_CACHE_PREFIX) and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return part[len(_HF_CACHE_PREFIX):].replace("--", "/", 1)
    return parts[-1] if parts else model_path
