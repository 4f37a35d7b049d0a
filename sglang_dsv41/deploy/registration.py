"""Does the plugin really register? Load it the way SGLang does, in a fresh interpreter, and read
SGLang's registries back (used by `sglang-dsv41 doctor`).

`python -m sglang_dsv41.deploy.registration` runs SGLang 0.5.17's own `load_plugins()` (entry
point discovery, the `SGLANG_PLUGINS` allow-list, `HookRegistry.apply_hooks`) and prints one
line `REGISTRATION {json}` saying, per item, whether the registry now holds *our* object:
the config class for `model_type = deepseek_v41` (transformers and SGLang), the model class
under `DeepseekV41ForCausalLM`, and the reasoning / tool-call detectors under the names the
launcher passes (`capabilities.REASONING_PARSER` / `TOOL_CALL_PARSER`). A fresh process is the
point: the caller's process may already have registered things by hand, and a plugin that
fails to load stops its process (`PluginLoadError`), which must not stop `doctor`.

Invariant: `probe_registration` never raises for a broken plugin; it returns a report whose
`error` says what happened (exit status, the last lines of stderr, or a timeout).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

from .capabilities import REASONING_PARSER, TOOL_CALL_PARSER

MARKER = "REGISTRATION "
DEFAULT_TIMEOUT_S = 300.0
ITEMS = ("config", "model", "reasoning_parser", "tool_parser")


@dataclass(frozen=True)
class RegistrationReport:
    """Item → registered (ours) or not; `error` is set when the probe itself failed."""

    registered: dict[str, bool] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(self.registered.get(k, False) for k in ITEMS)

    def missing(self) -> list[str]:
        return [k for k in ITEMS if not self.registered.get(k, False)]


def read_registries() -> dict[str, bool]:
    """In this process, after `load_plugins()`: which of our objects SGLang's registries hold."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.parser.reasoning_parser import ReasoningParser
    from sglang.srt.utils.hf_transformers import common
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..api.reasoning_parser import DeepseekV41ReasoningDetector
    from ..api.tool_parser import DeepseekV41DsmlDetector
    from ..runtime.hf_config import ARCHITECTURE, MODEL_TYPE, DeepseekV41HFConfig
    from ..runtime.model import DeepseekV41ForCausalLM

    # transformers' lazy mapping answers `[]` / `in` for registered types, but its inherited
    # `.get` reads only the built-in table.
    auto_config = CONFIG_MAPPING[MODEL_TYPE] if MODEL_TYPE in CONFIG_MAPPING else None
    return {
        "config": common._CONFIG_REGISTRY.get(MODEL_TYPE) is DeepseekV41HFConfig
        and auto_config is DeepseekV41HFConfig,
        "model": ModelRegistry.models.get(ARCHITECTURE) is DeepseekV41ForCausalLM,
        "reasoning_parser": ReasoningParser.DetectorMap.get(REASONING_PARSER) is DeepseekV41ReasoningDetector,
        "tool_parser": FunctionCallParser.ToolCallParserEnum.get(TOOL_CALL_PARSER) is DeepseekV41DsmlDetector,
    }


def main() -> int:
    """Subprocess side: load plugins through SGLang and print the report line."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    print(MARKER + json.dumps(read_registries()), flush=True)
    return 0


def probe_registration(timeout_s: float = DEFAULT_TIMEOUT_S, python: str = sys.executable) -> RegistrationReport:
    """Run `main()` in a fresh interpreter (the caller's environment) and parse its report."""
    try:
        run = subprocess.run([python, "-m", __name__], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return RegistrationReport(error=f"loading the plugin through SGLang took longer than {timeout_s:.0f} s")
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(MARKER)]
    if run.returncode != 0 or not lines:
        tail = " | ".join(run.stderr.strip().splitlines()[-3:])
        return RegistrationReport(error=f"loading the plugin through SGLang exited with {run.returncode}: {tail}")
    return RegistrationReport(registered={k: bool(v) for k, v in json.loads(lines[-1][len(MARKER):]).items()})


if __name__ == "__main__":
    raise SystemExit(main())
