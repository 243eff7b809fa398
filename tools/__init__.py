"""Command-line tools, each run as ``python tools/NAME.py``, and the benchmarks
(``tools.bench``, run by ``tools/benchmark.py``)."""
