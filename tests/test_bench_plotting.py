"""benchmarks/plotting.py: pyplot() without matplotlib is None (or ImportError when required);
with it (the GPU machine; importorskip here) the Agg backend, and save_png writes and closes."""
from __future__ import annotations

import sys

import pytest

from benchmark_loader import load_benchmark


@pytest.fixture
def plotting():
    return load_benchmark("plotting.py")


def test_without_matplotlib(plotting, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` raises ImportError
    assert plotting.pyplot() is None
    with pytest.raises(ImportError):
        plotting.pyplot(required=True)


def test_save_png_writes_and_closes(plotting, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    plt = plotting.pyplot()
    import matplotlib

    assert matplotlib.get_backend().lower() == "agg"
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([1, 2, 3], [3, 1, 2])
    plotting.save_png(fig, tmp_path / "p.png", dpi=50)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.number not in plt.get_fignums()
