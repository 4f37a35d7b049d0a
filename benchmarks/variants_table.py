"""The kernel variants of `decode_step.py --variants` as one markdown table per component (issue 21).

    python benchmarks/variants_table.py DIR/decode_step_variants.json

Rows are the variants, columns the decode batches N; each cell is the CUDA-graph replay µs, then its
ratio to the component's first variant (the baseline `kernel_variants.components` lists first), and
the agreement figure the variant recorded (BF16 ulps of the output scale, selection agreement, or
the ulp distance). The fastest variant per N is in bold; a variant that failed shows its error.
Nothing is decided here: the table is what the person reading the run flips defaults from.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

AGREEMENT_KEYS = ("max_scale_ulps", "selection_agreement", "max_ulps")


def _cell(entry: dict | None, base_us: float | None, best: bool) -> str:
    if entry is None:
        return "—"
    if "error" in entry:
        return f"error: {str(entry['error'])[:40]}"
    us = entry.get("graph_us")
    if us is None:
        return "—"
    text = f"{us:,.1f}"
    if base_us:
        text += f" ({us / base_us:.2f}×)"
    agree = next((f"{k.split('_')[-1]} {entry[k]:g}" for k in AGREEMENT_KEYS if k in entry), "")
    text = f"**{text}**" if best else text
    return f"{text} {agree}".strip()


def tables(result: dict) -> str:
    """Markdown: one table per component over the batches of `result['rows']` ({N: {component: {variant: …}}})."""
    rows = result["rows"]
    batches = sorted(rows, key=int)
    components: list[str] = []
    for n in batches:
        components += [c for c in rows[n] if c not in components]
    out = []
    for comp in components:
        variants: list[str] = []
        for n in batches:
            variants += [v for v in rows[n].get(comp, {}) if v not in variants]
        out.append(f"### {comp}\n\n| variant | " + " | ".join(f"N = {n}" for n in batches) + " |")
        out.append("|---|" + "---|" * len(batches))
        for v in variants:
            cells = []
            for n in batches:
                entries = rows[n].get(comp, {})
                timed = {k: e["graph_us"] for k, e in entries.items() if isinstance(e, dict) and "graph_us" in e}
                base = entries.get(next(iter(entries), None), {}) if entries else {}
                best = bool(timed) and v in timed and timed[v] == min(timed.values())
                cells.append(_cell(entries.get(v), base.get("graph_us"), best))
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    args = ap.parse_args(argv)
    print(tables(json.loads(args.path.read_text())))


if __name__ == "__main__":
    main()
