"""`sglang-dsv41 doctor [--config FILE]`: is this machine ready to serve DeepSeek-V4.1?

Checks, each reported as OK / WARN / FAIL / INFO with what is wrong and what to do:
SGLang == 0.5.17; the sglang-dsv41 plugin — its `sglang.srt.plugins` entry point, and that
loading it the way SGLang does really registers the config, the model class and the V4.1
parsers (`registration.py`, a fresh interpreter); the launch capabilities it declares and the
ones it does not; the current runtime's limits (`runtime/requirements.py`: TP sizes, text only,
CUDA graphs, …), and with `--config` whether that deployment stays within them;
deepseek-recipe 0.2.0 (V4.1 chat encoding); GPUs through torch.cuda; host memory and
transparent huge pages (the Engram host table, layout per_rank: each TP rank pins its own block
of rows, ~189 GiB per server at Flash, once per server on the node, with 2 MiB huge pages; spec
`runtime.md` §A.7); Mooncake / NIXL / the router for PD. With `--config`, the checks use
that deployment's needs (GPU count and memory from the planner, host Engram size, PD transfer
backend); without it, a machine without a GPU is reported as a warning, not a failure — the
README's main job (`sglang-dsv41 serve`) then runs on the CPU, so the CPU engine is checked too.

Invariant: exit status is non-zero iff at least one FAIL was printed.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..runtime.cpu_env import cpu_environment
from ..runtime.requirements import CURRENT_RUNTIME, RuntimeProfile
from .capabilities import CAPABILITIES, PLUGIN_GROUP, available_capabilities, plugin_entry_points
from .command import build_launch, model_path
from .registration import RegistrationReport, probe_registration
from .schema import DeployConfigError, DeploymentConfig, load_config

if TYPE_CHECKING:
    from .plan import Plan

SGLANG_VERSION = "0.5.17"
RECIPE_VERSION = "0.2.0"
GIB = float(1 << 30)


@dataclass(frozen=True)
class Check:
    status: str  # OK | WARN | FAIL | INFO
    name: str
    detail: str


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_sglang() -> Check:
    v = _version("sglang")
    if v is None:
        return Check("FAIL", "sglang", f"not installed; pip install sglang=={SGLANG_VERSION}")
    if v != SGLANG_VERSION:
        return Check("FAIL", "sglang", f"version {v}; the plugin targets exactly {SGLANG_VERSION} "
                                       "(it hooks private internals)")
    return Check("OK", "sglang", v)


def check_recipe() -> Check:
    v = _version("deepseek-recipe")
    if v is None:
        return Check("FAIL", "deepseek-recipe", f"not installed; V4.1 chat encoding needs deepseek-recipe=={RECIPE_VERSION}")
    if v != RECIPE_VERSION:
        return Check("WARN", "deepseek-recipe", f"version {v}; prompts are specified against {RECIPE_VERSION}")
    return Check("OK", "deepseek-recipe", v)


def check_plugin(probe: Callable[[], RegistrationReport] | None = None) -> list[Check]:
    """Entry point installed and allowed; loading it through SGLang (`probe`, default
    `registration.probe_registration`) registers all four items."""
    eps = plugin_entry_points()
    if not eps:
        return [Check("FAIL", "plugin", f"sglang-dsv41 installs no '{PLUGIN_GROUP}' entry point, so SGLang 0.5.17 "
                                        "cannot load DeepSeek-V4.1; reinstall the package (pip install -e .)")]
    out = []
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    names = ", ".join(ep.name for ep in eps)
    if allowed and not any(ep.name in {x.strip() for x in allowed.split(",")} for ep in eps):
        out.append(Check("FAIL", "plugin", f"SGLANG_PLUGINS={allowed!r} excludes {names}; add it or unset SGLANG_PLUGINS"))
        return out
    report = (probe or probe_registration)()
    if report.error:
        return [Check("FAIL", "plugin", f"entry point(s) {names}: {report.error}")]
    if not report.ok:
        return [Check("FAIL", "plugin", f"entry point(s) {names} load, but SGLang's registries lack our "
                                        f"{', '.join(report.missing())} after load_plugins()")]
    provided = sorted(available_capabilities())
    lacking = sorted(set(CAPABILITIES) - set(provided))
    return [Check("OK", "plugin", f"entry point(s) {names}: SGLang's load_plugins() registers the config, the model "
                                  "class and the deepseek-v41 reasoning/tool-call parsers"),
            Check("INFO", "capabilities", f"provided: {', '.join(provided) or 'none'}; not provided yet: "
                                          f"{', '.join(lacking) or 'none'}")]


def check_runtime(dc: DeploymentConfig | None, runtime: RuntimeProfile = CURRENT_RUNTIME,
                  caps: frozenset[str] | None = None) -> list[Check]:
    """The runtime's limits (INFO); with a config, FAIL for everything it cannot serve yet."""
    out = [Check("INFO", "runtime", f"{runtime.name} ({runtime.doc}): " + "; ".join(runtime.summary()))]
    if dc is None:
        return out
    plan = build_launch(dc, available_capabilities() if caps is None else caps, runtime)
    for u in plan.unavailable:
        who = "runtime limit" if u.source == "runtime" else "plugin lacks"
        out.append(Check("FAIL", "launch", f"{dc.name} asks for {u.capability} ({u.what}) — {who}: {u.reason}"))
    if not plan.unavailable:
        out.append(Check("OK", "launch", f"{dc.name} is within the runtime's limits and the plugin's capabilities"))
    return out


def gpu_inventory() -> tuple[int, list[tuple[str, float]], str]:
    """(count, [(name, GiB)], error) through torch.cuda (ROCm builds report through it too)."""
    try:
        import torch
    except Exception as e:
        return 0, [], f"torch does not import: {e!r}"
    if not torch.cuda.is_available():
        return 0, [], "torch.cuda.is_available() is False (no CUDA/ROCm device or driver visible)"
    devs = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devs.append((p.name, p.total_memory / GIB))
    return len(devs), devs, ""


def check_gpus(dc: DeploymentConfig | None, need_gib: float | None,
               inventory: Callable[[], tuple[int, list[tuple[str, float]], str]] = gpu_inventory) -> list[Check]:
    n, devs, err = inventory()
    if dc is not None and dc.hardware.kind.is_cpu:
        return [Check("INFO", "gpus", f"CPU config; {n} GPU(s) visible" + (f" ({err})" if err else ""))]
    if n == 0 and dc is None:
        return [Check("WARN", "gpus", f"no GPU ({err}): `sglang-dsv41 serve` runs the tiny checkpoint "
                                      "on the CPU; GPU deployments (--config) need one")]
    if n == 0:
        return [Check("FAIL", "gpus", f"no GPU: {err}")]
    names = ", ".join(sorted({d[0] for d in devs}))
    out = [Check("OK", "gpus", f"{n} × {names}, {min(d[1] for d in devs):.1f} GiB each (smallest)")]
    if dc is not None:
        want = dc.hardware.gpus * (2 if dc.pd is not None and dc.pd.prefill.url_host == dc.pd.decode.url_host else 1)
        if n < want:
            out.append(Check("FAIL", "gpus", f"{dc.name} needs {want} GPU(s) on this host, {n} visible"))
        if need_gib is not None and min(d[1] for d in devs) < need_gib:
            out.append(Check("FAIL", "gpu memory", f"{dc.name} keeps {need_gib:.1f} GiB of weights per GPU; the "
                                                   f"smallest GPU has {min(d[1] for d in devs):.1f} GiB"))
    return out


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes; an empty dict when it cannot be read (reported as unknown)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The bracketed mode: always | madvise | never (None if the file is missing)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text.strip() or None


def check_host_memory(host_need_gib: float | None, meminfo: dict[str, int] | None = None,
                      thp: str | None = "unread", layout: str = "") -> list[Check]:
    """Host RAM (and transparent huge pages) against `host_need_gib`, the pinned Engram bytes of
    this node (None: no host Engram); `layout` says how that need is made up."""
    mi = _meminfo() if meminfo is None else meminfo
    mode = thp_mode() if thp == "unread" else thp
    if "MemTotal" not in mi:
        return [Check("WARN" if host_need_gib is None else "FAIL", "host memory",
                      "could not read /proc/meminfo: host memory unknown")]
    total, avail = mi.get("MemTotal", 0) / GIB, mi.get("MemAvailable", 0) / GIB
    hp = mi.get("HugePages_Total", 0)
    out = [Check("INFO", "host memory", f"{total:.1f} GiB total, {avail:.1f} GiB available; "
                                        f"{hp} preallocated hugetlbfs pages")]
    if host_need_gib is not None:
        status = "OK" if avail >= host_need_gib else "FAIL"
        how = f" ({layout})" if layout else ""
        out.append(Check(status, "host Engram", f"needs {host_need_gib:.1f} GiB of pinned host memory on this node"
                                                f"{how}, {avail:.1f} GiB available"))
    if mode is None:
        out.append(Check("WARN" if host_need_gib is None else "FAIL", "huge pages",
                         "transparent huge pages are not available (no /sys/kernel/mm/transparent_hugepage)"))
    elif mode == "never":
        out.append(Check("WARN" if host_need_gib is None else "FAIL", "huge pages",
                         "transparent_hugepage is 'never': host Engram lookups run ~10× slower; set it to madvise "
                         "(echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)"))
    else:
        out.append(Check("OK", "huge pages", f"transparent_hugepage '{mode}' (the host table asks with MADV_HUGEPAGE)"))
    return out


def host_engram_layout(p: "Plan") -> str:
    """How a host-placement plan's need per node is made up (spec runtime.md §A.7): in the per_rank
    layout every TP rank pins its own block of rows (rank 0 the largest), the blocks of one server
    add up to one copy of the tables, and each server on the node pins its own copy."""
    if p.weights.engram_placement != "host":
        raise ValueError(f"{p.name}: Engram placement is {p.weights.engram_placement!r}, there is no host table")
    rw, per_node = p.runtime_weights, f"{p.servers_per_node} server(s) per node"
    if rw is None:  # a layout this runtime cannot serve: the card's table size per server
        return f"{p.host_per_server / GIB:.1f} GiB per server × {per_node}"
    return (f"layout {rw.host_layout}: each of the {rw.tp} rank(s) pins its own block of rows, at most "
            f"{rw.host_per_rank / GIB:.2f} GiB; {rw.host_per_server / GIB:.1f} GiB per server × {per_node}")


def _importable(module: str) -> str:
    """'' if `module` imports, else the reason."""
    try:
        importlib.import_module(module)
        return ""
    except Exception as e:  # ImportError / OSError from missing shared libraries
        return repr(e)


def check_pd(dc: DeploymentConfig | None) -> list[Check]:
    needed = dc is not None and dc.pd is not None
    backend = dc.pd.transfer_backend if needed and dc.pd else "mooncake"
    module = "nixl" if backend == "nixl" else "mooncake.engine"
    err = _importable(module)
    bad = "FAIL" if needed else "WARN"
    out = [Check("OK" if not err else bad, backend.split("_")[0],
                 f"{module} imports" if not err else f"{module} does not import: {err}"
                 + ("" if needed else " (needed only for PD disaggregation / Mooncake HiCache)"))]
    if needed:
        err = _importable("sglang_router")
        out.append(Check("OK" if not err else "FAIL", "router",
                         "sglang_router imports" if not err else f"sglang_router does not import ({err}); "
                                                                   "pip install sglang-router"))
    return out


def check_cpu_engine(dc: DeploymentConfig | None, timeout_s: float = 120.0, *,
                     no_gpu: bool = False) -> list[Check]:
    """CPU serving (a CPU config, or no config on a machine without GPU — ``no_gpu``): sgl_kernel's
    PyPI build links libcuda.so.1 even on CPU (spec cpu.md §3); the launcher supplies a stand-in
    (`runtime/cpu_env.py`) — check it builds and sgl_kernel imports with it."""
    if not (dc is None and no_gpu) and (dc is None or not dc.hardware.kind.is_cpu):
        return []
    try:
        env = cpu_environment()
    except RuntimeError as e:  # no C compiler, or the build failed
        return [Check("FAIL", "cpu engine", str(e))]
    try:
        run = subprocess.run([sys.executable, "-c", "import sgl_kernel"], env=env, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [Check("FAIL", "cpu engine", f"importing sgl_kernel took longer than {timeout_s:.0f} s")]
    if run.returncode != 0:
        tail = " | ".join(run.stderr.strip().splitlines()[-2:])
        return [Check("FAIL", "cpu engine", f"sgl_kernel does not import in SGLang's CPU environment: {tail}")]
    return [Check("OK", "cpu engine", f"sgl_kernel imports with the libcuda.so.1 stand-in "
                                      f"({env['LD_LIBRARY_PATH'].split(os.pathsep)[0]})")]


def run_checks(dc: DeploymentConfig | None) -> list[Check]:
    from .plan import make_plan, model_config_for  # the planner is only needed with a config

    need_gib = host_need = None
    layout = ""
    if dc is not None:
        path = model_path(dc)
        cfg, _ = model_config_for(dc, path if Path(path, "config.json").is_file() else None)
        p = make_plan(dc, cfg)
        need_gib = p.weights_per_rank / GIB
        if dc.engram.placement == "host":
            host_need, layout = p.host_need_per_node / GIB, host_engram_layout(p)
    checks = [Check("INFO", "python", sys.version.split()[0]), check_sglang(), check_recipe(), *check_plugin(),
              *check_runtime(dc), *check_gpus(dc, need_gib), *check_host_memory(host_need, layout=layout),
              *check_pd(dc), *check_cpu_engine(dc, no_gpu=dc is None and gpu_inventory()[0] == 0)]
    return checks


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-dsv41 doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="check for this deployment config's needs")
    a = ap.parse_args(argv)
    try:
        dc = load_config(a.config) if a.config else None
    except DeployConfigError as e:
        print(f"sglang-dsv41 doctor: {e}", file=sys.stderr)
        return 2
    checks = run_checks(dc)
    for c in checks:
        print(f"[{c.status:>4}] {c.name}: {c.detail}")
    fails = [c for c in checks if c.status == "FAIL"]
    print(f"\n{len(fails)} problem(s)" + (": " + "; ".join(c.name for c in fails) if fails else "; ready"))
    return 1 if fails else 0
