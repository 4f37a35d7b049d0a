"""SGLang's weight APIs on a real CPU server (issue 13 item 1; `runtime/quant_methods.py`).

One plain ``python -m sglang.launch_server`` on the tiny checkpoint (seed 0), started as
`test_plain_launch_server.py` starts it:

* ``/update_weights_from_disk`` to a second tiny checkpoint (seed 1, same config and tokenizer)
  succeeds, and greedy tokens then follow seed 1's reference (the numerics contract's margin);
  updating back gives the first tokens exactly;
* the start-up log reports the bytes the parameters hold, equal to the stored form's bytes
  processed on CPU (fp32 dense values, stored scale / Engram bytes);
* a second server with ``--load-format dummy`` starts (the model streams valid random weights in
  the stored formats through its own loader, `runtime/dummy_weights.py`) and generates.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from server_helpers import running
from test_plain_launch_server import PlainServer, dry_run_environment
from sglang_dsv41.checkpoint.synth import make_checkpoint
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.reference.model import ReferenceModel

pytestmark = pytest.mark.slow

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def env(tiny_checkpoint: Path) -> dict[str, str]:
    return dry_run_environment(tiny_checkpoint)[0]


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_seed1") / "ckpt", seed=1, progress=False)


@pytest.fixture(scope="module")
def server(shared_servers) -> PlainServer:
    """The shared ``plain`` server (tests/shared_servers.py), started as `test_plain_launch_server.py`
    describes; the swap test puts the first weights back."""
    return shared_servers.get("plain")


def _update(server, path: Path) -> dict:
    """`/update_weights_from_disk` once the scheduler holds no request: SGLang flushes the cache
    after the update and asserts it could, which it cannot while a just-answered request is
    still in its running batch (overlap scheduling)."""
    deadline = time.monotonic() + 60
    while any(rank["num_reqs"] for rank in server.get("/get_load")):
        assert time.monotonic() < deadline, "server still busy after 60 s"
        time.sleep(0.5)
    return server.post("/update_weights_from_disk", {"model_path": str(path)})


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(11)
    return [0] + torch.randint(3, 990, (17,), generator=g).tolist()


def test_update_weights_from_disk_swaps_the_weights_and_back(server, tiny_checkpoint, other_checkpoint) -> None:
    from test_runtime_server import within_contract

    prompt = _prompt()
    first = server.generate(prompt, NEW_TOKENS)["output_ids"]
    answer = _update(server, other_checkpoint)
    assert answer["success"], answer
    swapped = server.generate(prompt, NEW_TOKENS)["output_ids"]
    assert swapped != first
    assert within_contract(ReferenceModel.from_checkpoint(other_checkpoint), prompt, swapped)
    back = _update(server, tiny_checkpoint)
    assert back["success"], back
    assert server.generate(prompt, NEW_TOKENS)["output_ids"] == first


def test_start_up_log_reports_the_parameters_bytes(server, tiny_checkpoint) -> None:
    from test_runtime_weight_loading import expected_cpu_bytes

    logged = re.findall(r"parameters hold ([0-9.]+) GiB", server.log_tail(10**7))
    assert logged, "no parameter memory line in the server log"
    assert abs(float(logged[0]) - expected_cpu_bytes(DeepseekV41Config.from_file(tiny_checkpoint)) / 2**30) < 1e-3


def test_dummy_load_format_serves(tiny_checkpoint, env, tmp_path_factory) -> None:
    log = tmp_path_factory.mktemp("dummy") / "server.log"
    with running(PlainServer(["--model-path", str(tiny_checkpoint), "--device", "cpu", "--load-format", "dummy"],
                             env, log)) as srv:
        out = srv.generate(_prompt(), NEW_TOKENS)["output_ids"]
        assert len(out) == NEW_TOKENS
        log_text = srv.log_tail(10**7)
        _serving_e2e_client_and_report(srv, tmp_path_factory.mktemp("e2e"))
        assert "dummy weights: valid random values in the stored formats generated on cpu" in log_text
        assert "streamed" in log_text and "weights filled by the loader" not in log_text


def _serving_e2e_client_and_report(srv, out: Path) -> None:
    """benchmarks/serving_e2e.py's client (closed loop, streamed /generate) against this server at
    tiny lengths, then its report pairing the run with a copy of itself (every ratio 1)."""
    from benchmark_loader import load_benchmark

    e2e = load_benchmark("serving_e2e.py")
    assert e2e.main(["client", "--label", "ours", "--out-dir", str(out), "--url", srv.url(""), "--concurrency", "1",
                     "2", "--input-len", "12", "--output-len", "4", "--rounds", "1", "--min-requests", "2",
                     "--id-range", "3", "900", "--level-timeout-s", "120"]) == 0
    rec = json.loads((out / "ours.json").read_text())
    assert [lv["concurrency"] for lv in rec["levels"]] == [1, 2]
    for lv in rec["levels"]:
        assert lv["n_errors"] == 0 and lv["requests"] == 2 and lv["output_tokens_per_s"] > 0
        assert lv["ttft_s"]["p50"] > 0 and lv["itl_s"]["p50"] > 0
    (out / "sglang_v4.json").write_text(json.dumps(rec))
    assert e2e.main(["report", str(out), "--out", str(out / "e2e_report.json")]) == 0
    ratios = json.loads((out / "e2e_report.json").read_text())["ratios"]["ours/sglang_v4"]["per_concurrency"]
    assert [r["output_tokens_per_s"] for r in ratios] == [1.0, 1.0]
