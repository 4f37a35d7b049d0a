"""`sglang-dsv41 verify DIR`: check a checkpoint directory against its own config.json
(spec `model.md` §1, §2; the expected set is `names.stored_inventory(cfg)`).

Header checks (always; they read only the safetensors headers, so a 511 GB checkpoint takes
seconds): the index parses and names existing shards; every expected tensor is present with an
accepted dtype and the expected shape (FP8 weights F8_E4M3 with [⌈out/32⌉, ⌈in/32⌉] scales,
packed FP4 U8/I8/F4 with [out, in/32] scales, Engram rows with [rows, d/32] scales, plain
tensors BF16/F16/F32); no unexpected tensors; index and shard headers agree; the index's
`total_size` equals the bytes the headers describe.

Value scan (only when the checkpoint is at most `value_scan_max_bytes`, reported otherwise):
no UE8M0 scale byte is 255 (NaN), no E4M3 weight holds a NaN code, plain tensors are finite.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, DeepseekV41Config
from .codecs import scale_bytes
from .loader import stored_problem
from .names import tensor_inventory
from .reader import INDEX_FILE, CheckpointFormatError, CheckpointReader

DEFAULT_VALUE_SCAN_MAX_BYTES = 2 << 30
_MAX_LISTED = 50


@dataclass
class ComponentCount:
    expected: int = 0
    present: int = 0
    nbytes: int = 0


@dataclass
class VerifyReport:
    """Outcome of `verify_checkpoint`. `ok` is True iff `problems` is empty."""

    path: Path
    problems: list[str] = field(default_factory=list)
    components: dict[str, ComponentCount] = field(default_factory=dict)
    n_files: int = 0
    n_tensors: int = 0
    total_bytes: int = 0
    config_summary: str = ""
    value_scan: str = "not run"

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        lines = [f"checkpoint {self.path}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}"]
        if self.config_summary:
            lines.append(f"config: {self.config_summary}")
        if self.n_files:
            lines.append(f"files: {self.n_files} shard(s), {self.n_tensors} tensors, {self.total_bytes / 1e6:,.1f} MB")
        if self.components:
            lines.append(f"  {'component':<10} {'present':>9} {'expected':>9} {'MB':>12}")
            for name, c in sorted(self.components.items()):
                lines.append(f"  {name:<10} {c.present:>9} {c.expected:>9} {c.nbytes / 1e6:>12,.1f}")
        lines.append(f"value scan: {self.value_scan}")
        if self.problems:
            lines.append("problems:")
            lines += [f"  - {p}" for p in self.problems[:_MAX_LISTED]]
            if len(self.problems) > _MAX_LISTED:
                lines.append(f"  … and {len(self.problems) - _MAX_LISTED} more")
        return "\n".join(lines)


def _config_summary(cfg: DeepseekV41Config) -> str:
    t = cfg.text
    vision = f"vision {cfg.vision.num_hidden_layers} blocks" if cfg.vision is not None else "no vision"
    return (f"{t.num_hidden_layers} layers, hidden {t.hidden_size}, {t.n_routed_experts} experts, vocab {t.vocab_size}, "
            f"Engram layers {list(t.engram_layer_ids)}, {vision}, DSpark {t.num_nextn_predict_layers} stage(s)")


def _scan_values(reader: CheckpointReader, names: dict[str, str], progress: bool) -> list[str]:
    """Value problems of the given tensors (name → expected inventory dtype)."""
    from tqdm import tqdm

    problems: list[str] = []
    for name, kind in tqdm(sorted(names.items()), desc="verify: value scan", unit="tensor", disable=not progress):
        t = reader.get(name)
        if kind == "F8_E8M0":
            n_nan = int((scale_bytes(t) == 255).sum())
            if n_nan:
                problems.append(f"{name}: {n_nan} scale byte(s) are 255 (NaN)")
        elif kind == "F8_E4M3":
            n_nan = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
            if n_nan:
                problems.append(f"{name}: {n_nan} E4M3 value(s) are NaN")
        elif kind in ("BF16", "F32"):
            n_bad = int((~torch.isfinite(t.to(torch.float32))).sum())
            if n_bad:
                problems.append(f"{name}: {n_bad} value(s) are NaN/Inf")
    return problems


def verify_checkpoint(path: str | Path, *, progress: bool = True,
                      value_scan_max_bytes: int = DEFAULT_VALUE_SCAN_MAX_BYTES) -> VerifyReport:
    """Check `path` (a checkpoint directory with config.json) against its config; never raises
    for a broken checkpoint — every finding goes into `report.problems`."""
    from tqdm import tqdm

    root = Path(path)
    report = VerifyReport(path=root)
    try:
        cfg = DeepseekV41Config.from_file(root)
    except ConfigError as e:
        report.problems.append(f"config.json: {e}")
        return report
    report.config_summary = _config_summary(cfg)
    try:
        reader = CheckpointReader(root)
    except CheckpointFormatError as e:
        report.problems.append(str(e))
        return report

    with reader:
        # ---- headers of every shard; index ↔ header agreement --------------------------------
        in_files: dict[str, Path] = {}
        headers = {}
        for file in tqdm(reader.files, desc="verify: headers", unit="file", disable=not progress):
            try:
                header = headers[file] = reader.header(file)
            except CheckpointFormatError as e:
                report.problems.append(str(e))
                continue
            for name in header:
                if name in in_files:
                    report.problems.append(f"{name}: stored twice ({in_files[name].name} and {file.name})")
                in_files[name] = file
        listed = set(reader.names())
        for name in sorted(listed):
            file = reader.file_of(name)
            if file in headers and name not in headers[file]:
                report.problems.append(f"{name}: listed in {INDEX_FILE} under {file.name} but absent from that file")
        for name in sorted(set(in_files) - listed):
            report.problems.append(f"{name}: stored in {in_files[name].name} but not listed in {INDEX_FILE}")
        entries = {n: headers[f][n] for n, f in in_files.items()}
        report.n_files, report.n_tensors = len(reader.files), len(entries)
        report.total_bytes = sum(e.nbytes for e in entries.values())
        if reader.index_total_size is not None and reader.index_total_size != report.total_bytes:
            report.problems.append(f"{INDEX_FILE}: metadata.total_size {reader.index_total_size} but the shard "
                                   f"headers describe {report.total_bytes} bytes")

        # ---- inventory: presence, dtype, shape --------------------------------------------
        group_of: dict[str, str] = {}
        expected = {}
        for spec in tensor_inventory(cfg):
            for st in spec.stored():
                expected[st.name] = st
                group_of[st.name] = spec.group
        components: dict[str, ComponentCount] = defaultdict(ComponentCount)
        missing: list[str] = []
        well_formed: dict[str, str] = {}  # name → expected dtype, for the value scan
        for name, want in expected.items():
            c = components[group_of[name]]
            c.expected += 1
            entry = entries.get(name)
            if entry is None:
                missing.append(name)
                continue
            c.present += 1
            c.nbytes += entry.nbytes
            problem = stored_problem(want, entry.dtype, entry.shape)
            if problem:
                report.problems.append(problem)
            elif name in listed:
                well_formed[name] = want.dtype
        for name in missing:
            report.problems.append(f"{name}: missing (expected {expected[name].dtype} {list(expected[name].shape)})")
        for name in sorted(set(entries) - set(expected)):
            components["unexpected"].present += 1
            components["unexpected"].nbytes += entries[name].nbytes
            report.problems.append(f"{name}: unexpected tensor (not in the inventory for this config)")
        report.components = dict(components)

        # ---- values (small checkpoints only) ----------------------------------------------
        if report.total_bytes > value_scan_max_bytes:
            report.value_scan = (f"skipped: {report.total_bytes / 1e9:,.1f} GB exceeds the "
                                 f"{value_scan_max_bytes / 1e9:,.1f} GB scan threshold (headers only)")
        else:
            problems = _scan_values(reader, well_formed, progress)
            report.problems += problems
            report.value_scan = (f"{len(well_formed)} tensors scanned (scale bytes ≠ 255, E4M3 not NaN, floats finite): "
                                 f"{'clean' if not problems else f'{len(problems)} problem(s)'}")
    return report


def cli(argv: list[str]) -> int:
    """`sglang-dsv41 verify DIR`: exit 0 when the checkpoint matches its config, 1 otherwise."""
    ap = argparse.ArgumentParser(prog="sglang-dsv41 verify",
                                 description="Check a DeepSeek-V4.1 checkpoint directory against its config.json.")
    ap.add_argument("path", type=Path, help="checkpoint directory (config.json + safetensors shards)")
    ap.add_argument("--value-scan-max-gb", type=float, default=DEFAULT_VALUE_SCAN_MAX_BYTES / 1e9,
                    help="scan tensor values only when the checkpoint is at most this big (default %(default).1f)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    report = verify_checkpoint(a.path, progress=not a.quiet, value_scan_max_bytes=int(a.value_scan_max_gb * 1e9))
    print(report.format())
    return 0 if report.ok else 1
