"""`shared_servers.grouped_order`: the modules of a shared-server group run next to each other, in
their collected order, and nothing else moves (no server starts here)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from shared_servers import GROUPS, group_of, grouped_order


def _items(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(path=Path("tests") / n, n=i) for i, n in enumerate(names)]


def test_group_modules_are_pulled_next_to_the_first():
    items = _items("test_a.py", "test_runtime_server.py", "test_runtime_server.py", "test_b.py",
                   "test_vision_server.py", "test_c.py", "test_vision_server.py")
    got = [(i.path.name, i.n) for i in grouped_order(items)]
    assert got == [("test_a.py", 0), ("test_runtime_server.py", 1), ("test_runtime_server.py", 2),
                   ("test_vision_server.py", 4), ("test_vision_server.py", 6), ("test_b.py", 3), ("test_c.py", 5)]


def test_without_groups_the_order_is_unchanged():
    items = _items("test_b.py", "test_a.py", "test_b.py")
    assert grouped_order(items) == items


def test_every_module_is_in_at_most_one_group():
    modules = [m for mods, _ in GROUPS.values() for m in mods]
    assert len(modules) == len(set(modules))
    assert all(group_of(m) is not None for m in modules) and group_of("test_config.py") is None
