"""DSpark speculative greedy decoding on a runtime engine, no server (tests/test_runtime_tp.py runs it
at TP 1 and in each TP-2 rank; docs/dspark.md "Tests").

`dspark_greedy(engine, ckpt)`: one request prefilled with the target's capture on; then rounds of
the real draft (the checkpoint's `mtp.*` stages, whole on every rank, `DSparkDraft`): block
forward over [anchor, noise × (γ − 1)] with the target's vocabulary-parallel embedding, base
logits through the target's gathered LM head, greedy Markov sampling; the target verifies
[anchor, d_0 … d_{γ−1}] in one forward (`verify_width` = γ + 1), `verify_greedy` accepts, the
accepted positions' captures become draft context rows (what SGLang's injector writes with
`commit_lens`) and the Engram history commits. Returns every round's draft and verify logits, the
commit lengths and the emitted tokens, so a TP-2 rank can be compared with TP 1 bit for bit and the tokens with plain
greedy decoding (`runtime_scenarios.greedy_generate`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from runtime_scenarios import Slots, prompt, run_batch
from sglang_dsv41.reference.dspark import block_token_ids
from sglang_dsv41.reference.dspark_verify import verify_greedy
from sglang_dsv41.runtime.batch import make_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.dspark_draft import DSparkDraft
from sglang_dsv41.runtime.dspark_kv import DSparkContextKV
from sglang_dsv41.runtime.dspark_weights import dspark_runtime_weights
from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype

CPU = torch.device("cpu")
DSPARK_PROMPT = prompt(61, 11)
ROUNDS = 2


def dspark_greedy(engine: TorchForward, ckpt: Path) -> dict[str, torch.Tensor]:
    from tp_harness import stored_tensors

    t = engine.text
    g, S, row = t.dspark_block_size, t.num_nextn_predict_layers, 1
    with fp32_default_dtype():
        draft = DSparkDraft(engine.cfg, dspark_runtime_weights(stored_tensors(ckpt), engine.cfg, CPU,
                                                                experts_mxfp4=False), deterministic=True)
    slots = Slots(CPU, rows=2, max_context=64)
    caches = RuntimeCaches.allocate(t, slots.num_slots(), 2, device=CPU, page_size=slots.page_size, pair_slots=8,
                                    verify_width=g + 1)
    store = DSparkContextKV(S, slots.num_slots(), t.head_dim, CPU)

    def commit_rows(first: int, n: int) -> None:
        """Context rows of the last forward's first n tokens (positions first..first+n−1)."""
        features = torch.cat([c[:n] for c in engine.captured], dim=1)
        positions = torch.arange(first, first + n)
        for s, values in enumerate(draft.context_rows(features, positions)):
            store.write_rows(s, slots.table[row, positions], values)

    out: dict[str, torch.Tensor] = {}
    commits: list[int] = []
    engine.set_capture_layers(t.dspark_target_layer_ids)
    try:
        P = len(DSPARK_PROMPT)
        first = run_batch(engine, caches, slots, [(row, 0, DSPARK_PROMPT)])[0]
        commit_rows(0, P)
        emitted = [int(torch.argmax(first[-1]))]
        for k in range(ROUNDS):
            anchor, rows = emitted[-1], torch.tensor([row])
            windows = [store.window(s, rows, slots.table, torch.tensor([P]), t.sliding_window) for s in range(S)]
            with fp32_default_dtype():
                hidden = draft.block_hidden(engine.embed, torch.tensor(block_token_ids(t, anchor)),
                                            torch.arange(P, P + g), windows)
                base = engine.logits(draft.final_norm(hidden))
            drafts, _ = draft.markov_head.sample_block(base.view(1, g, -1), first_prev_tokens=torch.tensor([anchor]),
                                                       hidden_states=None, sampler=lambda logits, _k: logits.argmax(-1))
            block = [anchor] + drafts.reshape(-1).tolist()
            out_slots = slots.extend(row, P, g + 1)
            layout = dataclasses.replace(make_layout(rows, torch.tensor([P]), torch.tensor([g + 1]),
                                                     torch.arange(P, P + g + 1), out_slots, slots.table),
                                         verify_width=g + 1)
            verify = engine.logits(engine.hidden_states(torch.tensor(block), layout, caches))
            outcome = verify_greedy(block[1:], verify)
            c = outcome.accepted + 1
            commit_rows(P, c)
            caches.engram_history.commit_verify(rows, torch.tensor([P]), torch.tensor([c]), check=True)
            out[f"dspark_draft_logits_{k}"], out[f"dspark_verify_logits_{k}"] = base, verify
            emitted += list(outcome.tokens)
            commits.append(c)
            P += c
    finally:
        engine.set_capture_layers(())
    out["dspark_tokens"], out["dspark_commits"] = torch.tensor(emitted), torch.tensor(commits)
    return out
