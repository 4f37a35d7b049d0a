"""Deployment config (`configs/*.yaml`): pydantic models that reject illegal combinations.

One YAML file describes one way to serve DeepSeek-V4.1 with SGLang 0.5.17 + this plugin:
hardware, parallel layout, model features (text-only, encoder data-parallel, DSpark, Engram
placement, SWA bounded replay, KV layout) and server settings; a `pd` section turns it into a
1P1D prefill/decode deployment with a router.

Invariants
----------
* Unknown keys are errors (`extra="forbid"`): a typo never silently falls back to a default.
* Every rule below raises with a message that names the fields and says why, citing the card
  (seed 004) or the spec (`runtime.md`). Rules that need the checkpoint's config.json (expert
  counts, DSpark block size) live in `memory.check_against_checkpoint`, not here.
* A config says whether it ran: `validated_on: unvalidated`, or a record with the date, the
  hardware and the `docs/validation.md` entry.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import vision_config
from .hardware import GPU_KINDS, GpuKind, gpu_kind

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
# SGLang 0.5.17's MegaMoE per-rank token buffer (env SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK).
MEGAMOE_TOKENS_ENV = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK"
MEGAMOE_TOKENS_DEFAULT = 1024
PAGE_SIZE = 256  # V4-family KV page (spec runtime.md §A.2)
# model.architecture values naming a synthetic tiny preset (checkpoint/synth.TINY_PRESETS).
TINY_ARCHITECTURES = ("tiny", "tiny-tp8")


class DeployConfigError(ValueError):
    """A deployment config that cannot be served as written."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Validation(_Strict):
    """What actually ran: the date, the machine, and the docs/validation.md entry."""

    date: _dt.date
    hardware: str
    log: str = Field(description="docs/validation.md entry, e.g. 'docs/validation.md#tiny-h200-tp1'")

    @field_validator("log")
    @classmethod
    def _log_points_to_validation_md(cls, v: str) -> str:
        if not v.startswith("docs/validation.md"):
            raise ValueError(f"validated_on.log must point into docs/validation.md, got {v!r}")
        return v


class ModelSpec(_Strict):
    """The checkpoint: `path` (a directory or hub id), or `tiny_seed` — a tiny random checkpoint
    in the sglang-dsv41 cache, made on first launch: with `architecture: tiny` the default tiny
    preset (`<cache>/tiny-seed<seed>`, the one `sglang-dsv41 serve` uses), with `architecture:
    tiny-tp8` the tiny-tp8 preset (`<cache>/tiny-tp8-seed<seed>`; 8 heads in 8 output groups, so
    the runtime can shard it at TP 4 and TP 8; presets.tiny_tp8_config_dict)."""

    path: str = DEFAULT_MODEL
    tiny_seed: int | None = Field(default=None, ge=0)
    served_name: str | None = None
    # Architecture (a presets.py preset) the planner assumes when no checkpoint directory is
    # given; with tiny_seed also the synthetic preset the launcher makes.
    architecture: Literal["flash", "tiny", "tiny-tp8"] = "flash"

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if self.tiny_seed is not None:
            if "path" in self.model_fields_set:
                raise ValueError("model.path and model.tiny_seed are two checkpoint sources: give one")
            if self.architecture not in TINY_ARCHITECTURES:
                raise ValueError("model.tiny_seed names a tiny random checkpoint: set model.architecture: tiny "
                                 "(or tiny-tp8)")
        return self


class HardwareSpec(_Strict):
    gpu: str
    gpus: int = Field(ge=0, description="GPUs one server uses (per role for PD); 0 for CPU")
    gpu_mem_gib: float | None = Field(default=None, gt=0)
    gpus_per_node: int | None = Field(default=None, ge=1)
    host_mem_gib: float | None = Field(default=None, gt=0, description="host RAM per node, for host Engram")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        if v not in GPU_KINDS:
            raise ValueError(f"unknown GPU kind {v!r}; known: {', '.join(GPU_KINDS)}")
        return v

    @property
    def kind(self) -> GpuKind:
        return gpu_kind(self.gpu)

    @property
    def mem_gib(self) -> float:
        return self.gpu_mem_gib if self.gpu_mem_gib is not None else self.kind.mem_gib

    @property
    def per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node is not None else self.kind.gpus_per_node


class ParallelSpec(_Strict):
    tp: int = Field(default=1, ge=1, description="SGLang --tp-size: GPUs of one server")
    dp_attention: int = Field(default=1, ge=1, description="attention data-parallel size (DP attention)")
    ep: int = Field(default=1, ge=1, description="expert-parallel size")


class EngramSpec(_Strict):
    """Where the two Engram tables live (spec runtime.md §A.7). `host_layout` matters only with
    `placement: host`: `per_rank` (each TP rank pins its own block of rows; lookups all-reduce) is
    what this runtime implements; `shared` (one memfd mapping for the whole TP group, upstream's
    default) is named so that a config asking for it gets a clear refusal, not a type error."""

    placement: Literal["device", "host"] = "device"
    host_layout: Literal["shared", "per_rank"] = "per_rank"


class SpeculativeSpec(_Strict):
    """DSpark: `block_size` = the checkpoint's dspark_block_size (5 at Flash). Adaptive
    verification (verify per request only as many drafted tokens as the confidence head and the
    step-cost table make worthwhile; SGLang's `SGLANG_RAGGED_VERIFY_MODE=compact`):
    `adaptive_verification` None = the hardware's default (on for NVIDIA, off on ROCm and CPU, as
    the card); `sps_table` = a profiled SGLang SPS cost table for this hardware (JSON,
    `--speculative-dspark-sps-table-path`), without which SGLang verifies every draft.
    `synthetic_acceptance_length`: benchmarks only (InferenceX's golden AL 3.51 at block 5) —
    SGLang's `SGLANG_SIMULATE_ACC_LEN` accepts that mean length instead of verifying, so the
    output is not the model's; needs adaptive verification off (a verify-all schedule)."""

    algorithm: str = "none"
    block_size: int | None = Field(default=None, ge=1)
    adaptive_verification: bool | None = None
    sps_table: str | None = None
    synthetic_acceptance_length: float | None = Field(default=None, ge=1.0)

    @property
    def enabled(self) -> bool:
        return self.algorithm.lower() != "none"


class BoundedReplaySpec(_Strict):
    """SWA bounded replay (experimental in the launch blog; spec runtime.md §A.4, §A.11)."""

    encoder: bool = False
    decoder: bool = False


class FeaturesSpec(_Strict):
    """Model features. Vision: served unless `text_only` (card: --language-model-only);
    `max_images_per_request` caps images per request (SGLang --limit-mm-data-per-request; the card
    sets no cap). Vision rules: `deploy/vision_config.py`."""

    text_only: bool = False
    encoder_data_parallel: bool = False
    max_images_per_request: int | None = Field(default=None, ge=1)
    tool_calls: bool = True
    kv_layout: Literal["v4", "v41"] = "v4"
    bounded_replay: BoundedReplaySpec = BoundedReplaySpec()


CudaGraphBackend = Literal["full", "breakable", "disabled"]


class CudaGraphSpec(_Strict):
    decode: CudaGraphBackend | None = None
    prefill: CudaGraphBackend | None = None
    max_bs: int | None = Field(default=None, ge=1)


class ServingSpec(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(default=30000, ge=1, le=65535)
    context_length: int | None = Field(default=None, ge=1)
    max_running_requests: int | None = Field(default=None, ge=1)
    max_total_tokens: int | None = Field(default=None, ge=1)
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    chunked_prefill_size: int | None = None
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "bf16"] = "auto"
    moe_runner_backend: str | None = None
    moe_a2a_backend: str | None = None
    reasoning_parser: bool = True
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)


class PDRoleSpec(_Strict):
    host: str = "0.0.0.0"
    url_host: str = "127.0.0.1"  # address the router uses to reach this role
    port: int = Field(ge=1, le=65535)
    base_gpu_id: int = Field(default=0, ge=0)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)


class RouterSpec(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)


class PDSpec(_Strict):
    transfer_backend: Literal["mooncake", "mooncake_tcp", "nixl"] = "mooncake"
    prefill: PDRoleSpec
    decode: PDRoleSpec
    router: RouterSpec = RouterSpec()


class DeploymentConfig(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    description: str
    validated_on: Validation | Literal["unvalidated"]
    model: ModelSpec = ModelSpec()
    hardware: HardwareSpec
    parallel: ParallelSpec = ParallelSpec()
    engram: EngramSpec = EngramSpec()
    speculative: SpeculativeSpec = SpeculativeSpec()
    features: FeaturesSpec = FeaturesSpec()
    cuda_graph: CudaGraphSpec = CudaGraphSpec()
    serving: ServingSpec = ServingSpec()
    pd: PDSpec | None = None

    @property
    def is_pd(self) -> bool:
        return self.pd is not None

    @property
    def validated(self) -> bool:
        return isinstance(self.validated_on, Validation)

    @model_validator(mode="after")
    def _legal(self) -> "DeploymentConfig":
        for problem in _illegal_combinations(self):
            raise ValueError(problem)
        return self


def adaptive_verification(c: DeploymentConfig) -> bool:
    """Whether DSpark verifies adaptively on this deployment (`SpeculativeSpec`): the config's
    choice, else on for NVIDIA GPUs and off on ROCm (the card: vLLM refuses it there) and CPU."""
    spec, kind = c.speculative, c.hardware.kind
    if not spec.enabled:
        return False
    if spec.adaptive_verification is not None:
        return spec.adaptive_verification
    return not (kind.is_cpu or kind.is_rocm)


def _illegal_combinations(c: DeploymentConfig) -> list[str]:
    """Every rule the config breaks (the validator reports the first; `problems()` all)."""
    out: list[str] = []
    hw, par, f, kind = c.hardware, c.parallel, c.features, c.hardware.kind
    # --- parallel layout vs GPUs -----------------------------------------------------------
    if kind.is_cpu:
        if hw.gpus != 0:
            out.append(f"hardware.gpu CPU takes hardware.gpus: 0, got {hw.gpus}")
        if (par.tp, par.dp_attention, par.ep) != (1, 1, 1):
            out.append("hardware.gpu CPU serves with tp=dp_attention=ep=1 (no tensor/data/expert parallelism)")
    else:
        if hw.gpus < 1:
            out.append(f"hardware.gpus must be ≥ 1 for {hw.gpu}")
        elif par.tp != hw.gpus:
            out.append(f"parallel.tp ({par.tp}) must equal hardware.gpus ({hw.gpus}): one server spans its GPUs "
                       "with --tp-size (data/expert parallelism are carved out of tp, not added to it)")
        if hw.gpus > hw.per_node:
            out.append(f"hardware.gpus ({hw.gpus}) exceeds the {hw.per_node} GPUs of one {hw.gpu} node/tray; "
                       "multi-node servers are not described by this schema")
    if par.tp % par.dp_attention:
        out.append(f"parallel.dp_attention ({par.dp_attention}) does not divide parallel.tp ({par.tp})")
    if par.ep not in (1, par.tp):
        out.append(f"parallel.ep ({par.ep}) must be 1 or equal parallel.tp ({par.tp}): SGLang 0.5.17 requires "
                   "ep_size * moe_dp_size == tp_size")
    # --- model features ----------------------------------------------------------------------
    out += vision_config.schema_problems(c)
    spec = c.speculative
    if spec.enabled and spec.algorithm.lower() != "dspark":
        out.append(f"speculative.algorithm {spec.algorithm!r}: DSpark is the only speculative method for "
                   "DeepSeek-V4.1 (V4.1 dropped the MTP module; runtime.md §A.11 rejects every other algorithm)")
    if not spec.enabled and spec.block_size is not None:
        out.append("speculative.block_size is set but speculative.algorithm is 'none'")
    if spec.enabled and spec.block_size is None:
        out.append("speculative.block_size must be given with DSpark (the checkpoint's dspark_block_size, 5 for Flash)")
    if not spec.enabled and (spec.adaptive_verification is not None or spec.sps_table is not None):
        out.append("speculative.adaptive_verification / sps_table are set but speculative.algorithm is 'none'")
    if spec.enabled and spec.adaptive_verification and kind.is_cpu:
        out.append("speculative.adaptive_verification on CPU: SGLang 0.5.17's DSpark worker runs on CUDA only")
    synthetic = spec.synthetic_acceptance_length
    if synthetic is not None and not spec.enabled:
        out.append("speculative.synthetic_acceptance_length is set but speculative.algorithm is 'none'")
    elif synthetic is not None and spec.block_size is not None and synthetic > spec.block_size + 1:
        out.append(f"speculative.synthetic_acceptance_length {synthetic} exceeds block_size + 1 = {spec.block_size + 1} "
                   "(a round emits at most the block and the bonus token)")
    elif synthetic is not None and adaptive_verification(c):
        out.append("speculative.synthetic_acceptance_length needs speculative.adaptive_verification: false "
                   "(SGLang simulates acceptance on a verify-all schedule only)")
    if spec.sps_table is not None and spec.enabled and not adaptive_verification(c):
        out.append("speculative.sps_table is set but adaptive verification is off (the table only sizes "
                   "adaptive verify lengths)")
    if f.kv_layout == "v41" and not kind.supports_v41_kv_layout:
        out.append(f"features.kv_layout v41 needs SM100/SM103 or gfx950; {hw.gpu} ({kind.arch}) only has the v4 "
                   "layout (runtime.md §A.3)")
    if c.engram.placement == "host" and kind.is_cpu:
        out.append("engram.placement host pins host memory for GPU reads (cudaHostRegister/UVA); on CPU the "
                   "tables are already in host memory: use placement device")
    if c.engram.placement == "host" and c.engram.host_layout != "per_rank":
        out.append(f"engram.host_layout {c.engram.host_layout!r} with engram.placement host: this runtime implements "
                   "per_rank only (each TP rank pins its own block of Engram rows in host memory; lookups "
                   "all-reduce); shared (one memfd mapping for the whole TP group, runtime.md §A.7) is not "
                   "implemented — set engram.host_layout: per_rank")
    replay = f.bounded_replay
    if kind.is_rocm and (replay.encoder or replay.decoder):
        out.append("features.bounded_replay must be off on ROCm (the card: ROCm needs --no-swa-bounded-replay)")
    if replay.encoder:
        if c.serving.max_running_requests is None:
            out.append("features.bounded_replay.encoder needs serving.max_running_requests (its request-window "
                       "budget is fixed per slot; runtime.md §A.4)")
        cps = c.serving.chunked_prefill_size
        if cps is None or cps < 128 + PAGE_SIZE:
            out.append(f"features.bounded_replay.encoder needs serving.chunked_prefill_size ≥ {128 + PAGE_SIZE} "
                       "(window + one page; runtime.md §A.4)")
        if c.pd is not None:
            out.append("features.bounded_replay.encoder is rejected with PD disaggregation (the decode pool "
                       "never replays; runtime.md §A.4)")
    if replay.decoder and c.cuda_graph.prefill == "full":
        out.append("features.bounded_replay.decoder allows only breakable or disabled prefill CUDA graphs "
                   "(runtime.md §A.9); set cuda_graph.prefill accordingly")
    if kind.is_cpu and (c.cuda_graph.decode not in (None, "disabled") or c.cuda_graph.prefill not in (None, "disabled")):
        out.append("CUDA graphs need a GPU: cuda_graph.decode/prefill must be unset or 'disabled' on CPU")
    a2a = c.serving.moe_a2a_backend
    if a2a not in (None, "none") and par.ep == 1:
        out.append(f"serving.moe_a2a_backend {a2a!r} needs expert parallelism (parallel.ep > 1)")
    if a2a not in (None, "none", "megamoe") and not f.text_only:
        out.append(f"serving.moe_a2a_backend {a2a!r}: the V4.1 vision path refuses MoE all-to-all except MegaMoE "
                   "(runtime.md §A.1); use megamoe or set features.text_only")
    if a2a == "megamoe":
        cps = c.serving.chunked_prefill_size
        cap = int(c.serving.env.get(MEGAMOE_TOKENS_ENV, MEGAMOE_TOKENS_DEFAULT))
        if cps is None or cps <= 0:
            out.append("serving.moe_a2a_backend megamoe requires serving.chunked_prefill_size > 0 "
                       "(SGLang 0.5.17 bounds MegaMoE's per-rank buffer by the prefill chunk)")
        else:
            per_rank = -(-cps // par.dp_attention)
            if per_rank > cap:
                out.append(f"serving.chunked_prefill_size {cps} gives {per_rank} tokens per rank, above MegaMoE's "
                           f"{cap} ({MEGAMOE_TOKENS_ENV}); lower the chunk or raise that env in serving.env")
    # --- PD ------------------------------------------------------------------------------------
    if c.pd is not None:
        if c.pd.prefill.bootstrap_port is None:
            out.append("pd.prefill.bootstrap_port is required (the decode side fetches KV through it)")
        if c.pd.decode.bootstrap_port is not None:
            out.append("pd.decode.bootstrap_port is meaningless: only the prefill server bootstraps transfers")
        if kind.is_cpu and c.pd.transfer_backend == "nixl":
            out.append("pd.transfer_backend nixl needs GPUs; on CPU use mooncake_tcp (spec cpu.md §5)")
        same_host = c.pd.prefill.url_host == c.pd.decode.url_host
        if same_host and c.pd.prefill.port == c.pd.decode.port:
            out.append("pd.prefill.port and pd.decode.port collide on the same host")
        if same_host and not kind.is_cpu:
            lo, hi = sorted((c.pd.prefill.base_gpu_id, c.pd.decode.base_gpu_id))
            if hi - lo < hw.gpus:
                out.append(f"pd.prefill and pd.decode share GPUs on one host: base_gpu_id {lo} and {hi} are less "
                           f"than hardware.gpus ({hw.gpus}) apart")
            if hi + hw.gpus > hw.per_node:
                out.append(f"pd roles need GPUs {lo}..{hi + hw.gpus - 1} on one host, which has {hw.per_node}; "
                           "give the roles different url_host values to run them on separate hosts")
    return out


def problems(c: DeploymentConfig) -> list[str]:
    """All broken rules of an already-built config (e.g. after overrides), for error reports."""
    return _illegal_combinations(c)


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid deployment config"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(config)"
        msg = str(e["msg"]).removeprefix("Value error, ")
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def config_from_dict(data: Any, source: str = "<config>") -> DeploymentConfig:
    if not isinstance(data, dict):
        raise DeployConfigError(f"{source}: a deployment config is a YAML mapping, got {type(data).__name__}")
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as e:
        raise DeployConfigError(_format_validation_error(source, e)) from None


def _read_yaml(path: str | Path) -> Any:
    """The parsed YAML of a config file; a missing / unreadable file or bad YAML is a
    `DeployConfigError` naming the file (the CLIs print it as one line)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise DeployConfigError(f"no deployment config at {p} (--config)") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise DeployConfigError(f"cannot read the deployment config {p} (--config): "
                                f"{e.strerror if isinstance(e, OSError) else e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DeployConfigError(f"{p}: not valid YAML ({e})") from None


def load_config(path: str | Path) -> DeploymentConfig:
    return config_from_dict(_read_yaml(path), str(Path(path)))


def raw_config(path: str | Path) -> dict[str, Any]:
    """The YAML mapping as written (for `--set` overrides before validation)."""
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise DeployConfigError(f"{path}: a deployment config is a YAML mapping")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """`a.b.c=value` → data['a']['b']['c'] = yaml(value). Unknown keys fail at validation."""
    if "=" not in assignment:
        raise DeployConfigError(f"--set expects KEY=VALUE (dotted key), got {assignment!r}")
    key, value = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise DeployConfigError(f"--set: empty key in {assignment!r}")
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise DeployConfigError(f"--set {key}: {p!r} is not a mapping in this config")
        node = child
    node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
