"""The measured peak of :mod:`megalite.planner.measure`: blocks freed on a thread the
profiler does not record (gloo's workers) are taken off the running sum where their
address is allocated again."""

from __future__ import annotations

import threading

import torch

from megalite.planner.measure import live_bytes, peak_allocated


def test_live_bytes_takes_a_block_freed_unseen_off_where_its_address_returns():
    # A (100 B) freed unseen, B (50 B) allocated, a new 80 B block at A's address; then B
    # freed as the profiler sees it, and a free of a block allocated before the start
    events = [(0, 100, 0xA), (1, 50, 0xB), (2, 80, 0xA), (3, -50, 0xB), (4, -30, 0xC)]
    assert live_bytes(events) == [100, 150, 130, 80, 50]


def test_live_bytes_orders_a_free_before_an_allocation_of_the_same_instant():
    events = [(0, 64, 0xA), (1, 64, 0xA), (1, -64, 0xA)]
    assert live_bytes(events) == [64, 0, 64]


def test_a_tensor_freed_on_another_thread_is_not_counted_twice():
    """The last reference to a 64 KiB tensor dies on a worker thread (as gloo's do), then
    the training thread allocates 32 KiB, which glibc's malloc places in the freed block:
    the peak is 64 KiB, not 96."""
    size = 1 << 14   # fp32 elements
    held, go, done = [], threading.Event(), threading.Event()

    def worker():
        go.wait()
        held.clear()
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()

    def step():
        held.append(torch.ones(size))
        go.set()
        done.wait()
        return float(torch.ones(size // 2).sum())

    total, peak = peak_allocated(step)
    thread.join()
    assert total == size // 2
    assert peak == 4 * size
