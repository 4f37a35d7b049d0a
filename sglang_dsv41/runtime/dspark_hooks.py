"""Implementations of the DSpark HookRegistry entries (the table is `sglang_dsv41.hooks`;
docs/dspark.md; integration.md §3.5).

* `config_draft_model_hook` — AFTER `ModelConfig._config_draft_model`: SGLang renames only the
  V4 architecture to its DSpark draft class; a draft `ModelConfig` of a V4.1 checkpoint gets ours,
  `DeepseekV41ForCausalLMDSpark` (`runtime/dspark_model.py`). DSpark is V4.1's only speculative
  method: another algorithm, or a checkpoint without DSpark stages, is refused with the reason.
* `draft_attention_backend_hook` — AROUND `draft_worker_common._resolve_draft_attention_backend_
  fallback`: SGLang falls back to flashinfer for a draft backend outside its list; a V4.1 draft
  keeps the V4.1 runtime's backend (`dsv41` / `torch_native`), whose `token_to_kv_pool` is the
  draft pool the draft model reads (`get_token_to_kv_pool()`). Other models are untouched.
* `commit_after_verify_hook` — AFTER `DSparkWorkerV2._commit_target_mamba_states_after_verify`
  (called once per verify step with the pre-verify lengths and `commit_lens` = 1 + accepted):
  a V4.1 target commits its staged verify block's Engram ids (`commit_dspark_verify`); pair-ring
  slots and rows of rejected positions need no commit (position-keyed, rewritten before read).
"""
from __future__ import annotations

from .hf_config import ARCHITECTURE, DRAFT_ARCHITECTURE

DSPARK = "DSPARK"


def _algorithm_name(algo) -> str | None:
    if algo is None:
        return None
    return str(getattr(algo, "name", algo)).upper()


def config_draft_model_hook(result, self, *args, **kwargs):
    """A V4.1 draft model config → our DSpark draft architecture (module doc)."""
    hf = getattr(self, "hf_config", None)
    archs = getattr(hf, "architectures", None) or []
    if not getattr(self, "is_draft_model", False) or not archs or archs[0] != ARCHITECTURE or not hasattr(hf, "parsed"):
        return result
    algo = _algorithm_name(getattr(self, "speculative_algorithm", None))
    if algo not in (None, DSPARK):
        raise ValueError(f"sglang-dsv41: --speculative-algorithm {algo}: DeepSeek-V4.1's only speculative method is "
                         "its bundled DSpark draft; use --speculative-algorithm DSPARK")
    text = hf.parsed().text
    if text.num_nextn_predict_layers < 1:
        raise ValueError("sglang-dsv41: this V4.1 checkpoint has no DSpark stages (num_nextn_predict_layers = 0): "
                         "drop --speculative-algorithm")
    hf.architectures[0] = DRAFT_ARCHITECTURE
    return result


def _runtime_backends() -> tuple[str, ...]:
    from .requirements import CURRENT_RUNTIME

    return tuple(CURRENT_RUNTIME.attention_backends)


def draft_attention_backend_hook(original, *args, **kwargs):
    """Keep the V4.1 runtime's attention backend for a V4.1 draft (module doc)."""
    from ..overrides import is_v41

    server_args = kwargs.get("draft_server_args", args[0] if args else None)
    if server_args is None or not is_v41(server_args):
        return original(*args, **kwargs)
    backend = server_args.speculative_draft_attention_backend
    if backend is None:
        backend, _ = server_args.get_attention_backends()
    if backend not in _runtime_backends():
        raise ValueError(f"sglang-dsv41: draft attention backend {backend!r}: the V4.1 DSpark draft runs on the V4.1 "
                         f"runtime's backends only ({', '.join(_runtime_backends())})")
    return backend


def commit_after_verify_hook(result, self, *args, batch=None, seq_lens_pre_verify=None, commit_lens=None, **kwargs):
    """Commit the V4.1 target's verify step (module doc); other targets are untouched."""
    model = self.target_worker.model_runner.model
    commit = getattr(model, "commit_dspark_verify", None)
    if commit is not None:
        if batch is None or seq_lens_pre_verify is None or commit_lens is None:
            raise RuntimeError("sglang-dsv41: DSpark verify commit called without batch / seq_lens_pre_verify / "
                               "commit_lens (SGLang's call changed: tests/test_hooks.py pins it)")
        commit(batch.req_pool_indices, seq_lens_pre_verify, commit_lens)
    return result
