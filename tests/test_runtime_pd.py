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
    c = pd_layout.fingerprint(_kv_args(_pool()), _pool(), dspark, 2)
    c["page_size"] = 4
    diff = pd_layout.mismatch(a, c)
    assert "attn_tp_size: prefill 1, decode 2" in diff and "dspark_block: prefill 0, decode 6" in diff
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
        url = f"http://127.0.0.1:{port}{pd_layout.ROUTE}"
        for _ in range(50):
            try:
                r = requests.get(url, timeout=5)
                break
            except requests.ConnectionError:
                import time
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


# ---- PD + DSpark: refused until the draft pool's state is transferred ---------------------------

@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("draft_worker", [False, True], ids=["target", "draft"])
def test_pd_with_dspark_is_refused_at_start_up(mode: str, draft_worker: bool) -> None:
    """Either PD role with `--speculative-algorithm DSPARK`, on the target's pool and the draft
    worker's, stops start-up naming both flags (docs/pd.md "Limits"); PD alone passes the check."""
    from sglang_dsv41.runtime.sglang_pool import check_pool_flags

    def kvc(spec: str | None) -> SimpleNamespace:
        args = SimpleNamespace(speculative_algorithm=spec, speculative_num_draft_tokens=6 if spec else None,
                               disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
                               enable_hierarchical_cache=False, enable_unified_memory=False)
        return SimpleNamespace(is_hybrid_swa=True, is_draft_worker=draft_worker and spec is not None,
                               server_args=args, kv_cache_dtype=torch.bfloat16)

    with pytest.raises(RuntimeError, match="--disaggregation-mode with --speculative-algorithm DSPARK"):
        check_pool_flags(kvc("DSPARK"))
    check_pool_flags(kvc(None))
