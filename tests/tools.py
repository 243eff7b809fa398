"""Import a script under tools/ in tests, from its file (the scripts are run as
``python tools/NAME.py``; the benchmarks are imported as ``tools.bench.NAME``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """Import ``tools/<name>.py`` as a module."""
    path = REPO / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
