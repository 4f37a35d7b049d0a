"""The reference attention sublayer against an independent dense formulation (spec §3.4).

The brute force below re-derives every layer of the tiny config for a one-shot prefill from the
spec text, written differently from `sglang_dsv41/reference/{attention,indexer,compressor}.py`:
RoPE as complex multiplication with its own YaRN table, ratio-2 pooling as a reshape of all
pairs, index scores head by head, top-k / candidate blocks by Python sorting with the
(−score, index) key, attention as dense [T, T + N] masked score matrices with the sink as an
extra softmax column, and wo_a as one block-diagonal matrix. Only the rounding primitives of
`ops` (BF16 / FP8 / FP4 round trips, FP8 linears, cache profiles) are shared.

Selections and candidate blocks must match exactly; outputs and caches within fp32 noise
carried through BF16 (≤ a couple of BF16 ulps).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_dsv41.config import TextConfig
from sglang_dsv41.reference import ops
from test_reference_attention import FP4, FP8, NONE, T_PROMPT, Run, attention_weights, layer_inputs, tiny_text


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def yarn_table(t: TextConfig, ratio: int) -> torch.Tensor:
    """Upstream's fp32 table (`kernels/ops/attention/dsv4/rope.py:50-63`) in numpy float32."""
    d = t.qk_rope_head_dim
    f32 = np.float32
    base = t.rope_theta if ratio == 0 else t.compress_rope_theta
    inv = f32(1.0) / np.power(f32(base), np.arange(0, d, 2, dtype=f32) / f32(d))
    if ratio != 0:
        sc = t.rope_scaling
        corr = lambda r: d * math.log(sc.original_max_position_embeddings / (2 * math.pi * r)) / (2 * math.log(base))  # noqa: E731
        low, high = max(math.floor(corr(sc.beta_fast)), 0), min(math.ceil(corr(sc.beta_slow)), d - 1)
        smooth = f32(1) - np.clip((np.arange(d // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
        inv = inv / f32(sc.factor) * (f32(1) - smooth) + inv * smooth
    return torch.from_numpy(inv.astype(f32))


def complex_rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, conj: bool = False) -> torch.Tensor:
    """Interleaved pairs of the last 2·len(inv) dims as complex numbers times e^{±i·p·f}."""
    rd = 2 * inv.numel()
    angle = pos.float()[:, None] * inv[None, :]
    rot = torch.polar(torch.ones_like(angle), -angle if conj else angle)
    rot = rot.reshape(rot.shape[0], *([1] * (x.dim() - 2)), rot.shape[1])
    z = torch.view_as_complex(x[..., -rd:].float().reshape(*x.shape[:-1], rd // 2, 2).contiguous())
    return torch.cat((x[..., :-rd].float(), torch.view_as_real(z * rot).flatten(-2)), dim=-1)


def norm32(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def swa_row(kv: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, profile, rd: int) -> torch.Tensor:
    """Upstream's SWA store per layout: v4 rotates and quantises the fp32 normed row (nope E4M3
    per 64 with amax floored at 1e-4, RoPE dims BF16); the BF16 and v41 stores round the normed
    row to BF16, rotate, round again (v41 then E4M3 per 32)."""
    if profile == FP8:
        row = complex_rope(kv, pos, inv)
        nope = row[:, :-rd].reshape(row.shape[0], -1, 64)
        amax = nope.abs().amax(-1, keepdim=True).clamp(min=np.float32(1e-4))
        scale = 2.0 ** torch.ceil(torch.log2(amax.double() / 448)).float()
        q = (nope / scale).to(torch.float8_e4m3fn).float() * scale
        return torch.cat((q.reshape(row.shape[0], -1), ops.bf16(row[:, -rd:])), dim=1)
    row = ops.bf16(complex_rope(ops.bf16(kv), pos, inv))
    if profile == NONE:
        return row
    g = row.reshape(row.shape[0], -1, 32)
    scale = 2.0 ** torch.ceil(torch.log2((g.abs().amax(-1, keepdim=True).double() / 448).clamp(min=1e-4))).float()
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(row.shape)


def ranked(scores: list[float], allowed: list[int], k: int) -> list[int]:
    return sorted(sorted(allowed, key=lambda j: (-scores[j], j))[:k])


def dense_reference(t: TextConfig, w, xs, profile, act_quant=True):
    """One-shot prefill of every layer, positions 0..T−1. Returns outputs, selections, blocks, caches."""
    T, W, H, D, rd = xs[0].shape[0], t.sliding_window, t.num_attention_heads, t.head_dim, t.qk_rope_head_dim
    pos = torch.arange(T)
    roles = t.layer_roles()
    latents, keys_idx, swa, sels, blocks, outs = {}, {}, {}, {}, {}, []
    for r in roles:
        p_ = f"layers.{r.layer}.attn."
        x, inv = xs[r.layer], yarn_table(t, r.ratio)
        q_lora = ops.rms_norm(ops.linear_fp8(x, w[p_ + "wq_a.weight"], act_quant), w[p_ + "q_norm.weight"], t.rms_norm_eps)
        q = ops.bf16(complex_rope(ops.linear_fp8(q_lora, w[p_ + "wq_b.weight"], act_quant).view(T, H, D), pos, inv))
        kv = norm32(ops.linear_fp8(x, w[p_ + "wkv.weight"], act_quant), w[p_ + "kv_norm.weight"], t.rms_norm_eps)
        swa[r.layer] = swa_row(kv, pos, inv, profile, rd)
        if r.computes_latents:
            wkv = w[p_ + "compressor.wkv.weight"].double()
            if r.ratio == 1:
                lat, lpos = ops.rms_norm(ops.bf16(x.double() @ wkv.t()), w[p_ + "compressor.norm.weight"], t.rms_norm_eps), pos
            else:
                n = T // 2
                a = (x[: 2 * n].double() @ wkv.t()).float().view(n, 2, D)
                s = (x[: 2 * n].double() @ w[p_ + "compressor.wgate.weight"].double().t()).float().view(n, 2, D)
                pooled = (a * torch.softmax(s, dim=1)).sum(1)
                lat, lpos = ops.rms_norm(ops.bf16(pooled), w[p_ + "compressor.norm.weight"], t.rms_norm_eps), 2 * torch.arange(n)
            latents[r.layer] = ops.compressed_cache_roundtrip(
                ops.fp4_fake_quant_e4m3_scale(ops.bf16(complex_rope(lat, lpos, inv))), profile, rd)
            k = ops.rms_norm(ops.bf16(lat.double() @ w[p_ + "indexer.wk.weight"].double().t()),
                             w[p_ + "indexer.k_norm.weight"], t.rms_norm_eps)
            keys_idx[r.layer] = ops.fp4_fake_quant_ue8m0_scale(ops.bf16(complex_rope(k, lpos, inv)))
        cols_swa = pos[None, :]
        mask_swa = (cols_swa <= pos[:, None]) & (cols_swa > pos[:, None] - W)
        if r.ratio == 0:
            comp, mask_c = torch.zeros(0, D), torch.zeros(T, 0, dtype=torch.bool)
        else:
            comp, N = latents[r.kv_source], latents[r.kv_source].shape[0]
            if r.runs_indexer:
                qi = ops.linear_fp8(q_lora, w[p_ + "indexer.wq_b.weight"], act_quant).view(T, t.index_n_heads, -1)
                qi = ops.fp4_fake_quant_ue8m0_scale(ops.bf16(complex_rope(qi, pos, inv)))
                hw = (x.double() @ w[p_ + "indexer.weights_proj.weight"].double().t()).to(torch.bfloat16)
                hw = (hw * (t.index_head_dim ** -0.5 * t.index_n_heads ** -0.5)).double()  # a BF16 tensor op
                # upstream's rounding points: bf16(dot), bf16(w·ReLU), bf16(Σ_h) (dot and Σ exact, then fp32)
                S = ops.bf16(sum(ops.bf16(hw[:, h:h + 1].float() * torch.relu(ops.bf16(
                    (qi[:, h].double() @ keys_idx[r.kv_source].double().t()).float()))).double()
                    for h in range(t.index_n_heads)).float())
                sel, blk = [], []
                for i in range(T):
                    n_vis, row = (i + 1) // r.ratio, S[i].tolist()
                    allowed = list(range(n_vis))
                    if r.candidate_consumer:
                        allowed = [j for j in allowed if j // t.candidate_block_size in blocks[t.candidate_source_layer_id][i]]
                    sel.append(ranked(row, allowed, t.index_topk))
                    if r.candidate_source:
                        B = t.candidate_block_size
                        nb = -(-n_vis // B)
                        bkey = [max(row[b * B:min((b + 1) * B, n_vis)]) for b in range(nb)]
                        if nb:
                            bkey[nb - 1] = math.inf
                        blk.append(ranked(bkey, list(range(nb)), t.candidate_topk_blocks))
                sels[r.layer] = sel
                if r.candidate_source:
                    blocks[r.layer] = blk
            chosen = sels[r.selection_from]
            mask_c = torch.tensor([[j in chosen[i] for j in range(N)] for i in range(T)], dtype=torch.bool).view(T, N)
        K = torch.cat((swa[r.layer], comp)).double()
        mask = torch.cat((mask_swa, mask_c), dim=1)
        sink = w[p_ + "attn_sink"].double()
        o = torch.empty(T, H, D)
        for h in range(H):
            logits = (q[:, h].double() @ K.t()) / math.sqrt(D)
            logits = torch.cat((logits.masked_fill(~mask, -math.inf), sink[h].expand(T, 1)), dim=1)
            o[:, h] = (torch.softmax(logits, dim=1)[:, :-1] @ K).float()
        o = ops.bf16(complex_rope(ops.bf16(o), pos, inv, conj=True))
        r_ = t.o_lora_rank
        wo_a_bd = torch.block_diag(*[w[p_ + "wo_a.weight"][g * r_:(g + 1) * r_] for g in range(t.o_groups)])
        u = ops.bf16(o.reshape(T, H * D).double() @ wo_a_bd.double().t())
        outs.append(ops.linear_fp8(u, w[p_ + "wo_b.weight"], act_quant))
    return outs, sels, blocks, swa, latents, keys_idx


@pytest.mark.parametrize("profile,act_quant", [(NONE, True), (FP8, True), (FP4, True), (NONE, False)])
def test_matches_dense_bruteforce(profile, act_quant):
    t, w = tiny_text(), attention_weights(seed=5)
    xs = layer_inputs(t, T_PROMPT, seed=6)
    run = Run(t, w, xs, [T_PROMPT], profile, act_quant)
    outs, sels, blocks, swa, latents, keys_idx = dense_reference(t, w, xs, profile, act_quant)
    assert set(sels) == set(run.selections) == {1, 3, 4, 6}
    for layer, sel in sels.items():
        got = [sorted(int(j) for j in row if j >= 0) for row in run.selections[layer]]
        assert got == sel, f"selection of layer {layer}"
    assert [sorted(int(b) for b in row if b >= 0) for row in run.blocks[4]] == blocks[4]
    ulp = 2.0 ** -7
    for layer in range(t.num_hidden_layers):
        torch.testing.assert_close(run.state.swa_kv[layer], swa[layer], atol=1e-6, rtol=2 * ulp)
        torch.testing.assert_close(run.outputs[layer], outs[layer], atol=2 * ulp, rtol=2 * ulp,
                                   msg=f"layer {layer} output")
        assert (run.outputs[layer] == outs[layer]).float().mean() > 0.95
    for src in t.kv_source_layer_ids:
        torch.testing.assert_close(run.state.compressed_kv[src], latents[src], atol=1e-6, rtol=0)
        torch.testing.assert_close(run.state.index_keys[src], keys_idx[src], atol=1e-6, rtol=0)
