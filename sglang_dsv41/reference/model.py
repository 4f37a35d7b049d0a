"""The whole DeepSeek-V4.1 model as a pure-PyTorch reference (spec `model.md` §3, §3.5, §8, §11).

Forward of one chunk of one request (chunked prefill and decode are the same call):

1. ids: with vision, ids ≥ 1,000,000 (multimodal hash pads) read as `image_token_id` (§3.1);
   e_t = embed[id_t]; rows of image spans are replaced by the vision tower's span rows
   (`image_embeds`); R⁰[t, c] = e_t for every stream c (§3.1 item 4, after the merge).
2. per layer i: [Engram at Engram layers: R ← Engram(R) (§3.3)] → [DSpark capture: stream
   mean of R (§4)] → attn-hc → attention → ffn-hc → MoE, with the **lagged** pre: each
   combine uses the pre of the previous hyper-connection, the model's first uses stream 0
   (§3.2). At an Engram layer the carried pre (computed on the pre-Engram residual) is still
   used, and the attn-hc coefficients come from the post-Engram residual.
3. final collapse with the last ffn-hc's pre, `norm`, LM head with fp32 logits (§3.7).

Model semantics (§3.5): every layer runs for every token — full prefill, **no** decoder SWA
bounded replay. Numerics: fp32 tensors holding BF16-rounded values between sublayers; cache
storage and FP8 activation quantisation follow the `NumericsProfile` (§3.8).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from ..checkpoint.names import tensor_inventory
from ..config import DeepseekV41Config
from ..engram_hash import EngramHasher, compressed_token_map
from ..numerics.geometry import language_model_ids
from . import attention as attention_mod
from . import moe as moe_mod
from .attention import AttentionState, ChunkScratch
from .engram import engram_residual_update
from .mhc import hc_coefficients, hc_collapse, hc_residual_update, hc_sublayer_input
from .ops import F32, bf16, linear_fp8, matmul_fp32_exact, rms_norm
from .state import ForwardOutput, NumericsProfile, RequestState, empty_features



class ReferenceModel:
    """DeepSeek-V4.1 reference (spec §3). `weights`: DeepSeek-native names → dequantised fp32
    tensors (spec §2.4 values, see `checkpoint.loader.load_reference_weights`).

    Engram hashing needs the tokenizer's compressed token map (spec §3.3.1): pass `tokenizer`
    (HF fast tokenizer or directory) or `engram_token_map` (int array [len(tokenizer)]).
    """

    def __init__(self, cfg: DeepseekV41Config, weights: Mapping[str, Tensor],
                 numerics: NumericsProfile = NumericsProfile(), device: str | torch.device = "cpu",
                 tokenizer: Any = None, *, engram_token_map: np.ndarray | Tensor | None = None) -> None:
        self.cfg = cfg
        self.text = cfg.text
        self.numerics = numerics
        self.device = torch.device(device)
        if self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            raise RuntimeError("ReferenceModel on CUDA needs fp32 matmuls: disable TF32 "
                               "(torch.backends.cuda.matmul.allow_tf32 = False)")
        self.roles = self.text.layer_roles()
        required = [s.name for s in tensor_inventory(cfg, vision=False, dspark=False)]
        missing = [n for n in required if n not in weights]
        if missing:
            raise KeyError(f"reference weights miss {len(missing)} tensors, e.g. {missing[:5]}")
        self.weights: dict[str, Tensor] = {k: v.to(device=self.device, dtype=F32) for k, v in weights.items()}
        self.tokenizer = tokenizer
        self.hasher: EngramHasher | None = None
        if self.text.engram_layer_ids:
            if engram_token_map is None:
                if tokenizer is None:
                    raise ValueError("the model has Engram layers: pass `tokenizer` or `engram_token_map` "
                                     "(compressed token map, spec §3.3.1)")
                engram_token_map, _ = compressed_token_map(tokenizer)
            self.hasher = EngramHasher.from_config(cfg, engram_token_map).to(self.device)
        self._vision_encoder: Any = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: str | Path, numerics: NumericsProfile = NumericsProfile(),
                        device: str | torch.device = "cpu") -> "ReferenceModel":
        """Load config.json, weights (`checkpoint.loader`) and the tokenizer from a directory."""
        from transformers import PreTrainedTokenizerFast

        from ..checkpoint.loader import load_reference_weights

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (the Engram hash needs the checkpoint's tokenizer)")
        cfg = DeepseekV41Config.from_file(path)
        weights = load_reference_weights(path, cfg)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        return cls(cfg, weights, numerics, device, tokenizer=tokenizer)

    def new_request(self) -> RequestState:
        t = self.text
        history = None if self.hasher is None else self.hasher.new_history(1, self.device)[0]
        return RequestState(
            attention=AttentionState.empty(t, self.numerics.cache, self.device),
            engram_history=history,
            dspark_features=empty_features(len(t.dspark_target_layer_ids), t.hidden_size, self.device),
        )

    # ---- embedding (spec §3.1) ----------------------------------------------------------------
    def remap_ids(self, token_ids: Tensor) -> Tensor:
        """Language-model ids (§3.1 item 3), see `language_model_ids`."""
        return language_model_ids(token_ids.to(self.device), self.cfg)

    def embed(self, ids: Tensor, image_embeds: Sequence[tuple[int, Tensor]] = ()) -> Tensor:
        """[T, H] BF16-valued: token embeddings with image-span rows merged in (§3.1 item 2).

        Each (offset, rows [n, H]) replaces positions offset..offset+n−1 of this chunk, which
        must all carry image_token_id."""
        e = self.weights["embed.weight"][ids].clone()
        T = ids.shape[0]
        for offset, rows in image_embeds:
            if not self.cfg.has_vision:
                raise ValueError("image embeddings given but the config has no vision tower")
            n = rows.shape[0]
            if offset < 0 or offset + n > T or rows.shape[-1] != self.text.hidden_size:
                raise ValueError(f"image span at offset {offset} with rows {tuple(rows.shape)} does not fit "
                                 f"a chunk of {T} tokens × hidden {self.text.hidden_size}")
            if not bool((ids[offset:offset + n] == self.cfg.image_token_id).all()):
                raise ValueError(f"image span {offset}..{offset + n - 1}: every id in a span must be "
                                 f"image_token_id {self.cfg.image_token_id} (spec §5.3)")
            e[offset:offset + n] = bf16(rows.to(device=self.device, dtype=F32))
        return e

    # ---- one chunk (spec §3.2, §3.5) ------------------------------------------------------------
    def _hc(self, layer: int, sub: str, R: Tensor):
        w, t = self.weights, self.text
        p = f"layers.{layer}.hc_{sub}_"
        return hc_coefficients(R, w[p + "fn"], w[p + "base"], w[p + "scale"], rms_eps=t.rms_norm_eps,
                               hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)

    def _engram(self, layer: int, R: Tensor, row_ids: Tensor, image_rows: Tensor | None) -> Tensor:
        w, p = self.weights, f"layers.{layer}.engram."
        linear = functools.partial(linear_fp8, act_quant=self.numerics.act_quant)
        return engram_residual_update(R, row_ids, w[p + "embed.weight"], w[p + "wkv.weight"],
                                      w[p + "q_weight"], w[p + "k_weight"], self.text.rms_norm_eps,
                                      image_rows=image_rows, linear=linear)

    @torch.no_grad()
    def forward(self, state: RequestState, token_ids: Tensor | Sequence[int],
                image_embeds: Sequence[tuple[int, Tensor]] = (), capture: bool = False) -> ForwardOutput:
        """Run one chunk of T ≥ 1 tokens at positions state.length..state.length+T−1 and commit it
        to `state` (spec §3). Returns fp32 logits [T, vocab] and, if `capture`, the DSpark
        features [T, n_targets, H] (also appended to `state.dspark_features`)."""
        t, w, nm = self.text, self.weights, self.numerics
        ids = self.remap_ids(torch.as_tensor(token_ids))
        T = ids.shape[0]
        if T == 0:
            raise ValueError("forward needs at least one token")
        positions = torch.arange(state.length, state.length + T, device=self.device)
        image_rows = (ids == self.cfg.image_token_id) if self.cfg.has_vision else None
        engram_rows: list[Tensor] = []
        if self.hasher is not None:
            assert state.engram_history is not None
            engram_rows = self.hasher.row_ids(ids, positions, state.engram_history)

        R = self.embed(ids, image_embeds).unsqueeze(1).expand(T, t.hc_mult, t.hidden_size).contiguous()
        scratch = ChunkScratch()
        captured: list[Tensor] = []
        carried_pre: Tensor | None = None
        for role in self.roles:
            i = role.layer
            if role.engram:
                R = self._engram(i, R, engram_rows[t.engram_layer_ids.index(i)], image_rows)
            if capture and role.dspark_capture:
                captured.append(stream_mean(R))
            co = self._hc(i, "attn", R)
            x = hc_sublayer_input(R, carried_pre, w[f"layers.{i}.attn_norm.weight"], t.rms_norm_eps)
            y = attention_mod.attention_sublayer(t, role, w, i, x, positions, state.attention, scratch,
                                                 nm.cache, nm.act_quant)
            R, carried_pre = hc_residual_update(R, y, co), co.pre
            co = self._hc(i, "ffn", R)
            x = hc_sublayer_input(R, carried_pre, w[f"layers.{i}.ffn_norm.weight"], t.rms_norm_eps)
            y = moe_mod.moe_sublayer(t, w, f"layers.{i}.", x, image_rows=image_rows, act_quant=nm.act_quant)
            R, carried_pre = hc_residual_update(R, y, co), co.pre

        assert carried_pre is not None
        h = rms_norm(hc_collapse(R, carried_pre), w["norm.weight"], t.rms_norm_eps)
        logits = matmul_fp32_exact(h, w["head.weight"])          # BF16 head, fp32 logits (§3.7)

        state.attention.advance(T)
        if self.hasher is not None:
            state.engram_history = self.hasher.update_history(state.engram_history, ids)
        features = None
        if capture:
            features = torch.stack(captured, dim=1)
            state.dspark_features = torch.cat((state.dspark_features, features), dim=0)
        return ForwardOutput(logits=logits, captured=features)

    # ---- images ------------------------------------------------------------------------------
    def encode_images(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[tuple[int, Tensor]]]:
        """Expand each image placeholder to its span and encode it (spec §5): returns the new ids
        and (absolute offset, span rows [n, H]) per image."""
        from .vision import VisionEncoder, expand_image_placeholders
        from ..vision_preprocess import preprocess_image

        if not self.cfg.has_vision:
            raise ValueError("images given but the config has no vision tower")
        ids, spans = expand_image_placeholders(list(prompt_ids), list(images), self.cfg)
        if self._vision_encoder is None:
            vision_weights = {k: v.cpu() for k, v in self.weights.items()
                              if k.startswith(("vision.", "aligner.", "image_"))}
            self._vision_encoder = VisionEncoder(self.cfg, vision_weights)   # runs on CPU
        rows = [self._vision_encoder.encode(preprocess_image(img, self.cfg.vision)).float() for img in images]
        for (start, n), r in zip(spans, rows):
            if r.shape[0] != n:
                raise ValueError(f"vision encoder returned {r.shape[0]} rows for a span of {n}")
        return ids, [(start, r) for (start, _), r in zip(spans, rows)]

    # ---- generation ----------------------------------------------------------------------------
    def prefill(self, state: RequestState, ids: Sequence[int], image_embeds: Sequence[tuple[int, Tensor]] = (),
                chunk: int | None = None, capture: bool = False) -> Tensor:
        """Forward `ids` (absolute image offsets relative to the start of `ids`) in chunks of
        `chunk` tokens (None = one shot); image spans may straddle chunks. Returns the last
        token's logits [vocab]."""
        n = len(ids)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        step = n if chunk is None else int(chunk)
        if step < 1:
            raise ValueError(f"chunk must be ≥ 1, got {chunk}")
        out = None
        for start in range(0, n, step):
            end = min(start + step, n)
            pieces = []
            for offset, rows in image_embeds:
                lo, hi = max(offset, start), min(offset + rows.shape[0], end)
                if lo < hi:
                    pieces.append((lo - start, rows[lo - offset:hi - offset]))
            out = self.forward(state, list(ids[start:end]), pieces, capture=capture)
        assert out is not None
        return out.logits[-1]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, images: Sequence[Any] = (),
                 greedy: bool = True, temperature: float = 1.0, seed: int = 0, chunk: int | None = None,
                 stop_ids: Sequence[int] = ()) -> list[int]:
        """Prefill the prompt (image placeholders expanded), then decode one token per forward.

        Greedy: argmax (lowest id on ties). Sampled: softmax(logits/temperature) drawn with a
        CPU `torch.Generator` seeded with `seed`. Stops after `max_new_tokens` or on a token
        in `stop_ids` (included in the result)."""
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be ≥ 0")
        if not greedy and not temperature > 0:
            raise ValueError(f"sampling needs temperature > 0, got {temperature}")
        ids, spans = self.encode_images(prompt_ids, images) if images else (list(prompt_ids), [])
        state = self.new_request()
        if max_new_tokens == 0:
            return []
        logits = self.prefill(state, ids, spans, chunk)
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while True:
            token = pick_token(logits, greedy, temperature, gen)
            out.append(token)
            if len(out) >= max_new_tokens or token in stop_ids:
                return out
            logits = self.forward(state, [token]).logits[-1]


def stream_mean(R: Tensor) -> Tensor:
    """bf16(mean over streams) with a fixed summation order (DSpark target feature, spec §4)."""
    acc = R[:, 0].to(F32)
    for j in range(1, R.shape[1]):
        acc = acc + R[:, j]
    return bf16(acc / R.shape[1])


def pick_token(logits: Tensor, greedy: bool, temperature: float, gen: torch.Generator) -> int:
    """Next token from fp32 logits [vocab]: argmax (first maximum) or a seeded sample."""
    lf = logits.detach().to("cpu", F32)
    if greedy:
        return int(torch.argmax(lf))
    probs = torch.softmax(lf / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
