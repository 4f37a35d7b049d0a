"""Deployment config → the exact SGLang 0.5.17 command lines and environment.

Invariants
----------
* Every emitted server flag exists in SGLang 0.5.17's `ServerArgs` (a test parses each
  generated command with 0.5.17's own argument parser). Options 0.5.17 lacks go through a
  plugin capability (`capabilities.py`) and are emitted only when the plugin provides them;
  otherwise they are reported in `LaunchPlan.unavailable` — never silently dropped.
* Output is deterministic (fixed flag order, environment sorted by name), so a dry run can be
  pinned by golden files.
* The command needs no environment the user must remember: the plugin is loaded by SGLang
  through its entry point; everything else the config needs is in `Command.env`.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from .capabilities import CAPABILITIES
from .schema import DeploymentConfig, PDRoleSpec

SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"
# V4.1's reasoning parser is an alias of V4's detector (runtime.md §A.10); 0.5.17 ships it.
REASONING_PARSER = "deepseek-v4"


@dataclass(frozen=True)
class Command:
    role: str  # server | prefill | decode | router
    module: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

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
    capability: str
    what: str
    reason: str
    would_add: str  # the arguments/environment emitted once the plugin provides it


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


def required_capabilities(dc: DeploymentConfig) -> list[str]:
    f = dc.features
    want = ["model"]
    want += ["engram_host_table"] if dc.engram.placement == "host" else []
    want += ["text_only"] if f.text_only else []
    want += ["encoder_data_parallel"] if f.encoder_data_parallel else []
    want += ["bounded_replay_encoder"] if f.bounded_replay.encoder else []
    want += ["bounded_replay_decoder"] if f.bounded_replay.decoder else []
    want += ["kv_layout_v41"] if f.kv_layout == "v41" else []
    want += ["tool_parser"] if f.tool_calls else []
    want += ["dspark"] if dc.speculative.enabled else []
    return want


def _capability_args_env(dc: DeploymentConfig, name: str) -> tuple[list[str], dict[str, str]]:
    cap = CAPABILITIES[name]
    args, env = list(cap.args), dict(cap.env)
    if name == "engram_host_table":
        env["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = dc.engram.host_layout
    if name == "dspark":
        args += ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", str(dc.speculative.block_size)]
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
    args = ["--model-path", dc.model.path, *_opt("--served-model-name", dc.model.served_name),
            "--host", host, "--port", str(port), "--tp-size", str(p.tp)]
    if p.dp_attention > 1:
        args += ["--dp-size", str(p.dp_attention), "--enable-dp-attention"]
    if p.ep > 1:
        args += ["--ep-size", str(p.ep)]
    args += _opt("--moe-a2a-backend", s.moe_a2a_backend) + _opt("--moe-runner-backend", s.moe_runner_backend)
    args += _opt("--context-length", s.context_length) + _opt("--max-running-requests", s.max_running_requests)
    args += _opt("--max-total-tokens", s.max_total_tokens) + _opt("--mem-fraction-static", s.mem_fraction_static)
    args += _opt("--chunked-prefill-size", s.chunked_prefill_size)
    if s.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", s.kv_cache_dtype]
    args += _opt("--cuda-graph-backend-decode", g.decode) + _opt("--cuda-graph-backend-prefill", g.prefill)
    args += _opt("--cuda-graph-max-bs-decode", g.max_bs)
    if s.reasoning_parser:
        args += ["--reasoning-parser", REASONING_PARSER]
    if dc.hardware.kind.is_cpu:
        args += ["--device", "cpu"]
    return args


def _base_env(dc: DeploymentConfig) -> dict[str, str]:
    env: dict[str, str] = {}
    if dc.hardware.kind.is_cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # mandatory for --device cpu (spec cpu.md §3)
    if dc.hardware.kind.is_rocm:
        env["SGLANG_USE_AITER"] = "1"
    env.update(dc.serving.env)
    return env


def _server_command(dc: DeploymentConfig, role: str, caps: frozenset[str], pd_role: PDRoleSpec | None) -> Command:
    host = pd_role.host if pd_role else dc.serving.host
    port = pd_role.port if pd_role else dc.serving.port
    args, env = _server_args(dc, host, port), _base_env(dc)
    for name in required_capabilities(dc):
        if name in caps:
            extra_args, extra_env = _capability_args_env(dc, name)
            args += extra_args
            env.update(extra_env)
    if pd_role is not None:
        assert dc.pd is not None
        args += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", dc.pd.transfer_backend]
        args += _opt("--disaggregation-bootstrap-port", pd_role.bootstrap_port)
        if pd_role.base_gpu_id:
            args += ["--base-gpu-id", str(pd_role.base_gpu_id)]
        args += list(pd_role.extra_args)
        env.update(pd_role.env)
    args += list(dc.serving.extra_args)
    return Command(role, SERVER_MODULE, tuple(args), tuple(sorted(env.items())))


def _router_command(dc: DeploymentConfig) -> Command:
    assert dc.pd is not None
    pre, dec, r = dc.pd.prefill, dc.pd.decode, dc.pd.router
    args = ("--pd-disaggregation", "--prefill", f"http://{pre.url_host}:{pre.port}", str(pre.bootstrap_port),
            "--decode", f"http://{dec.url_host}:{dec.port}", "--host", r.host, "--port", str(r.port))
    return Command("router", ROUTER_MODULE, args)


def build_launch(dc: DeploymentConfig, caps: frozenset[str]) -> LaunchPlan:
    """The command(s) for `dc` given the plugin capabilities `caps`."""
    missing = tuple(Unavailable(n, CAPABILITIES[n].what, CAPABILITIES[n].why_not_stock, _would_add(dc, n))
                    for n in required_capabilities(dc) if n not in caps)
    notes = [f"reasoning parser: 0.5.17's {REASONING_PARSER!r} (V4.1's deepseek-v41 is an alias of it)"] \
        if dc.serving.reasoning_parser else []
    if dc.hardware.kind.is_cpu:
        notes.append("CPU: sgl_kernel needs libcuda.so.1 even on CPU; put a stub on LD_LIBRARY_PATH (spec cpu.md §3, "
                     "`sglang-dsv41 doctor` checks it)")
    if dc.pd is None:
        return LaunchPlan(dc.name, (_server_command(dc, "server", caps, None),), missing, tuple(notes))
    notes.append(f"router: the {ROUTER_MODULE} module comes from the separate sglang-router package")
    cmds = (_server_command(dc, "prefill", caps, dc.pd.prefill), _server_command(dc, "decode", caps, dc.pd.decode),
            _router_command(dc))
    return LaunchPlan(dc.name, cmds, missing, tuple(notes))


def render_dry_run(plan: LaunchPlan, source: str, status: str) -> str:
    lines = [f"# sglang-dsv41 launch --dry-run: {plan.name} ({source}), {status}"]
    if plan.unavailable:
        lines.append("# NOT AVAILABLE YET — the plugin does not provide these; the launch refuses to run without "
                     "--allow-unavailable:")
        for u in plan.unavailable:
            lines.append(f"#   - {u.capability}: {u.what}")
            lines.append(f"#       {u.reason}")
            lines.append(f"#       once provided, adds: {u.would_add}")
    for n in plan.notes:
        lines.append(f"# note: {n}")
    for c in plan.commands:
        lines += ["", f"# {c.role}", c.shell()]
    return "\n".join(lines) + "\n"
