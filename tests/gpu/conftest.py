"""Tests that need a CUDA GPU (``make test-gpu``); every one is marked ``gpu`` and is
skipped, with the reason, where there is none (tests/conftest.py).

cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when its first handle is made: set it at import
(collection) time, before any test touches CUDA, so the exact-resume tests can turn on
deterministic algorithms.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
