"""The text report of `sglang-dsv41 plan` (`render`): weights by component, this runtime's own
weights, Engram placement, the KV pool split and capacity, the upstream comparison and the
verdict — every assumption printed next to its result (deploy/plan.py computes them)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..runtime import kv_rows
from .memory import GIB, HUGE_PAGE, vram_minimum_gb

if TYPE_CHECKING:
    from .plan import Plan


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def render(p: Plan, source: str) -> str:
    w, lay = p.weights, p.weights.layout
    u, un = (GIB, "GiB") if p.checkpoint.stored_total >= GIB else (float(1 << 20), "MiB")  # tiny checkpoints
    lines = [f"sglang-dsv41 plan — {p.name} ({source}), {p.status}",
             f"model: {p.model_source}; loaded: vision {'yes' if w.included['vision'] else 'no'}, "
             f"DSpark draft {'yes' if w.included['dspark'] else 'no'}",
             f"hardware: {p.gpus} × {p.gpu}, {p.gpu_mem_gib:g} GiB per GPU [{p.gpu_mem_source}]; "
             f"static budget = {p.mem_fraction:g} × that = {p.static_budget / GIB:.1f} GiB per rank",
             f"parallel: tp {lay.tp} (attention tp {lay.attn_tp} × dp {lay.dp_attention}), ep {lay.ep}: routed experts "
             f"1/{lay.tp} per rank, head-split attention and vocab 1/{lay.attn_tp}, shared experts 1/{lay.moe_tp}, "
             "the rest replicated", "",
             f"{'weights by component':44s} {'entries':>9s} {'checkpoint':>10s} {'loaded':>8s} {'per rank':>9s}",
             f"{'':44s} {'':>9s} {un:>10s} {un:>8s} {un:>9s}"]
    for k, c in w.components.items():
        whole = p.checkpoint.components[k]
        lines.append(f"{c.label:44s} {_count(whole.entries):>9s} {whole.stored / u:10.1f} {c.stored / u:8.1f} "
                     f"{c.per_rank / u:9.2f}")
    lines += [f"{'total (stored form)':44s} {'':9s} {p.checkpoint.stored_total / u:10.1f} {w.stored_total / u:8.1f} "
              f"{w.stored_per_rank / u:9.2f}",
              f"{'load-time dequantisation (wo_a → BF16)':44s} {'':29s} {w.load_transform_per_rank / u:+9.2f}",
              f"{'resident weights per rank':44s} {'':29s} {w.resident_per_rank / u:9.2f}",
              (f"{'this runtime holds per rank':44s} {'':29s} {p.runtime_weights.per_rank / u:9.2f}   "
               f"({p.runtime_weights_note}; deploy/runtime_residency.py)" if p.runtime_weights is not None
               else f"this runtime cannot serve this layout: {p.runtime_weights_note}"),
              f"vram_minimum_gb (whole checkpoint × 1.2, GB): {vram_minimum_gb(p.checkpoint.stored_total)}", ""]
    if p.images is not None:
        im = p.images
        count = (f"{im['images']} image(s) per request (features.max_images_per_request)" if im["images"]
                 else "no cap on images per request (the card's default; one image shown)")
        lines += [f"images: {count}; an image at the {im['max_image_tokens']}-token cap takes "
                  f"{im['tokens_per_image']:,} prompt tokens (square grid: start + rows of patches and a newline + "
                  f"end), so {im['tokens']:,} of each request's {p.context:,}-token context, KV sized with it"]
        va = p.vision_activation
        if va is not None:
            lines.append(f"vision activations per rank: ViT peak {va['vit_peak_bytes'] / 2**20:.1f} MiB (one ViT call "
                         f"of ≤ {va['vit_call_patches']:,} patches, one image at the cap; calls run one at a time; "
                         f"attention {va['vit_backend']}, {va['attention']}) + span cache "
                         f"{va['span_cache_bytes'] / 2**20:.1f} MiB + batch rows {va['batch_rows_bytes'] / 2**20:.1f} MiB "
                         f"(≤ {va['images_per_batch']} image(s) in a {va['prefill_tokens']:,}-token prefill chunk)"
                         + (f" + encoder all-gather {va['encoder_gather_bytes'] / 2**20:.1f} MiB"
                            if va["encoder_gather_bytes"] else "") + " = "
                         f"{va['total_bytes'] / 2**20:.1f} MiB of the {p.activation_room / 2**20:,.0f} MiB outside "
                         f"the static budget; encoder: {va['encoder']}")
        lines.append("")
    if w.engram_placement == "device":
        lines.append(f"Engram: on device, {w.engram_stored / u:.1f} {un} (tables + scales) with rows split over "
                     f"{lay.tp} rank(s): {w.engram_device_per_rank / u:.2f} {un} per rank (inside the weights above)")
    else:
        rw = p.runtime_weights
        shards = (f"layout {rw.host_layout}: each of the {lay.tp} rank(s) pins its own block of rows, at most "
                  f"{rw.host_per_rank / u:.2f} {un} per rank, and lookups all-reduce; " if rw is not None else "")
        lines.append(f"Engram: in pinned host memory, read by the GPU through UVA — {shards}"
                     f"{p.host_per_server / u:.1f} {un} per server "
                     f"({math.ceil(p.host_per_server / HUGE_PAGE):,} × 2 MiB huge pages); "
                     f"{p.servers_per_node} server(s) per node → {p.host_need_per_node / u:.1f} {un} host per node")
    pool, r = p.pool, p.upstream_request
    cap = f", --max-total-tokens {pool.max_total_tokens:,}" if pool.max_total_tokens is not None else ""
    lines += ["", f"KV cache: the runtime's SGLang hybrid-SWA pool (docs/runtime.md; --swa-full-tokens-ratio "
                  f"{pool.swa_full_tokens_ratio:g}, --page-size {pool.page_size}{cap}):",
              f"  global KV per token: {pool.row_bytes} B in two packed FP4 rows (one KV head, so every TP rank "
              f"holds them whole) = latent row {pool.latent_row_bytes} B ("
              + " + ".join(f"{s[2]}" for s in pool.sources)
              + f" + {pool.latent_row_bytes - sum(s[2] for s in pool.sources)} pad) + index-key row "
              f"{pool.key_row_bytes} B (" + " + ".join(f"{s[3]}" for s in pool.sources)
              + f" + {pool.key_row_bytes - sum(s[3] for s in pool.sources)} pad) over sources "
              + ", ".join(f"{s[0]} (ratio {s[1]})" for s in pool.sources) + "; padding to 16 B per row",
              f"  SWA per SWA token: {pool.swa_token_bytes:,} B; SGLang's cell per full token = {pool.row_bytes} + "
              + (f"{pool.draft_row_bytes:,} (DSpark draft) + " if pool.draft_row_bytes else "") +
              f"{pool.swa_full_tokens_ratio:g} × {pool.swa_token_bytes:,} = {pool.cell_bytes:,.1f} B",
              f"  per decoding request: {pool.swa_tokens_per_request} SWA tokens (window + page) = "
              f"{pool.swa_tokens_per_request * pool.swa_token_bytes / 2**20:.2f} MiB; ratio-2 pair ring "
              f"{pool.pair_state_per_request / 2**10:.1f} KiB outside the KV budget (request-scoped, like req_to_token)"]
    if pool.draft_row_bytes:
        lines.append(f"  DSpark draft context: {pool.draft_row_bytes:,} B per full token (one bf16 row of head_dim per "
                     f"stage, in the cell above), pair ring {kv_rows.pair_ring_slots(pool.draft_tokens)} slots for "
                     f"{pool.draft_tokens}-token verify forwards")
    lines += [f"  KV budget per rank: {p.static_budget / GIB:.1f} − {p.weights_per_rank / GIB:.1f} = "
              f"{p.kv_budget / GIB:.1f} GiB",
              f"  capacity: {p.capacity_tokens_per_rank:,} full-pool tokens and {p.swa_capacity_per_rank:,} SWA tokens "
              f"per rank; {p.max_full_context_requests} concurrent request(s) of {p.context:,} tokens per server",
              *_hicache_lines(p),
              f"  compared with upstream SGLang 0.5.23 layouts (not what this runtime stores; config "
              f"features.kv_layout {p.upstream_kv_layout}): global KV v4 {p.upstream_kv_bytes_per_token['v4']:.1f} B, "
              f"v41/FP4 {p.upstream_kv_bytes_per_token['v41']:.1f} B per token (page-padded); per request SWA "
              f"{r.swa / 2**20:.2f} MiB + DSpark draft SWA {r.dspark_swa / 2**20:.2f} MiB", ""]
    ok, text = p.verdict()
    lines.append(f"verdict: {text}")
    if p.launch_refusals:
        lines.append("launch: CANNOT BE SERVED AS CONFIGURED YET — `sglang-dsv41 launch` refuses it (exit 3) "
                     "unless --allow-unavailable; the verdict above is about memory only:")
        lines += [f"  - {r}" for r in p.launch_refusals]
    return "\n".join(lines)


def _hicache_lines(p: Plan) -> list[str]:
    """The HiCache host tier (L2), when the plan has one (deploy/hicache_plan.py)."""
    h = p.hicache
    if h is None:
        return []
    return [f"  HiCache host tier (L2, {h.setting}): {h.tokens_per_rank:,} tokens per rank × {h.bytes_per_token:,} B "
            f"(global rows {h.full_row_bytes} + SWA rows {h.swa_row_bytes:,}, both host pools) = "
            f"{h.bytes_per_rank / GIB:.2f} GiB host per rank; {h.ranks_per_node} rank(s) per node → "
            f"{h.bytes_per_node / GIB:.2f} GiB host per node (in the host check of the verdict)"]
