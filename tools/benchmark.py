#!/usr/bin/env python
"""Benchmarks: ``python tools/benchmark.py NAME [args]`` or ``all``.

Each benchmark is a module ``tools/bench/NAME.py`` with ``main(argv)``; it prints its
measurements as ratios against a reference measured in the same run.
"""

import importlib
import pathlib
import sys

BENCH_DIR = pathlib.Path(__file__).resolve().parent / "bench"
ROOT = BENCH_DIR.parent.parent


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def run(name: str, argv: list[str]) -> None:
    # imported as a module (not from a file path) so spawned worker processes can import it
    importlib.import_module(f"bench.{name}").main(argv)


def main() -> None:
    sys.path[:0] = [str(ROOT), str(BENCH_DIR.parent)]
    names = available()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        print("available:", ", ".join(names) or "(none yet)")
        return
    name, argv = sys.argv[1].replace("-", "_"), sys.argv[2:]   # plan-check: plan_check
    if name == "all":
        for n in names:
            print(f"===== {n} =====", flush=True)
            run(n, argv)
    elif name in names:
        run(name, argv)
    else:
        sys.exit(f"unknown benchmark {name!r}; available: {', '.join(names)}")


if __name__ == "__main__":
    main()
