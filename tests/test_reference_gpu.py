"""The reference runs unchanged on a CUDA device and agrees with the CPU run (GPU machine only).

Bound: fp32 logits within 1e-6 absolute of the CPU logits — in practice bit-identical, since
the reference evaluates every fp32 formula (matmuls, norms, RoPE, softmaxes, gates) in float64
and rounds once, so device libraries cannot disagree past the last float64 bits — and greedy
tokens equal for 32 steps.
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.reference.state import NumericsProfile

PROMPT = [(7 * i + 3) % 997 + 3 for i in range(48)]  # > window (8), topk (4) and candidate span (12)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["none", "fp8", "fp4"])
def test_reference_on_cuda_matches_cpu(tiny_checkpoint, cache: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    numerics = NumericsProfile.parse(cache)
    cpu = ReferenceModel.from_checkpoint(tiny_checkpoint, numerics, device="cpu")
    gpu = ReferenceModel.from_checkpoint(tiny_checkpoint, numerics, device="cuda")
    lc = cpu.forward(cpu.new_request(), PROMPT).logits
    lg = gpu.forward(gpu.new_request(), PROMPT).logits.cpu()
    assert torch.isfinite(lg).all()
    diff = (lc - lg).abs().max().item()
    print(f"cache={cache}: max |logit_cpu - logit_cuda| = {diff:.3g}")
    assert diff <= 1e-6
    assert cpu.generate(PROMPT, 32) == gpu.generate(PROMPT, 32)
