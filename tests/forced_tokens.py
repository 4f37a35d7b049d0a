"""A logit processor that makes the server's model emit a given token sequence (tests only).

The tiny checkpoint's model is random; to check what a client sees for a *specific* reply (a
trace then a DSML call, a bare ``｜DSML｜`` token, a trace cut by ``max_tokens``) through the
real scheduler, detokenizer and parsers, a request carries this processor
(``custom_logit_processor``, needs ``--enable-custom-logit-processor``) and the reply's ids in
``custom_params = {"forced_ids": [...], "then": eos_id}``: when the request has k output tokens,
every logit but ``forced_ids[k]`` (``then`` once the list is spent) is -inf. The server must run
with ``--disable-overlap-schedule`` (under the overlap scheduler ``req.output_ids`` lags one step
behind the batch being sampled; a step counter instead miscounts when a chunked prefill samples
and discards a token). SGLang pickles the class by reference, so the server must be able to
import this module (tests put `tests/` on its ``PYTHONPATH``).
"""
from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ForcedTokens(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
                 ) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            if not params or "forced_ids" not in params:
                continue
            ids, step = params["forced_ids"], len(params["__req__"].output_ids)
            token = ids[step] if step < len(ids) else params["then"]
            logits[row, :] = -float("inf")
            logits[row, token] = 0.0
        return logits


def forced(ids: list[int], then: int) -> dict[str, Any]:
    """The request fields that force ``ids`` (then ``then``, e.g. EOS) as the reply."""
    return {"custom_logit_processor": ForcedTokens.to_str(),
            "custom_params": {"forced_ids": list(ids), "then": then}}
