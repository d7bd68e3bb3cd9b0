"""Documentation that must stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from profstream.config import MONITOR_OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def test_every_monitor_option_is_documented_with_its_variable_and_default():
    doc = (ROOT / "docs" / "monitor.md").read_text()
    for opt in MONITOR_OPTIONS:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{opt.name}` |")), None)
        assert row is not None, f"docs/monitor.md lacks option {opt.name}"
        assert f"`{opt.env}`" in row
        if not callable(opt.default) and opt.default is not None:
            assert repr(opt.default) in row, f"docs/monitor.md shows a stale default for {opt.name}"
    documented = set(re.findall(r"^\| `(\w+)` \| `PROFSTREAM_", doc, re.M))
    assert documented == {o.name for o in MONITOR_OPTIONS}


def test_readme_names_exactly_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
