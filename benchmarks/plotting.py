"""The benchmarks' matplotlib figures: one import (the Agg backend: neither machine has a display)
and one save (laid out, written, closed). matplotlib is optional where a benchmark says so (the CPU
machine lacks it): `pyplot()` is then None and the benchmark notes why there is no PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot(required: bool = False) -> Any:
    """`matplotlib.pyplot` on the Agg backend; None without matplotlib (ImportError if `required`)."""
    try:
        import matplotlib
    except ImportError:
        if required:
            raise
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path, dpi: float | None = None) -> None:
    """Lay `fig` out, write it to `path` (dpi None: matplotlib's default) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
