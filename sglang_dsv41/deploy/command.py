"""Deployment config → the exact SGLang 0.5.17 command lines and environment.

Invariants
----------
* Every emitted server flag exists in SGLang 0.5.17's `ServerArgs` once the plugin has
  registered its parser names (a test parses each generated command with 0.5.17's own argument
  parser). Options 0.5.17 lacks go through a plugin capability (`capabilities.py`) and are
  emitted only when the plugin provides them; otherwise they are reported in
  `LaunchPlan.unavailable` — never silently dropped.
* The model's server defaults (`runtime/requirements.py`) are not emitted: the plugin declares
  them inside SGLang (`sglang_dsv41/overrides.py`), which applies those the command leaves unset
  at start-up; the dry run names them in a note. What the config asks for beyond the runtime (a
  TP size it does not shard, DP attention, vision, CUDA graphs, PD, a KV dtype) is reported in
  `LaunchPlan.unavailable` with the runtime's reason (`runtime_limits`) — the server would
  refuse it at start-up.
* Output is deterministic (fixed flag order, environment sorted by name), so a dry run can be
  pinned by golden files. Machine-dependent parts are resolved by the launcher at run time and
  named in a note: SGLang's CPU environment (`Command.cpu_engine`, `runtime/cpu_env.py`) and
  the tiny checkpoint's existence (`model.tiny_seed`; its path is `serve.tiny_checkpoint_dir`).
* The command needs no environment the user must remember: the plugin is loaded by SGLang
  through its entry point; everything else the config needs is in `Command.env` or prepared by
  `sglang-dsv41 launch`.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ..runtime.cpu_env import PD_CPU_ENVIRONMENT
from ..runtime.requirements import CURRENT_RUNTIME, Device, RuntimeProfile, uses_hicache_storage
from ..serve import tiny_checkpoint_dir
from .capabilities import CAPABILITIES
from .schema import DeploymentConfig, PDRoleSpec, adaptive_verification
from .vision_config import limit_args

SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"
MAKE_TINY = "sglang-dsv41 make-checkpoint --preset tiny --out DIR"


@dataclass(frozen=True)
class Command:
    role: str  # server | prefill | decode | router
    module: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cpu_engine: bool = False  # the launcher adds SGLang's CPU environment (runtime/cpu_env.py) at run time

    def argv(self, python: str = "python") -> list[str]:
        return [python, "-m", self.module, *self.args]

    def shell(self) -> str:
        """A copy-pastable shell form: `env K=V … python -m module \\` one flag per line."""
        head = ["env", *(f"{k}={shlex.quote(v)}" for k, v in self.env)] if self.env else []
        first = " ".join(head + ["python", "-m", self.module])
        rows, i, a = [first], 0, self.args
        while i < len(a):
            if a[i].startswith("--") and i + 1 < len(a) and not a[i + 1].startswith("--"):
                j = i + 1
                while j < len(a) and not a[j].startswith("--"):
                    j += 1
                rows.append(" ".join(shlex.quote(x) for x in a[i:j]))
                i = j
            else:
                rows.append(shlex.quote(a[i]))
                i += 1
        return " \\\n    ".join(rows)


@dataclass(frozen=True)
class Unavailable:
    """Something the config asks for that cannot be served yet: a plugin capability the plugin
    does not declare (`source="plugin"`), or a limit of the current runtime (`source="runtime"`)."""

    capability: str
    what: str
    reason: str
    would_add: str = ""  # plugin: the arguments/environment emitted once the plugin provides it
    source: str = "plugin"


@dataclass(frozen=True)
class LaunchPlan:
    name: str
    commands: tuple[Command, ...]
    unavailable: tuple[Unavailable, ...]
    notes: tuple[str, ...] = field(default=())

    def command(self, role: str) -> Command:
        for c in self.commands:
            if c.role == role:
                return c
        raise KeyError(f"no {role!r} command in {self.name}; roles: {[c.role for c in self.commands]}")


def required_capabilities(dc: DeploymentConfig, runtime: RuntimeProfile = CURRENT_RUNTIME) -> list[str]:
    """Plugin capabilities `dc` needs. Text-only needs the `--language-model-only` switch only from
    a runtime that loads the vision tower (a text-only runtime would serve it as it is, and a
    config wanting vision would hit `runtime_limits` instead)."""
    f = dc.features
    want = ["model"]
    want += ["reasoning_parser"] if dc.serving.reasoning_parser else []
    want += ["engram_host_table"] if dc.engram.placement == "host" else []
    want += ["text_only"] if f.text_only and runtime.vision else []
    want += ["encoder_data_parallel"] if f.encoder_data_parallel else []
    want += ["bounded_replay_encoder"] if f.bounded_replay.encoder else []
    want += ["bounded_replay_decoder"] if f.bounded_replay.decoder else []
    want += ["kv_layout_v41"] if f.kv_layout == "v41" else []
    want += ["tool_parser"] if f.tool_calls else []
    want += ["dspark"] if dc.speculative.enabled else []
    return want


def _cuda_graph_request(dc: DeploymentConfig) -> str:
    """The config's CUDA-graph settings, in words ('' when it asks for none)."""
    g, on = dc.cuda_graph, ("full", "breakable")
    parts = [f"decode {g.decode}"] if g.decode in on else []
    parts += [f"prefill {g.prefill}"] if g.prefill in on else []
    parts += [f"capture up to batch {g.max_bs}"] if g.max_bs is not None else []
    return ", ".join(parts)


def runtime_limits(dc: DeploymentConfig, runtime: RuntimeProfile = CURRENT_RUNTIME) -> list[Unavailable]:
    """What `dc` asks for beyond `runtime` (`runtime/requirements.py`), each with its reason."""
    out: list[Unavailable] = []

    def limit(name: str, what: str, reason: str | None = None) -> None:
        out.append(Unavailable(name, what, reason or runtime.reasons[name], source="runtime"))

    p = dc.parallel
    if not runtime.supports_tp(p.tp):
        layout = f" (DP attention {p.dp_attention}, EP {p.ep})" if (p.dp_attention, p.ep) != (1, 1) else ""
        limit("tensor_parallel", f"tensor parallel size {p.tp}{layout}", runtime.tp_reason())
    if p.dp_attention > 1 and not runtime.dp_attention:
        limit("dp_attention", f"DP attention {p.dp_attention} (--enable-dp-attention)")
    if not dc.features.text_only and not runtime.vision:
        limit("vision", "image input (the V4.1 vision tower)")
    graphs = _cuda_graph_request(dc)
    prefill_graphs = dc.cuda_graph.prefill in ("full", "breakable")
    if graphs and (not runtime.cuda_graphs or (prefill_graphs and not runtime.prefill_cuda_graphs)
                   or p.tp not in runtime.cuda_graph_tp_sizes):
        limit("cuda_graphs", f"CUDA graphs ({graphs}){f' at TP {p.tp}' if p.tp > 1 else ''}")
    if dc.pd is not None and not dc.features.text_only and runtime.vision and not runtime.pd_vision:
        limit("pd_vision", "image input with prefill/decode disaggregation")
    if dc.pd is not None and (not runtime.pd_disaggregation
                               or dc.pd.transfer_backend not in runtime.pd_transfer_backends):
        limit("pd_disaggregation", f"prefill/decode disaggregation over {dc.pd.transfer_backend}")
    if dc.serving.kv_cache_dtype not in runtime.kv_cache_dtypes:
        limit("kv_cache_dtype", f"--kv-cache-dtype {dc.serving.kv_cache_dtype}")
    return out


def model_path(dc: DeploymentConfig) -> str:
    """`model.path`, or the cache directory of the tiny checkpoint (preset `model.architecture`)
    for `model.tiny_seed` (pure)."""
    if dc.model.tiny_seed is not None:
        return str(tiny_checkpoint_dir(dc.model.tiny_seed, preset=dc.model.architecture))
    return dc.model.path


def device_of(dc: DeploymentConfig) -> Device:
    """The runtime device a config serves on (ROCm GPUs are `cuda` to torch)."""
    return "cpu" if dc.hardware.kind.is_cpu else "cuda"


def _capability_args_env(dc: DeploymentConfig, name: str) -> tuple[list[str], dict[str, str]]:
    cap = CAPABILITIES[name]
    args, env = list(cap.args), dict(cap.env)
    if name == "engram_host_table":
        env["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = dc.engram.host_layout
    if name == "dspark":
        args += ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", str(dc.speculative.block_size)]
        if adaptive_verification(dc):          # SGLang's compact ragged verify (docs/dspark.md)
            env["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
            args += _opt("--speculative-dspark-sps-table-path", dc.speculative.sps_table)
        if dc.speculative.synthetic_acceptance_length is not None:     # benchmarks only
            env["SGLANG_SIMULATE_ACC_LEN"] = f"{dc.speculative.synthetic_acceptance_length:g}"
    return args, env


def _would_add(dc: DeploymentConfig, name: str) -> str:
    args, env = _capability_args_env(dc, name)
    parts = [" ".join(args)] if args else []
    parts += [f"{k}={v}" for k, v in sorted(env.items())]
    return ", ".join(parts) if parts else "(loaded through the plugin's entry point; no flag)"


def _opt(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _server_args(dc: DeploymentConfig, host: str, port: int) -> list[str]:
    s, p, g = dc.serving, dc.parallel, dc.cuda_graph
    args = ["--model-path", model_path(dc), *_opt("--served-model-name", dc.model.served_name),
            "--host", host, "--port", str(port), "--tp-size", str(p.tp)]
    if p.dp_attention > 1:
        args += ["--dp-size", str(p.dp_attention), "--enable-dp-attention"]
    if p.ep > 1:
        args += ["--ep-size", str(p.ep)]
    args += _opt("--moe-a2a-backend", s.moe_a2a_backend) + _opt("--moe-runner-backend", s.moe_runner_backend)
    args += _opt("--context-length", s.context_length) + _opt("--max-running-requests", s.max_running_requests)
    args += _opt("--max-total-tokens", s.max_total_tokens) + _opt("--mem-fraction-static", s.mem_fraction_static)
    args += _opt("--chunked-prefill-size", s.chunked_prefill_size)
    args += limit_args(dc.features.max_images_per_request)
    if s.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", s.kv_cache_dtype]
    args += _opt("--cuda-graph-backend-decode", g.decode) + _opt("--cuda-graph-backend-prefill", g.prefill)
    args += _opt("--cuda-graph-max-bs-decode", g.max_bs)
    if dc.hardware.kind.is_cpu:
        args += ["--device", "cpu"]
    return args


def _base_env(dc: DeploymentConfig) -> dict[str, str]:
    env: dict[str, str] = {}
    if dc.hardware.kind.is_rocm:
        env["SGLANG_USE_AITER"] = "1"
    env.update(dc.serving.env)
    return env


def _server_command(dc: DeploymentConfig, role: str, caps: frozenset[str], pd_role: PDRoleSpec | None,
                    runtime: RuntimeProfile) -> Command:
    host = pd_role.host if pd_role else dc.serving.host
    port = pd_role.port if pd_role else dc.serving.port
    args, env = _server_args(dc, host, port), _base_env(dc)
    for name in required_capabilities(dc, runtime):
        if name in caps:
            extra_args, extra_env = _capability_args_env(dc, name)
            args += extra_args
            env.update(extra_env)
    tail: list[str] = []
    if pd_role is not None:
        assert dc.pd is not None
        tcp = dc.pd.transfer_backend == "mooncake_tcp"          # SGLang's mooncake backend over TCP (docs/pd.md)
        tail += ["--disaggregation-mode", role, "--disaggregation-transfer-backend",
                 "mooncake" if tcp else dc.pd.transfer_backend]
        if tcp:
            env.update(PD_CPU_ENVIRONMENT)
        tail += _opt("--disaggregation-bootstrap-port", pd_role.bootstrap_port)
        if pd_role.base_gpu_id:
            tail += ["--base-gpu-id", str(pd_role.base_gpu_id)]
        tail += list(pd_role.extra_args)
        env.update(pd_role.env)
    tail += list(dc.serving.extra_args)
    return Command(role, SERVER_MODULE, tuple(args + tail), tuple(sorted(env.items())),
                   cpu_engine=dc.hardware.kind.is_cpu)


def _router_command(dc: DeploymentConfig) -> Command:
    assert dc.pd is not None
    pre, dec, r = dc.pd.prefill, dc.pd.decode, dc.pd.router
    args = ("--pd-disaggregation", "--prefill", f"http://{pre.url_host}:{pre.port}", str(pre.bootstrap_port),
            "--decode", f"http://{dec.url_host}:{dec.port}", "--host", r.host, "--port", str(r.port))
    return Command("router", ROUTER_MODULE, args)


def _notes(dc: DeploymentConfig, runtime: RuntimeProfile, server: Command) -> list[str]:
    notes = []
    storage = uses_hicache_storage(server.args)
    for f in runtime.applicable(device_of(dc), server.args):    # the defaults this command leaves to the plugin
        notes.append(f"default the plugin declares for the {runtime.name} runtime, applied by SGLang at "
                     f"start-up ({runtime.doc}): {' '.join(f.args(storage))} — {f.why}")
    if dc.model.tiny_seed is not None and dc.model.architecture == "tiny":
        notes.append(f"model: the tiny random checkpoint (seed {dc.model.tiny_seed}) in the sglang-dsv41 cache — "
                     "the one `sglang-dsv41 serve` uses — made on first launch; for another directory run "
                     f"`{MAKE_TINY}` and pass --model-path DIR")
    elif dc.model.tiny_seed is not None:
        preset = dc.model.architecture
        notes.append(f"model: the {preset} random checkpoint (seed {dc.model.tiny_seed}) in the sglang-dsv41 cache, "
                     "made on first launch; for another directory run "
                     f"`{MAKE_TINY.replace('--preset tiny', f'--preset {preset}')}` and pass --model-path DIR")
    if dc.speculative.synthetic_acceptance_length is not None:
        notes.append(f"DSpark: SYNTHETIC acceptance (SGLANG_SIMULATE_ACC_LEN="
                     f"{dc.speculative.synthetic_acceptance_length:g}) — for throughput benchmarks only: drafts are "
                     "accepted at that mean length without verification, so the output is not the model's")
    if dc.speculative.enabled:
        if not adaptive_verification(dc):
            notes.append("DSpark: adaptive verification off (ROCm / CPU default, or the config's choice): every "
                         "round verifies the whole block")
        elif dc.speculative.sps_table is None:
            notes.append("DSpark: adaptive verification on (SGLANG_RAGGED_VERIFY_MODE=compact) but without a profiled "
                         "SPS cost table (speculative.sps_table) for this hardware SGLang verifies every draft and "
                         "warns at start-up")
    if dc.hardware.kind.is_cpu:
        notes.append("CPU: `sglang-dsv41 launch` adds SGLang's CPU environment (runtime/cpu_env.py: "
                     "SGLANG_USE_CPU_ENGINE=1, HF_HUB_OFFLINE=1, a libcuda.so.1 stand-in first on LD_LIBRARY_PATH; "
                     "spec cpu.md §3; with --tp-size N > 1 passed after `--` also SGLANG_CPU_OMP_THREADS_BIND, one core "
                     "range per rank, and SGLANG_NCCL_SO_PATH at no library, so gloo carries the collectives) — the "
                     "command alone lacks it")
    return notes


def build_launch(dc: DeploymentConfig, caps: frozenset[str], runtime: RuntimeProfile = CURRENT_RUNTIME) -> LaunchPlan:
    """The command(s) for `dc` given the plugin capabilities `caps` and the runtime's profile."""
    missing = [Unavailable(n, CAPABILITIES[n].what, CAPABILITIES[n].why_not_stock, _would_add(dc, n))
               for n in required_capabilities(dc, runtime) if n not in caps]
    blocked = tuple(runtime_limits(dc, runtime) + missing)
    if dc.pd is None:
        server = _server_command(dc, "server", caps, None, runtime)
        return LaunchPlan(dc.name, (server,), blocked, tuple(_notes(dc, runtime, server)))
    cmds = (_server_command(dc, "prefill", caps, dc.pd.prefill, runtime),
            _server_command(dc, "decode", caps, dc.pd.decode, runtime), _router_command(dc))
    notes = _notes(dc, runtime, cmds[0])
    notes.append(f"router: the {ROUTER_MODULE} module comes from the separate sglang-router package")
    return LaunchPlan(dc.name, cmds, blocked, tuple(notes))


def describe_unavailable(u: Unavailable) -> list[str]:
    """Two or three lines naming `u`, its reason and (plugin) what it will add."""
    who = "runtime limit" if u.source == "runtime" else "not provided by the plugin yet"
    lines = [f"- {u.capability}: {u.what}", f"    {who}: {u.reason}"]
    if u.would_add:
        lines.append(f"    once provided, adds: {u.would_add}")
    return lines


def render_dry_run(plan: LaunchPlan, source: str, status: str) -> str:
    lines = [f"# sglang-dsv41 launch --dry-run: {plan.name} ({source}), {status}"]
    if plan.unavailable:
        lines.append("# CANNOT BE SERVED AS CONFIGURED YET — a real launch refuses (exit 3) unless "
                     "--allow-unavailable:")
        for u in plan.unavailable:
            lines += [f"#   {line}" for line in describe_unavailable(u)]
    for n in plan.notes:
        lines.append(f"# note: {n}")
    for c in plan.commands:
        lines += ["", f"# {c.role}", c.shell()]
    return "\n".join(lines) + "\n"
