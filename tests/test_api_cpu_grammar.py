"""Regression test for `sglang_dsv41.api.cpu_grammar`: SGLang 0.5.17's `XGrammarGrammar` bitmask
on the CPU (pinned allocation and a GPU-only apply killed the CPU server on the first
grammar-constrained request; found by `tests/test_api_server.py`)."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from sglang_dsv41 import hooks
from sglang_dsv41.checkpoint.tokenizer import build_tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}


@pytest.fixture(scope="module")
def grammar(tmp_path_factory: pytest.TempPathFactory):
    """A real SGLang `XGrammarGrammar` for a JSON schema over the tiny tokenizer, hooks installed."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    from sglang_dsv41.api.register import register_api

    register_api()
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    tok = PreTrainedTokenizerFast.from_pretrained(
        str(build_tiny_tokenizer(Path(tmp_path_factory.mktemp("grammar_tok")))))
    vocab_size = len(tok)
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    ctx = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA)
    g = XGrammarGrammar(xgrammar.GrammarMatcher(ctx), vocab_size, ctx, override_stop_tokens=None)
    g.tok, g.test_vocab_size = tok, vocab_size
    return g


def _spec(name: str) -> hooks.HookSpec:
    return next(s for s in hooks.HOOKS if s.target.endswith(f"XGrammarGrammar.{name}"))


def test_hooks_are_installed(grammar) -> None:
    assert hooks.is_applied(_spec("allocate_vocab_mask")) and hooks.is_applied(_spec("apply_vocab_mask"))


def test_sglang_alone_cannot_apply_a_mask_to_cpu_logits(grammar) -> None:
    """Pins the upstream gap the hooks close (when SGLang fixes it, the hooks can go)."""
    original_apply = inspect.unwrap(hooks.resolve_target(_spec("apply_vocab_mask").target))
    mask = torch.full((1, (grammar.test_vocab_size + 31) // 32), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Unsupported device"):
        original_apply(grammar, torch.zeros(1, grammar.test_vocab_size), mask)
    if not torch.cuda.is_available():
        original_allocate = inspect.unwrap(hooks.resolve_target(_spec("allocate_vocab_mask").target))
        with pytest.raises(RuntimeError):
            original_allocate(grammar, grammar.test_vocab_size, 1, "cpu")


def test_cpu_mask_constrains_only_its_row(grammar) -> None:
    from sglang.srt.constrained.base_grammar_backend import GrammarMask

    n = grammar.test_vocab_size
    mask = grammar.allocate_vocab_mask(vocab_size=n, batch_size=2, device="cpu")
    assert mask.device.type == "cpu" and not mask.is_pinned() and bool((mask == -1).all())
    grammar.fill_vocab_mask(mask, 0)                      # row 0: what the JSON grammar allows
    logits = torch.randn(2, n, generator=torch.Generator().manual_seed(0))
    free_row = logits[1].clone()
    GrammarMask(grammar, mask).apply(logits)              # SGLang's call, keyword arguments
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < n
    assert all(grammar.tok.decode([t]).lstrip().startswith("{") or grammar.tok.decode([t]).isspace()
               for t in allowed)                          # a JSON object starts with "{"
    assert torch.equal(logits[1], free_row)               # an unconstrained row is untouched
