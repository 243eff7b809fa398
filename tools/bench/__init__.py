"""The benchmarks: one module each with ``main(argv)``, run by ``tools/benchmark.py``;
``_ranks`` starts the gloo ranks of those that need several."""
