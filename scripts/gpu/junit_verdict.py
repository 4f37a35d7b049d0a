"""The verdict of one device pytest run from its exit status and its junit file (every summary in
scripts/gpu/ judges its tests here).

A run passes only when all of these hold:
* pytest's exit status is 0 (a run killed at its cap reads 124 / 137, an interrupted one 2);
* the junit file parses and records the collected count (`collected`, the suite property
  tests/conftest.py writes), or the caller gives `expected`;
* it holds exactly that many test cases, every one named (an interrupted run leaves an unnamed
  entry for the test it stopped in), none with a failure or error entry.
Skips are counted, not failures (a GPU test may skip on another architecture).

    python scripts/gpu/junit_verdict.py JUNIT_XML RC [EXPECTED]   # prints the verdict; exit 0 iff it passes
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: the junit suite property tests/conftest.py records the collected (selected) test count in
COLLECTED_PROPERTY = "collected"


def verdict(junit: Path, rc: int | str | None, expected: int | None = None) -> dict:
    """{pass, why (the reasons it does not pass), rc, collected, total, passed, failed, unnamed,
    skipped}; never raises (a missing or malformed file is a reason)."""
    why: list[str] = []
    try:
        rc = int(rc) if rc is not None and str(rc).strip() != "" else None
    except ValueError:
        rc = None
    if rc != 0:
        why.append(f"pytest exit status {rc}" if rc is not None else "pytest exit status unknown")
    res: dict = dict(rc=rc)
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as exc:
        why.append(f"no junit result: {type(exc).__name__}: {exc}"[:300])
        return dict(res, why=why, **{"pass": False})
    cases = list(root.iter("testcase"))
    named = [c for c in cases if c.get("name")]
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in named
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = sum(c.find("skipped") is not None for c in named)
    collected = None
    for prop in root.iter("property"):
        if prop.get("name") == COLLECTED_PROPERTY:
            try:
                collected = int(prop.get("value", ""))
            except ValueError:
                pass
    want = expected if expected is not None else collected
    res.update(collected=collected, expected=expected, total=len(named), unnamed=len(cases) - len(named),
               passed=len(named) - len(failed) - skipped, failed=failed, skipped=skipped)
    if res["unnamed"]:
        why.append(f"{res['unnamed']} unnamed test case(s): the run was interrupted")
    if failed:
        why.append(f"{len(failed)} failed or errored")
    if want is None:
        why.append("no collected count in the junit file (tests/conftest.py's suite property) and none expected")
    elif len(named) != want:
        why.append(f"{len(named)} test cases reported of {want} {'expected' if expected is not None else 'collected'}")
    if not named:
        why.append("no test ran")
    return dict(res, why=why, **{"pass": not why})


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    v = verdict(Path(argv[0]), argv[1], int(argv[2]) if len(argv) == 3 else None)
    print(json.dumps(v))
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
