"""Shared pytest set-up.

* `gpu` tests are skipped when CUDA is absent (CI has no GPU) — a skip is not a pass: they are
  run on the GPU machine and logged in docs/validation.md.
* `tiny_checkpoint`: one tiny checkpoint per test session, made with the real writer.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch


# Tiny CPU forwards are dominated by per-op overhead; on a 2-core machine shared with SGLang
# server subprocesses, one intra-op thread is both faster and steadier.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine; see docs/validation.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sglang_dsv41.checkpoint.synth import make_checkpoint

    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0, progress=False)
