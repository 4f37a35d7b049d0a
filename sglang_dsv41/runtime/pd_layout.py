"""The V4.1 pool's PD registration checks and its layout handshake (docs/pd.md; spec
integration.md §2.1, §2.3 item 4).

SGLang 0.5.17 checks only page size and KV dtype between a prefill and a decode server, so peers
with other buffer layouts would copy bytes into the wrong places without a word. Three hooks
(`sglang_dsv41.hooks`, area "runtime") add a layout handshake through the prefill's bootstrap
server:

* `setup_state_kv_args_hook` (both sides, AFTER `setup_state_kv_args`): for the V4.1 pool,
  refuses zero-size regions (Mooncake#701: they break later transfers, and SGLang ignores the
  registration status) and odd buffer counts (SGLang's non-MLA send halves every pointer list
  into K/V and would drop the last buffer), records the layout fingerprint on `kv_args` and
  selects the pool for the pair-ring index rule (`runtime/pd_state.py`);
* `bootstrap_routes_hook` (AFTER `CommonKVBootstrapServer._setup_routes`) serves
  `/sglang_dsv41/layout` (PUT by the prefill, GET by a decode) and `register_to_bootstrap_hook`
  (AFTER `CommonKVManager.register_to_bootstrap`) puts the prefill's fingerprint there;
* `try_ensure_parallel_info_hook` (AROUND `CommonKVManager.try_ensure_parallel_info`, decode):
  once SGLang has the prefill's parallel info, fetch the prefill's fingerprint and refuse a
  mismatch — a `RuntimeError` naming both sides' values, as SGLang's own page-size check does.

The fingerprint: kv and state item lengths and buffer counts, state types, compress ratios, page
size, attention TP/PP sizes (the non-MLA transfer maps equal TP only) and the DSpark context block
(`dspark_context`: the item lengths of the DSpark draft pool's stage buffers, which SGLang appends
to `kv_data` on a server with `--speculative-algorithm DSPARK`; [] without). The draft token count
is not part of it: it only sizes the pair ring, and the boundary-row rule lets rings differ. A
prefill without DSpark cannot feed a DSpark decode (the draft reads the prompt's context rows,
which only a DSpark prefill writes), so `dspark_context` refuses that pairing.

With a draft pool `kv_data` is 2 global buffers + S stage buffers; for an odd S the hook appends
one pad buffer (`PAD_ITEM` bytes per page, never read) so that SGLang's K/V halving keeps every
buffer — both sides do the same, and SGLang's equal-count mapping pairs buffer i with buffer i.
"""
from __future__ import annotations

import logging

import requests
import torch

logger = logging.getLogger(__name__)

ROUTE = "/sglang_dsv41/layout"
_ATTR = "sglang_dsv41_layout"
#: Bytes per page of the pad buffer that makes an odd `kv_data` list even (module docstring).
PAD_ITEM = 16


def _fail(what: str) -> RuntimeError:
    return RuntimeError(f"sglang-dsv41 PD: {what}")


def check_regions(kv_args) -> None:
    """No zero-size region or item, and an even buffer count in every list the non-MLA send halves."""
    lists = [("kv_data", kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens)]
    lists += [(f"state {st}", p, n, i) for st, p, n, i in zip(kv_args.state_types, kv_args.state_data_ptrs,
                                                               kv_args.state_data_lens, kv_args.state_item_lens)]
    for name, ptrs, lens, items in lists:
        if not ptrs or len(ptrs) != len(lens) or len(ptrs) != len(items):
            raise _fail(f"{name}: {len(ptrs)} buffers, {len(lens)} lengths, {len(items)} item lengths")
        bad = [k for k, (p, n, i) in enumerate(zip(ptrs, lens, items)) if not p or n <= 0 or i <= 0]
        if bad:
            raise _fail(f"{name}: buffers {bad} are empty (zero-size regions break Mooncake transfers)")
        if len(ptrs) % 2:
            raise _fail(f"{name}: {len(ptrs)} buffers; SGLang's non-MLA transfer halves the list into K/V "
                        "and would drop the last one")


def pad_kv_list(kv_args, pool) -> None:
    """Append one pad buffer (PAD_ITEM bytes per page of the pool, kept on `pool`) when `kv_data`
    has an odd count; SGLang's non-MLA send would drop the last buffer otherwise."""
    if len(kv_args.kv_data_ptrs) % 2 == 0:
        return
    pages = kv_args.kv_data_lens[0] // kv_args.kv_item_lens[0]
    pool.pd_pad = torch.zeros(pages * PAD_ITEM, dtype=torch.uint8, device=pool.device)
    kv_args.kv_data_ptrs.append(pool.pd_pad.data_ptr())
    kv_args.kv_data_lens.append(pool.pd_pad.nbytes)
    kv_args.kv_item_lens.append(PAD_ITEM)


def dspark_context(draft_pool) -> list[int]:
    """Item lengths (bytes per page) of the DSpark draft pool's stage buffers; [] without one."""
    if draft_pool is None:
        return []
    return [int(x) for x in draft_pool.get_contiguous_buf_infos()[2]]


def fingerprint(kv_args, pool, server_args, attn_tp_size: int, draft_pool=None) -> dict:
    """What both sides of a transfer must agree on (module docstring)."""
    return {
        "kv_item_lens": [int(x) for x in kv_args.kv_item_lens],
        "kv_buffers": len(kv_args.kv_data_ptrs),
        "state_types": [str(getattr(st, "value", st)) for st in kv_args.state_types],
        "state_item_lens": [[int(x) for x in comp] for comp in kv_args.state_item_lens],
        "compress_ratios": [int(r) for r in pool.compress_ratios],
        "page_size": int(kv_args.page_size if getattr(kv_args, "page_size", None) else pool.page_size),
        "attn_tp_size": int(attn_tp_size),
        "pp_size": int(getattr(server_args, "pp_size", 1) or 1),
        "dspark_context": dspark_context(draft_pool),
    }


def mismatch(prefill: dict, decode: dict) -> str | None:
    """None when the layouts agree, else one line per differing key naming both values."""
    keys = sorted(set(prefill) | set(decode))
    diff = [f"{k}: prefill {prefill.get(k, '<missing>')!r}, decode {decode.get(k, '<missing>')!r}"
            for k in keys if prefill.get(k) != decode.get(k)]
    return "; ".join(diff) or None


# ---- hooks -----------------------------------------------------------------------------------------

def setup_state_kv_args_hook(result, kv_args, token_to_kv_pool, draft_token_to_kv_pool=None,
                             total_kv_layers=None, req_to_token_pool=None):
    """AFTER `disaggregation.utils.setup_state_kv_args` (module docstring)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import get_global_server_args

    from .kv_pool import DeepseekV41KVPool
    from .pd_state import set_pd_pool

    if not isinstance(token_to_kv_pool, DeepseekV41KVPool):
        return result
    if draft_token_to_kv_pool is not None:
        pad_kv_list(kv_args, token_to_kv_pool)
    check_regions(kv_args)
    setattr(kv_args, _ATTR, fingerprint(kv_args, token_to_kv_pool, get_global_server_args(),
                                          get_parallel().attn_tp_size, draft_token_to_kv_pool))
    set_pd_pool(token_to_kv_pool)
    logger.info("sglang-dsv41 PD layout: %s", getattr(kv_args, _ATTR))
    return result


def bootstrap_routes_hook(result, self):
    """AFTER `CommonKVBootstrapServer._setup_routes`: `ROUTE` stores (PUT) and returns (GET) the
    prefill's layout fingerprint (404 until one is stored)."""
    from aiohttp import web

    async def handle(request):
        if request.method == "PUT":
            self.sglang_dsv41_layout = await request.json()
            return web.Response(text="OK", status=200)
        layout = getattr(self, "sglang_dsv41_layout", None)
        if layout is None:
            return web.Response(text="no sglang-dsv41 layout registered by the prefill", status=404)
        return web.json_response(layout, status=200)

    self.app.router.add_route("*", ROUTE, handle)
    return result


def _bootstrap_url(mgr) -> str:
    host = mgr.bootstrap_host
    if mgr.dist_init_addr:
        host = mgr.dist_init_addr.rsplit(":", 1)[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{host}:{mgr.bootstrap_port}{ROUTE}"


def register_to_bootstrap_hook(result, self):
    """AFTER `CommonKVManager.register_to_bootstrap` (prefill): PUT this side's fingerprint."""
    layout = getattr(self.kv_args, _ATTR, None)
    if layout is None:
        return result
    try:
        r = requests.put(_bootstrap_url(self), json=layout, timeout=5)
        if r.status_code != 200:
            raise _fail(f"bootstrap server refused the layout fingerprint: {r.status_code} {r.text}")
    except requests.RequestException as e:
        raise _fail(f"cannot register the layout fingerprint at {_bootstrap_url(self)}: {e}") from e
    return result


def try_ensure_parallel_info_hook(original, self, bootstrap_addr):
    """AROUND `CommonKVManager.try_ensure_parallel_info` (decode): SGLang's fetch, then the layout
    check against the prefill at `bootstrap_addr` (once per address)."""
    ours = getattr(self.kv_args, _ATTR, None)
    checked = self.__dict__.setdefault("_sglang_dsv41_checked", set())
    if ours is None or bootstrap_addr in checked:
        return original(self, bootstrap_addr)
    if not original(self, bootstrap_addr):
        return False
    try:
        r = requests.get(f"http://{bootstrap_addr}{ROUTE}", timeout=5)
    except requests.RequestException as e:
        logger.warning("sglang-dsv41 PD: layout of the prefill at %s not fetched yet: %s", bootstrap_addr, e)
        self.prefill_info_table.pop(bootstrap_addr, None)
        return False
    if r.status_code != 200:
        self.prefill_info_table.pop(bootstrap_addr, None)
        raise _fail(f"the prefill at {bootstrap_addr} published no sglang-dsv41 layout ({r.status_code} "
                    f"{r.text.strip()}): is it a V4.1 prefill server with the sglang-dsv41 plugin?")
    diff = mismatch(r.json(), ours)
    if diff is not None:
        self.prefill_info_table.pop(bootstrap_addr, None)
        raise _fail(f"the prefill at {bootstrap_addr} and this decode server have different KV layouts, "
                    f"refusing to transfer: {diff}")
    checked.add(bootstrap_addr)
    return True
