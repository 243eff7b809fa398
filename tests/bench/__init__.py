"""The benchmarks under tools/bench, run on their smallest sizes."""
