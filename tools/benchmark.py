#!/usr/bin/env python
"""Benchmarks: ``python tools/benchmark.py NAME [args]`` or ``all``.

Each benchmark is a module ``tools/bench/NAME.py`` with ``main(argv)``; it prints its
measurements as ratios against a reference measured in the same run. Modules whose name
starts with ``_`` are helpers of the benchmarks, not benchmarks. Shape flags use
Megatron-LM's names (``--num-layers``, ``--hidden-size``, ``--seq-length``,
``--micro-batch-size``, ...); ``--repeat`` is how many times a measurement is repeated.
"""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

BENCH_DIR = Path(__file__).resolve().parent / "bench"


def available() -> list[str]:
    """The benchmarks' names (helper modules, ``_*.py``, left out)."""
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def run(name: str, argv: list[str]) -> None:
    # imported by its package name so that spawned worker processes can import it too
    importlib.import_module(f"tools.bench.{name}").main(argv)


def main() -> None:
    names = available()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        print("available:", ", ".join(n.replace("_", "-") for n in names) or "(none yet)")
        return
    name, argv = sys.argv[1].replace("-", "_"), sys.argv[2:]   # plan-check: plan_check
    if name == "all":
        for n in names:
            print(f"===== {n} =====", flush=True)
            run(n, argv)
    elif name in names:
        run(name, argv)
    else:
        sys.exit(f"unknown benchmark {name!r}; available: "
                 f"{', '.join(n.replace('_', '-') for n in names)}")


if __name__ == "__main__":
    main()
