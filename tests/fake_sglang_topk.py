"""A fake of SGLang 0.5.17's `sglang.kernels.ops.attention.dsv4.topk` for CPU tests of
`kernels.topk_sglang` and benchmarks/topk_kernels.py: it checks the arguments the way SGLang's kernels
do (dtypes, shapes, strides, 16-byte alignment for v2, non-negative lengths ≤ the width, a v2 plan
made from the same lengths), ranks with `torch.topk` — min(k, seq_len) columns whatever their
scores, a row of ≤ k columns as 0 … seq_len − 1, the chosen columns in descending-score order —
and applies the page transform through the page table it is given."""
from __future__ import annotations

import torch

Tensor = torch.Tensor


class FakeTopk:
    """SGLang's `dsv4.topk` public functions, computed with torch; records (name, k) calls."""

    def __init__(self, fail: bool = False, stray: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail
        self.stray = stray      # a column written into the last slot of rows of > k columns
        self.planned: list[Tensor] = []

    @staticmethod
    def _check(scores, seq_lens, page_tables, out, page_size) -> None:
        n = scores.shape[0]
        assert scores.dtype == torch.float32 and scores.dim() == 2 and scores.stride(1) == 1
        assert seq_lens.dtype == torch.int32 and seq_lens.shape == (n,) and seq_lens.is_contiguous()
        assert bool((seq_lens >= 0).all()), "SGLang reads lengths as uint32"
        assert bool((seq_lens <= scores.shape[1]).all())
        assert page_tables.dtype == torch.int32 and page_tables.shape[0] == n and page_tables.stride(1) == 1
        assert out.dtype == torch.int32 and out.shape[0] == n and out.is_contiguous()
        assert page_size >= 1 and page_size & (page_size - 1) == 0

    def _rank(self, scores, seq_lens, page_tables, out, page_size) -> None:
        k, bits = out.shape[1], page_size.bit_length() - 1
        out.fill_(-7)                                       # garbage where nothing is written
        for i in range(scores.shape[0]):
            n = int(seq_lens[i])
            if n <= k:
                raw = torch.arange(n)
            else:                                           # reversed: the order is not ascending
                raw = torch.topk(scores[i, :n], k).indices.flip(0)
            pages = page_tables[i, (raw >> bits)].to(torch.int64)
            out[i, :raw.numel()] = ((pages << bits) | (raw & (page_size - 1))).to(torch.int32)
            out[i, raw.numel():] = -1
            if self.stray is not None and n > k:
                out[i, -1] = self.stray

    def topk_transform_512(self, scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices=None):
        self.calls.append(("v1", out_page_indices.shape[1]))
        if self.fail:
            raise RuntimeError("nvcc: not found")
        assert out_page_indices.shape[1] in (512, 1024), "Only support topk=512 or 1024"
        self._check(scores, seq_lens, page_tables, out_page_indices, page_size)
        self._rank(scores, seq_lens, page_tables, out_page_indices, page_size)

    def plan_topk_v2(self, seq_lens, static_threshold=0):
        meta = seq_lens.new_zeros(seq_lens.shape[0] + 1, 2)
        meta[1:, 1] = seq_lens
        self.planned.append(meta)
        return meta

    def topk_transform_512_v2(self, scores, seq_lens, page_tables, out_page_indices, page_size, metadata,
                              out_raw_indices=None):
        self.calls.append(("v2", out_page_indices.shape[1]))
        if self.fail:
            raise RuntimeError("nvcc: not found")
        assert 0 < out_page_indices.shape[1] <= 2048
        assert scores.stride(0) % 4 == 0 and scores.data_ptr() % 16 == 0, "16-byte vectorised loads"
        assert any(m is metadata for m in self.planned) and torch.equal(metadata[1:, 1], seq_lens)
        self._check(scores, seq_lens, page_tables, out_page_indices, page_size)
        self._rank(scores, seq_lens, page_tables, out_page_indices, page_size)
