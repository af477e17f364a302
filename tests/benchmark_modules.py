"""Import a script of benchmarks/ as a module, as the scripts import each other (`import harness`).

Not a test module: the tests of the benchmark scripts and of the docs' generated tables use it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py, with benchmarks/ importable for its own imports."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
