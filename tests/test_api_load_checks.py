"""The checks of `benchmarks/load.py` on made-up streams (no server): each failure the load test
must catch is caught (issue 20 item 3)."""
from __future__ import annotations

import pytest

from benchmark_loader import load_benchmark

load = load_benchmark("load.py")
POOL = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}


def chunk(content: str | None = None, finish: str | None = None, usage: dict | None = None,
          cid: str = "a", index: int = 0) -> dict:
    delta = {} if content is None else {"content": content}
    return {"id": cid, "object": "chat.completion.chunk",
            "choices": [] if usage else [{"index": index, "delta": delta, "finish_reason": finish}],
            **({"usage": usage} if usage else {})}


def fold(group: str, chunks: list, max_tokens: int = 4) -> "load.Outcome":
    outcome, ids = load.Outcome(group, status=200, done=True), set()
    for c in chunks:
        load.check_chunk(c, outcome, ids, max_tokens)
    if len(ids) != 1:
        outcome.garbled.append("ids")
    return outcome


GOOD = [chunk("ab"), chunk("c", "length"),
        chunk(usage={"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 32}})]


def test_a_good_stream_is_clean() -> None:
    outcome = fold("prefix", GOOD)
    assert (outcome.garbled, outcome.text, outcome.finish_reason, outcome.cached_tokens) == ([], "abc", "length", 32)


@pytest.mark.parametrize("bad", [
    [chunk("a"), "not a dict", chunk("b", "stop"), chunk(usage={"completion_tokens": 2})],
    [chunk("a", "stop"), chunk("b", "stop"), chunk(usage={"completion_tokens": 2})],
    [chunk("a"), chunk("b", "stop", cid="other"), chunk(usage={"completion_tokens": 2})],
    [chunk("a", index=1), chunk("b", "stop"), chunk(usage={"completion_tokens": 2})],
    [chunk("a", "stop"), chunk(usage={"completion_tokens": 9})],
])
def test_garbled_streams_are_caught(bad: list) -> None:
    assert fold("distinct", bad).garbled


def _summary(outcomes, solo_text="abc", after=None):
    solo = fold("identical", GOOD)
    solo.text = solo_text
    return load.summarize(outcomes, solo, fold("prefix", GOOD), POOL, after or POOL, 1.0, len(outcomes), 4)


def test_summary_passes_only_when_every_check_does() -> None:
    good = [fold(g, GOOD) for g in ("identical", "identical", "prefix", "distinct")]
    assert _summary(good)["passed"]
    lost = load.Outcome("distinct", status=500, error="boom")
    no_done = fold("distinct", GOOD)
    no_done.done = False
    cases = {
        "lost": good + [lost],
        "streams_without_done": good + [no_done],
        "identical_prompts_identical_text": good[:1] + [fold("identical", [chunk("x", "length"),
                                                         chunk(usage={"completion_tokens": 1})])] + good[2:],
        "shared_prefix_cache_hits": good + [fold("prefix", [chunk("a", "stop"), chunk(usage={"completion_tokens": 1})])],
    }
    for check, outcomes in cases.items():
        result = _summary(outcomes)
        assert not result["passed"] and not result["checks"][check], check
    leaked = _summary(good, after={**POOL, "num_running_reqs": 1, "num_used_tokens": 7})
    assert not leaked["checks"]["no_leaked_requests"] and not leaked["checks"]["pool_back_to_baseline"]


def test_request_plan_groups() -> None:
    plan = load.request_plan(64)
    groups = [g for g, _ in plan]
    assert groups.count("identical") == groups.count("prefix") == 16 and len(plan) == 64
    assert len({m[-1]["content"] for g, m in plan if g == "identical"}) == 1
    assert {m[0]["content"] for g, m in plan if g == "prefix"} == {load.SHARED_SYSTEM}
    assert len({m[-1]["content"] for g, m in plan if g != "identical"}) == 48
