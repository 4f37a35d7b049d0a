"""End to end on CPU: `sglang-dsv41 launch --config configs/tiny-cpu.yaml` (no dry run) starts a
server that answers `/generate` and `/v1/chat/completions` (issue 5 with issue 3's runtime).

Exactly as a user runs it: the launcher makes the tiny checkpoint in the (empty, per-test) cache,
builds the CPU environment, adds the config's flags and the V4.1 parser names, and `exec`s
SGLang, which applies the plugin's server defaults (attention backend, page size, sleep-on-idle). One server
(`launched_server`: the one-module ``launch`` group of tests/shared_servers.py); every wait bounded; the process group is killed (`tests/server_helpers.py`, shared
with `tests/test_runtime_server.py`, which checks the numerics in depth — here a short greedy
continuation is compared with the reference once, and the chat reply is checked to pass through
the V4.1 reasoning parser).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_helpers import Server, free_port
from sglang_dsv41.reference.model import ReferenceModel

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
NEW_TOKENS = 6


class LaunchedServer(Server):
    """`Server`'s waits, requests and process-group stop, started through `sglang-dsv41 launch`
    (only the command line differs from `Server.__init__`)."""

    def __init__(self, config: Path, cache_home: Path, log: Path) -> None:
        self.port = free_port()
        self.log_path = log
        self.device = "cpu"
        self.cache_home = cache_home
        env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
        argv = [sys.executable, "-m", "sglang_dsv41.cli", "launch", "--config", str(config), "--port", str(self.port)]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)


def launched_server(checkpoint: Path, log: Path) -> LaunchedServer:
    """This module's server, on an empty cache next to its log (`checkpoint` unused: the launcher
    makes its own); launched by `shared_servers` (group ``launch``) so it can start ahead."""
    cache_home = log.parent / "cache"
    cache_home.mkdir()
    return LaunchedServer(CONFIG, cache_home, log)


@pytest.fixture(scope="module")
def launched(shared_servers) -> LaunchedServer:
    return shared_servers.get("launch")


@pytest.fixture(scope="module")
def cache_home(launched: LaunchedServer) -> Path:
    return launched.cache_home


def test_launch_serves_the_config_with_the_runtime_flags_and_parsers(launched: LaunchedServer,
                                                                     cache_home: Path) -> None:
    info = launched.get("/get_server_info")
    assert info["model_path"] == str(cache_home / "sglang-dsv41" / "tiny-seed0")   # made by the launcher
    assert info["served_model_name"] == "tiny-dsv41" and info["device"] == "cpu"
    assert info["attention_backend"] == "torch_native" and info["sleep_on_idle"] is True
    assert info["max_total_tokens"] == 8192 and info["context_length"] == 2048          # from the config
    assert info["reasoning_parser"] == "deepseek-v41" and info["tool_call_parser"] == "deepseek-v41"


def test_generate_equals_the_reference(launched: LaunchedServer, cache_home: Path) -> None:
    prompt = [0, 17, 401, 93, 250, 611, 8, 77, 930, 12, 345]
    res = launched.generate(prompt, n=NEW_TOKENS)
    reference = ReferenceModel.from_checkpoint(cache_home / "sglang-dsv41" / "tiny-seed0")
    assert res["output_ids"] == reference.generate(prompt, NEW_TOKENS)


def test_chat_completion_goes_through_the_v41_reasoning_parser(launched: LaunchedServer) -> None:
    body = {"model": "tiny-dsv41", "messages": [{"role": "user", "content": "What is 17*19?"}],
            "max_tokens": 8, "temperature": 0}
    thinking = launched.post("/v1/chat/completions", body)            # nothing sent: thinking on (docs/api.md)
    msg = thinking["choices"][0]["message"]
    assert thinking["usage"]["completion_tokens"] == 8 and thinking["choices"][0]["finish_reason"] == "length"
    assert msg["reasoning_content"]                                  # the reply starts inside the trace
    plain = launched.post("/v1/chat/completions", {**body, "chat_template_kwargs": {"thinking": False}})
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert plain["usage"]["prompt_tokens"] < thinking["usage"]["prompt_tokens"]   # no effort line in the prompt


def test_the_config_serves_images(launched: LaunchedServer) -> None:
    """configs/tiny-cpu.yaml is not text-only: the card's image request is served (docs/vision.md)."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (96, 80), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = {"type": "text", "text": "What is in this image?"}
    body = {"model": "tiny-dsv41", "max_tokens": 4, "temperature": 0}
    plain = launched.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": [text]}]})
    image = launched.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, text]}]})
    assert image["choices"][0]["message"]["role"] == "assistant"
    assert image["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 1     # the image's span
