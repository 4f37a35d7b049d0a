"""Shared pytest set-up.

* `gpu` tests are skipped when CUDA is absent (CI has no GPU) — a skip is not a pass: they are
  run on the GPU machine and logged in docs/validation.md.
* `tiny_checkpoint`: one tiny checkpoint per test session, made with the real writer.
* With --junitxml the file records the collected test count (suite property `collected`).
* Child pytest runs under the Triton interpreter (each `test_kernel_cases_in_triton_interpreter`,
  and tests marked `child_run(*argv)`) are queued when collection ends and run ahead on a spare
  core at nice 19 (`child_runs`); the tests then assert on their output.
* `shared_servers`: servers shared by several modules (`shared_servers.GROUPS`); the modules of a
  group run next to each other and the server stops after the group's last collected test; a
  group's server is launched ahead, at nice 19, a few modules before its first test
  (`shared_servers.prestart_plan`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings


# Tiny CPU forwards are dominated by per-op overhead; on a 2-core machine shared with SGLang
# server subprocesses, one intra-op thread is both faster and steadier.
torch.set_num_threads(1)

# Property tests are judged on their examples, never on this host's speed: no per-example deadline
# and no `too_slow` health check (both time the test; a loaded 2-core CI machine fails either on a
# run a faster one passes). A test's own @settings still override the other fields.
settings.register_profile("host_independent", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("host_independent")

# Triton 3.6's interpreter under NumPy ≥ 2.4, and its nested device calls without a rescan of
# triton.language (tests/triton_interp_compat.py). The wraps touch only the interpreter: child runs
# under TRITON_INTERPRET=1 and the interpreted module copies some tests make in this process.
import triton_interp_compat  # noqa: E402

triton_interp_compat.install()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "child_run(*argv): the test asserts on `child_runs.run(argv)`; "
                                       "conftest prefetches it (tests/child_runs.py)")


def pytest_collection_finish(session: pytest.Session) -> None:
    import child_runs
    from shared_servers import group_of, prestart_plan
    from triton_checks import kernel_cases_argv

    _LAST_OF_GROUP.clear()
    for item in session.items:
        group = group_of(item.path.name)
        if group is not None:
            _LAST_OF_GROUP[group] = item.nodeid

    _PRESTART.clear()
    runs: list[str] = []                  # module files in run order, one entry per module run
    position: dict[str, int] = {}
    for i, item in enumerate(session.items):
        if i == 0 or session.items[i - 1].path != item.path:
            runs.append(item.path.name)
        position[item.nodeid] = len(runs) - 1
    plan = prestart_plan(runs)
    for nodeid, pos in position.items():
        groups = [name for name, (start, first) in plan.items() if start <= pos < first]
        if groups:
            _PRESTART[nodeid] = groups

    argvs = []
    for item in session.items:
        if any(m.name == "skip" for m in item.iter_markers()) or "gpu" in item.keywords:
            continue
        mark = item.get_closest_marker("child_run")
        if mark is not None:
            argvs.append(tuple(mark.args))
        elif item.name == "test_kernel_cases_in_triton_interpreter":
            argvs.append(kernel_cases_argv(item.path))
    child_runs.prefetch(argvs)


_LAST_OF_GROUP: dict[str, str] = {}     # shared-server group -> node id of its last collected test
_SHARED: list = []                      # the session's SharedServers, once a test asked for it
_PRESTART: dict[str, list[str]] = {}    # node id -> shared-server groups to launch ahead at its start


@pytest.fixture(autouse=True)
def _prestart_shared_servers(request: pytest.FixtureRequest) -> None:
    groups = _PRESTART.get(request.node.nodeid)
    if groups:
        servers = request.getfixturevalue("shared_servers")
        for group in groups:
            servers.prestart(group)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    for group, nodeid in _LAST_OF_GROUP.items():
        if nodeid == item.nodeid and _SHARED:
            _SHARED[0].stop(group)
    return result


@pytest.fixture(scope="session", autouse=True)
def _junit_collected_count(request: pytest.FixtureRequest, record_testsuite_property) -> None:
    """The collected test count as the junit suite property `collected`: a device run whose junit
    reports fewer test cases was cut short (scripts/gpu/junit_verdict.py)."""
    record_testsuite_property("collected", len(request.session.items))


@pytest.fixture(scope="session")
def shared_servers(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    from shared_servers import SharedServers

    servers = SharedServers(tiny_checkpoint, tmp_path_factory)
    _SHARED.append(servers)
    try:
        yield servers
    finally:
        servers.stop_all()
        _SHARED.remove(servers)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import child_runs

    child_runs.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from shared_servers import grouped_order

    items[:] = grouped_order(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine; see docs/validation.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sglang_dsv41.checkpoint.synth import make_checkpoint

    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0, progress=False)
