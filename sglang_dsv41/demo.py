"""`sglang-dsv41 demo`: one chat request through the whole CPU stack, no server.

Makes the tiny checkpoint if it is missing (`serve.tiny_checkpoint`), resolves thinking and
reasoning effort with the card's rules (`api.effort`), renders the conversation with
deepseek-recipe's V4.1 encoder (`api.encoding`, the same path the server uses), encodes it
with the checkpoint's tokenizer and generates with the pure-PyTorch reference. Prints the
prompt, the token ids, the decoded reply and the timing.

On the tiny random checkpoint the reply is noise: the demo shows the pipeline, not the model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang-dsv41 demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint directory (default: the tiny checkpoint, made if missing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny checkpoint (default 0)")
    p.add_argument("--prompt", default="What is 17*19?", help="user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--thinking", choices=("on", "off"), default=None,
                   help="chat_template_kwargs.thinking (default: the card's default, on)")
    p.add_argument("--effort", default=None,
                   help="chat_template_kwargs.reasoning_effort: low/high/xhigh/max or 1-100")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--cache", choices=("none", "fp8", "fp4"), default="none",
                   help="KV-cache quantisation profile of the reference (spec §3.8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def run(args: argparse.Namespace) -> dict:
    from transformers import PreTrainedTokenizerFast

    from .api.effort import effort_table_from_env, resolve_reasoning
    from .api.encoding import encode_chat, render_chat
    from .api.prompt_tokens import PromptTokenEncoder
    from .reference.model import ReferenceModel
    from .reference.state import NumericsProfile
    from .serve import tiny_checkpoint

    t0 = time.perf_counter()
    ckpt = args.checkpoint if args.checkpoint is not None else tiny_checkpoint(args.seed)
    t_ckpt = time.perf_counter() - t0

    kwargs: dict = {}
    if args.thinking is not None:
        kwargs["thinking"] = args.thinking == "on"
    if args.effort is not None:
        kwargs["reasoning_effort"] = int(args.effort) if args.effort.isdigit() else args.effort
    decision = resolve_reasoning(chat_template_kwargs=kwargs, top_level_effort=None,
                                 table=effort_table_from_env())
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    rendered = render_chat(messages, decision=decision)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    prompt_ids = encode_chat(rendered, PromptTokenEncoder(tokenizer))

    t1 = time.perf_counter()
    model = ReferenceModel.from_checkpoint(ckpt, NumericsProfile.parse(args.cache), device=args.device)
    t_load = time.perf_counter() - t1

    t2 = time.perf_counter()
    out = model.generate(prompt_ids, args.max_new_tokens, stop_ids=model.cfg.eos_ids)
    t_gen = time.perf_counter() - t2
    return {
        "checkpoint": str(ckpt),
        "thinking": decision.thinking,
        "effort": decision.effort,
        "prompt": rendered.text,
        "prompt_ids": prompt_ids,
        "output_ids": out,
        "output_text": tokenizer.decode(out, skip_special_tokens=False),
        "seconds": {"checkpoint": round(t_ckpt, 3), "load": round(t_load, 3), "generate": round(t_gen, 3)},
        "tokens_per_second": round(len(out) / t_gen, 2) if t_gen > 0 else None,
    }


def cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.max_new_tokens < 1:
        print("sglang-dsv41 demo: --max-new-tokens must be ≥ 1", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["seconds"]
    print(f"checkpoint : {result['checkpoint']}  ({s['checkpoint']} s to find/make, {s['load']} s to load)")
    print(f"reasoning  : thinking={'on' if result['thinking'] else 'off'}"
          + (f", effort={result['effort']}" if result["thinking"] else ""))
    print(f"prompt     : {result['prompt']!r}")
    print(f"prompt ids : {result['prompt_ids']}  ({len(result['prompt_ids'])} tokens)")
    print(f"output ids : {result['output_ids']}")
    print(f"output     : {result['output_text']!r}")
    print(f"generate   : {s['generate']} s, {result['tokens_per_second']} tokens/s "
          "(pure-PyTorch reference; tiny random weights, so the text is noise)")
    return 0
