"""PD pieces of the V4.1 pool without servers (docs/pd.md; `runtime/pd_state.py`,
`runtime/pd_layout.py`): the boundary-row rule and its buffers, the hooked index function as
prefill and decode see it, the decode-side restore, the registration checks, the layout
fingerprint and the decode-side refusal of a mismatched prefill."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import tiny_config_dict
from sglang_dsv41.runtime import pd_layout, pd_state
from sglang_dsv41.runtime.kv_rows import pair_ring_slots

TINY = DeepseekV41Config.from_dict(tiny_config_dict(1000)).text


def _draft_pool():
    from sglang_dsv41.runtime.dspark_pool import DeepseekV41DSparkPool

    return DeepseekV41DSparkPool(TINY, size=64, page_size=2, device="cpu")


def _pool(pair_slots: int = 2, rows: int = 5):
    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    return DeepseekV41KVPool(TINY, size=64, size_swa=32, page_size=2, num_req_rows=rows, device="cpu",
                             pair_slots=pair_slots)


@pytest.fixture(scope="module")
def runtime_hooks():
    from sglang_dsv41 import hooks

    return hooks.install_hooks(("runtime",))


# ---- the boundary-row rule ---------------------------------------------------------------------

def test_boundary_row_is_the_pending_pair_of_an_odd_prompt() -> None:
    assert pd_state.boundary_rows(3, 42, ring=2).size == 0           # even: nothing pending
    assert pd_state.boundary_rows(3, 0, ring=2).size == 0
    assert pd_state.boundary_rows(3, 41, ring=2).tolist() == [3 * 2 + 20 % 2]
    assert pd_state.boundary_rows(3, 101, ring=2).tolist() == [6]    # sglang#38819's N = 101: slot 0 of ring 2
    assert pd_state.boundary_rows(3, 101, ring=8).tolist() == [3 * 8 + 2]  # ... and slot 50 mod 8 = 2 of ring 8
    assert pd_state.boundary_rows(0, 1, ring=4).dtype == np.int32


def test_pair_ring_buffers_are_one_row_per_item_even_and_nonzero() -> None:
    for slots in (2, pair_ring_slots(5)):
        pool = _pool(pair_slots=slots)
        ptrs, lens, items = pool.get_c128_state_buf_infos()
        c = pool.runtime_caches
        assert len(ptrs) == 2 * len(c.pair_kv) and len(ptrs) % 2 == 0
        assert items == [TINY.head_dim * 4] * len(ptrs)                 # one ring row, whatever the ring
        assert lens == [pool.runtime_caches.num_req_rows * slots * TINY.head_dim * 4] * len(ptrs)
        first = min(c.pair_kv)
        assert ptrs[:2] == [c.pair_kv[first].data_ptr(), c.pair_score[first].data_ptr()]
        assert pool.get_ring_size(128) == slots


def test_rows_land_in_each_sides_own_slot() -> None:
    """Prefill ring 2, decode ring 8 (speculative decode): the bytes of the pending pair of
    N = 101 go from the prefill's slot to the decode's slot of the same position."""
    p, d = _pool(pair_slots=2), _pool(pair_slots=8)
    src = min(p.runtime_caches.pair_kv)
    n, prow, drow = 101, 1, 3
    want = torch.randn(TINY.head_dim)
    p.runtime_caches.pair_kv[src][prow, p.runtime_caches.pair_slot(torch.tensor(n - 1))] = want
    (i,), (j,) = pd_state.boundary_rows(prow, n, 2), pd_state.boundary_rows(drow, n, 8)
    d.runtime_caches.pair_kv[src].view(-1, TINY.head_dim)[j] = p.runtime_caches.pair_kv[src].view(-1, TINY.head_dim)[i]
    d.clear_c128_req_state(drow)
    pd_state.restore_after_transfer(d.runtime_caches, [drow], [list(range(n))], lambda ids: ids)
    kv, _score, pos = d.runtime_caches.pending_pair(src, torch.tensor([drow]), torch.tensor([n - 1]))
    assert torch.equal(kv[0], want) and int(pos[0]) == n - 1


def test_index_hook_reaches_prefill_and_decode(runtime_hooks) -> None:
    from sglang.srt.disaggregation import decode, prefill, utils

    assert prefill.get_dsv4_c128_state_indices is utils.get_dsv4_c128_state_indices
    assert decode.get_dsv4_c128_state_indices is utils.get_dsv4_c128_state_indices
    saved = pd_state._pd_pool
    try:
        pd_state._pd_pool = None                               # no V4.1 pool: SGLang's rule (V4 ring)
        assert utils.get_dsv4_c128_state_indices(2, 300, online=False, ring_size=256).tolist() == [2 * 2 + 299 % 256 // 128]
        pool = _pool(pair_slots=4)
        pd_state.set_pd_pool(pool)
        assert prefill.get_dsv4_c128_state_indices(2, 41, online=False, ring_size=4).tolist() == [2 * 4 + 20 % 4]
        assert decode.get_dsv4_c128_state_indices(2, 40, online=False, ring_size=4).size == 0
    finally:
        pd_state._pd_pool = saved


def test_restore_sets_positions_and_engram_history() -> None:
    pool = _pool(pair_slots=4)
    c = pool.runtime_caches
    K = c.engram_history.history_len
    for pos in c.pair_position.values():
        pos.fill_(7)                                           # stale values of an earlier request
    pd_state.restore_after_transfer(c, [1, 2], [list(range(10, 19)), [5, 6]], lambda ids: ids + 100)
    for pos in c.pair_position.values():
        assert pos[1].tolist() == [8, -1, -1, -1]                # N = 9: pair of 8 pending, slot 4 mod 4
        assert pos[2].tolist() == [-1] * 4                     # N = 2: nothing pending
        assert pos[0].tolist() == [7] * 4                      # other rows untouched
    assert c.engram_history.end[1] == 9 and c.engram_history.end[2] == 2
    assert c.engram_history.ids[1].tolist() == [100 + i for i in range(19 - K, 19)]
    assert c.engram_history.ids[2].tolist() == [-1] * (K - 2) + [105, 106]


# ---- registration checks and the fingerprint ----------------------------------------------------

def _kv_args(pool, state_types=("swa", "c128_state")):
    kv = pool.get_contiguous_buf_infos()                       # two global buffers (latents + index keys)
    states = [pool.get_state_buf_infos(), pool.get_c128_state_buf_infos()]
    return SimpleNamespace(kv_data_ptrs=kv[0], kv_data_lens=kv[1], kv_item_lens=kv[2], page_size=2,
                           state_types=list(state_types), state_data_ptrs=[s[0] for s in states],
                           state_data_lens=[s[1] for s in states], state_item_lens=[s[2] for s in states])


def test_regions_are_checked() -> None:
    pool = _pool()
    args = _kv_args(pool)
    pd_layout.check_regions(args)
    odd = _kv_args(pool)
    odd.kv_data_ptrs, odd.kv_data_lens, odd.kv_item_lens = (x[:1] for x in (odd.kv_data_ptrs, odd.kv_data_lens,
                                                                             odd.kv_item_lens))
    with pytest.raises(RuntimeError, match="1 buffers; SGLang's non-MLA transfer halves"):
        pd_layout.check_regions(odd)
    empty = _kv_args(pool)
    empty.state_data_lens[1] = [0] + empty.state_data_lens[1][1:]
    with pytest.raises(RuntimeError, match=r"state c128_state: buffers \[0\] are empty"):
        pd_layout.check_regions(empty)


def test_fingerprint_ignores_ring_size_and_names_every_difference() -> None:
    plain = SimpleNamespace(speculative_algorithm=None)
    a = pd_layout.fingerprint(_kv_args(_pool(pair_slots=2)), _pool(pair_slots=2), plain, 1)
    b = pd_layout.fingerprint(_kv_args(_pool(pair_slots=8)), _pool(pair_slots=8), plain, 1)
    assert pd_layout.mismatch(a, b) is None                     # boundary row: rings may differ
    dspark = SimpleNamespace(speculative_algorithm="DSPARK", speculative_num_draft_tokens=6)
    c = pd_layout.fingerprint(_kv_args(_pool()), _pool(), dspark, 2, draft_pool=_draft_pool())
    c["page_size"] = 4
    diff = pd_layout.mismatch(a, c)
    row = 2 * TINY.head_dim * 2                                 # bf16 row of D per slot, page of 2
    assert "attn_tp_size: prefill 1, decode 2" in diff and f"dspark_context: prefill [], decode {[row] * 3}" in diff
    assert "page_size: prefill 2, decode 4" in diff


class _Resp:
    def __init__(self, status: int, body) -> None:
        self.status_code, self._body, self.text = status, body, str(body)

    def json(self):
        return self._body


def _decode_mgr(layout: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_args=SimpleNamespace(sglang_dsv41_layout=layout), prefill_info_table={})


def _sglang_fetch(mgr, addr):
    mgr.prefill_info_table[addr] = "info"
    return True


def test_decode_refuses_a_mismatched_prefill(monkeypatch) -> None:
    ours = pd_layout.fingerprint(_kv_args(_pool()), _pool(), SimpleNamespace(speculative_algorithm=None), 1)
    theirs = {**ours, "kv_item_lens": [2 * 999, 2 * 999]}
    monkeypatch.setattr(pd_layout.requests, "get", lambda url, timeout: _Resp(200, theirs))
    mgr = _decode_mgr(ours)
    with pytest.raises(RuntimeError, match=r"different KV layouts.*kv_item_lens: prefill \[1998, 1998\], decode"):
        pd_layout.try_ensure_parallel_info_hook(_sglang_fetch, mgr, "127.0.0.1:9")
    assert mgr.prefill_info_table == {}                        # nothing cached: every retry refuses again
    monkeypatch.setattr(pd_layout.requests, "get", lambda url, timeout: _Resp(404, "none"))
    with pytest.raises(RuntimeError, match="published no sglang-dsv41 layout"):
        pd_layout.try_ensure_parallel_info_hook(_sglang_fetch, mgr, "127.0.0.1:9")
    monkeypatch.setattr(pd_layout.requests, "get", lambda url, timeout: _Resp(200, dict(ours)))
    assert pd_layout.try_ensure_parallel_info_hook(_sglang_fetch, mgr, "127.0.0.1:9") is True
    assert mgr.prefill_info_table == {"127.0.0.1:9": "info"}


def test_other_pools_are_untouched(monkeypatch) -> None:
    calls = []
    mgr = SimpleNamespace(kv_args=SimpleNamespace(), prefill_info_table={})
    assert pd_layout.try_ensure_parallel_info_hook(lambda m, a: calls.append(a) or True, mgr, "x:1") is True
    assert calls == ["x:1"]
    args = SimpleNamespace()
    assert pd_layout.setup_state_kv_args_hook("r", args, object()) == "r" and not vars(args)


def test_bootstrap_route_round_trip() -> None:
    """The prefill's bootstrap server (SGLang's, with our route) stores and serves the fingerprint."""
    import requests

    from server_helpers import free_port
    from sglang_dsv41 import hooks
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    hooks.install_hooks(("runtime",))
    port = free_port()
    server = CommonKVBootstrapServer("127.0.0.1", port)
    try:
        import time

        url = f"http://127.0.0.1:{port}{pd_layout.ROUTE}"
        deadline, r = time.monotonic() + 120, None      # its thread may wait long for a core on a loaded host
        while r is None:
            try:
                r = requests.get(url, timeout=30)
            except requests.ConnectionError:
                assert time.monotonic() < deadline, f"the bootstrap server is not listening on {port} after 120 s"
                time.sleep(0.1)
        assert r.status_code == 404
        layout = {"page_size": 2, "kv_item_lens": [1, 2]}
        mgr = SimpleNamespace(kv_args=SimpleNamespace(sglang_dsv41_layout=layout), bootstrap_host="127.0.0.1",
                              dist_init_addr=None, bootstrap_port=port)
        pd_layout.register_to_bootstrap_hook(None, mgr)
        assert requests.get(url, timeout=5).json() == layout
    finally:
        server.close()


def test_serve_adds_the_cpu_pd_environment(tmp_path, monkeypatch) -> None:
    """`sglang-dsv41 serve --disaggregation-mode ...` on CPU sets Mooncake-over-TCP and the other
    PD variables (cpu.md §5), keeping values the user set; without PD it sets none of them."""
    from sglang_dsv41.runtime.cpu_env import PD_CPU_ENVIRONMENT
    from sglang_dsv41.serve import build_launch

    for k in PD_CPU_ENVIRONMENT:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SGLANG_HOST_IP", "10.0.0.7")
    pd = build_launch(["--device", "cpu", "--model-path", str(tmp_path), "--disaggregation-mode", "prefill"]).env
    assert pd["MC_FORCE_TCP"] == "1" and pd["MOONCAKE_PROTOCOL"] == "tcp"
    assert pd["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] == "0" and pd["SGLANG_HOST_IP"] == "10.0.0.7"
    plain = build_launch(["--device", "cpu", "--model-path", str(tmp_path)]).env
    assert not {"MC_FORCE_TCP", "MOONCAKE_PROTOCOL", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"} & set(plain)


# ---- PD + DSpark: the draft context in kv_data, refused on CPU -----------------------------------

@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("draft_worker", [False, True], ids=["target", "draft"])
def test_pd_with_dspark_is_refused_on_cpu_only(mode: str, draft_worker: bool) -> None:
    """Either PD role with `--speculative-algorithm DSPARK`, on the target's pool and the draft
    worker's, stops start-up on CPU (SGLang's DSpark worker is CUDA-only) and passes on CUDA."""
    from sglang_dsv41.runtime.sglang_pool import check_pool_flags

    def kvc(spec: str | None, device: str) -> SimpleNamespace:
        args = SimpleNamespace(speculative_algorithm=spec, speculative_num_draft_tokens=6 if spec else None,
                               disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
                               enable_hierarchical_cache=False, enable_unified_memory=False, device=device)
        return SimpleNamespace(is_hybrid_swa=True, is_draft_worker=draft_worker and spec is not None,
                               server_args=args, kv_cache_dtype=torch.bfloat16)

    with pytest.raises(RuntimeError, match="--disaggregation-mode with --speculative-algorithm DSPARK on cpu"):
        check_pool_flags(kvc("DSPARK", "cpu"))
    check_pool_flags(kvc("DSPARK", "cuda"))
    check_pool_flags(kvc(None, "cpu"))


class _MemmoveEngine:
    """Mooncake's `batch_transfer_sync` as a local memmove (both pools live in this process)."""

    def batch_transfer_sync(self, session, srcs, dsts, lens) -> int:
        import ctypes

        for s, d, n in zip(srcs, dsts, lens):
            ctypes.memmove(d, s, n)
        return 0


def _send(src: list, dst: list, items: list, src_idx, dst_idx) -> None:
    """SGLang's own non-MLA send (`MooncakeKVManager._send_kvcache_generic`: K/V halving, block
    grouping, address arithmetic) with the memmove engine."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    mgr = object.__new__(MooncakeKVManager)
    mgr.is_mla_backend = mgr.is_hybrid_mla_backend = mgr.enable_custom_mem_pool = False
    mgr.kv_args, mgr.engine = SimpleNamespace(prefill_start_layer=0), _MemmoveEngine()
    assert mgr._send_kvcache_generic("s", src, dst, items, np.asarray(src_idx, dtype=np.int32),
                                     np.asarray(dst_idx, dtype=np.int32), executor=None) == 0


def _side(pair_slots: int, draft: bool):
    """One server's pool (+ DSpark draft pool) and its kv_args as `setup_state_kv_args_hook` leaves them."""
    pool, dpool = _pool(pair_slots=pair_slots), (_draft_pool() if draft else None)
    args = _kv_args(pool)
    if dpool is not None:                                       # SGLang appends the draft's buffers
        for lst, extra in zip((args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens),
                              dpool.get_contiguous_buf_infos()):
            lst += extra
        pd_layout.pad_kv_list(args, pool)
    pd_layout.check_regions(args)
    spec = SimpleNamespace(speculative_algorithm="DSPARK" if draft else None)
    return pool, dpool, args, pd_layout.fingerprint(args, pool, spec, 1, draft_pool=dpool)


@pytest.mark.parametrize("prefill_ring,decode_ring,draft,n", [
    (2, 8, False, 9), (pair_ring_slots(5 + 1), pair_ring_slots(7 + 1), True, 9),
    (pair_ring_slots(7 + 1), pair_ring_slots(5 + 1), True, 25), (8, 16, True, 25)],
    ids=["plain-to-spec-ring", "dspark-gamma-5-to-7", "dspark-gamma-7-to-5", "dspark-gamma-5-to-7-slot-12"])
def test_state_transfer_lands_in_the_decode_layout(prefill_ring, decode_ring, draft, n) -> None:
    """A request of odd length N through SGLang's send: KV pages (+ the DSpark context rows), the
    SWA rows and the boundary row of the pair ring land where the decode's layout (its own ring
    size) reads them; the fingerprints agree although the rings differ — DSpark with prefill γ 5
    and decode γ 7 (rings 8 → 16) and the reverse; N = 25 puts the pending pair in slot 12 of a
    16-slot ring and slot 4 of an 8-slot one."""
    p, pdraft, pargs, pfp = _side(prefill_ring, draft)
    d, ddraft, dargs, dfp = _side(decode_ring, draft)
    assert pd_layout.mismatch(pfp, dfp) is None
    if draft:                                                   # 2 global + 3 stages + 1 pad
        assert len(pargs.kv_data_ptrs) == 6 and pargs.kv_item_lens[-1] == pd_layout.PAD_ITEM
    g = torch.Generator().manual_seed(0)
    for b in p.full_kv_pool.buffers + p.swa_kv_pool.buffers + (pdraft.buffers if draft else []):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    prow, drow = 1, 3                                           # odd n: the pair of position n − 1 is pending
    src = min(p.runtime_caches.pair_kv)
    want = torch.randn(TINY.head_dim, generator=g)
    p.runtime_caches.pair_kv[src][prow, p.runtime_caches.pair_slot(torch.tensor(n - 1))] = want
    ppages, dpages = [1, 2, 3, 4, 5], [7, 11, 12, 13, 20]       # the pages travel whatever n
    _send(pargs.kv_data_ptrs, dargs.kv_data_ptrs, pargs.kv_item_lens, ppages, dpages)
    for st, (sp, dp, it) in enumerate(zip(pargs.state_data_ptrs, dargs.state_data_ptrs, pargs.state_item_lens)):
        if pargs.state_types[st] == "c128_state":
            sidx, didx = pd_state.boundary_rows(prow, n, prefill_ring), pd_state.boundary_rows(drow, n, decode_ring)
        else:
            sidx, didx = [1], [4]                               # SWA pages of the last window
        _send(sp, dp, it, sidx, didx)
    def pages(b, idx):                                         # slot-major rows (as bytes), page of 2
        u = b.view(torch.uint8)
        return u.view(-1, 2, u.shape[-1])[idx]

    pairs = list(zip(p.full_kv_pool.buffers, d.full_kv_pool.buffers))
    pairs += list(zip(pdraft.buffers, ddraft.buffers)) if draft else []
    assert all(torch.equal(pages(pb, ppages), pages(db, dpages)) for pb, db in pairs)
    assert all(torch.equal(pages(pb, [1]), pages(db, [4])) for pb, db in zip(p.swa_kv_pool.buffers,
                                                                             d.swa_kv_pool.buffers))
    d.clear_c128_req_state(drow)
    pd_state.restore_after_transfer(d.runtime_caches, [drow], [list(range(n))], lambda ids: ids)
    kv, _score, pos = d.runtime_caches.pending_pair(src, torch.tensor([drow]), torch.tensor([n - 1]))
    assert torch.equal(kv[0], want) and int(pos[0]) == n - 1


def test_plain_prefill_cannot_feed_a_dspark_decode() -> None:
    """The decode's draft reads the prompt's context rows, which only a DSpark prefill writes: the
    fingerprints differ on `dspark_context` (and the kv buffer count), so the decode refuses."""
    _, _, _, plain = _side(2, False)
    _, _, _, spec = _side(8, True)
    diff = pd_layout.mismatch(plain, spec)
    assert diff is not None and "dspark_context: prefill []" in diff and "kv_buffers: prefill 2, decode 6" in diff


# ---- CPU: no busy-wait while requests wait on the peer (runtime/pd_cpu.py) ------------------------

def test_cpu_pd_scheduler_waits_instead_of_spinning(runtime_hooks, monkeypatch) -> None:
    """`Scheduler.on_idle` (hooked): a CPU PD server with requests only in its disaggregation queues
    waits on SGLang's idle poller; a fully idle, GPU or non-PD server is left to SGLang."""
    from sglang_dsv41.runtime import pd_cpu

    monkeypatch.delenv(pd_cpu.ENV, raising=False)         # the default wait, whatever this shell set
    assert any(s.impl.endswith("pd_cpu:on_idle_hook") for s in runtime_hooks)       # installed and verified

    class Poller:
        def __init__(self) -> None:
            self.waits: list[int] = []

        def poll(self, ms: int) -> None:
            self.waits.append(ms)

    def sched(device: str, mode: str, idle: bool) -> SimpleNamespace:
        return SimpleNamespace(server_args=SimpleNamespace(device=device, disaggregation_mode=mode),
                               is_fully_idle=lambda: idle, idle_sleeper=SimpleNamespace(poller=Poller()))

    waiting = sched("cpu", "decode", idle=False)
    assert pd_cpu.on_idle_hook("r", waiting) == "r" and waiting.idle_sleeper.poller.waits == [pd_cpu.WAIT_MS]
    for other in (sched("cpu", "prefill", True), sched("cuda", "decode", False), sched("cpu", "null", False)):
        pd_cpu.on_idle_hook(None, other)
        assert other.idle_sleeper.poller.waits == []
    t0 = __import__("time").perf_counter()
    pd_cpu.on_idle_hook(None, SimpleNamespace(server_args=waiting.server_args, is_fully_idle=lambda: False,
                                              idle_sleeper=None))
    assert __import__("time").perf_counter() - t0 >= pd_cpu.WAIT_MS / 1000 * 0.9   # no poller: a plain sleep
