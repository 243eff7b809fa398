"""Activation offload (``--cpu-offloading``): selected layers' saved activations live in
host memory between their forward and their backward.

Around the forward of each of the first ``--cpu-offloading-num-layers`` layers of a model
chunk, :func:`torch.autograd.graph.saved_tensors_hooks` intercepts every tensor autograd
saves for backward:

* **pack** (forward): the tensor's whole storage is copied into a host buffer (pinned, with
  ``non_blocking`` copies on a side stream under CUDA; a plain copy on a CPU-only run, where
  host and device are the same memory, so the code path is the same and tested); views of
  one storage (``q``, ``k``, ``v`` of the fused QKV output) share one copy, and the view is
  rebuilt with its own dtype, shape, strides and offset, so backward computes on tensors
  laid out exactly as in the plain run (bitwise the same gradients). Not copied, kept as
  they are: parameters (any tensor on a parameter's storage: the weights a linear saves),
  tensors under ``MIN_OFFLOAD_BYTES``, tensors on another device, and tensor subclasses.
* **unpack** (backward): the storage comes back to the device. The first unpack of layer
  ``k`` starts bringing back layer ``k - 1`` of the same forward (the next one backward
  reaches), one layer ahead; a storage's device copy is dropped once every view saved from
  it has been unpacked.

Each forward (one micro-batch through one model chunk) opens its own
:class:`ChunkForward`, so pipeline schedules with several micro-batches in flight keep
one set of host copies per (micro-batch, chunk); they are freed with that micro-batch's
autograd graph. Layers run under full recomputation keep nothing for backward (their
checkpoint keeps the unit's input, not through saved-tensor hooks), so the block does not
offload them; under selective recomputation the attention core saves nothing and the rest
of the layer is offloaded.

:class:`SavedActivationLedger` counts the bytes of the distinct storages saved for backward
during a forward, by where they stay (``kept`` on the device, ``offloaded`` to the host):
the measurement of ``tools/benchmark.py activation-offload``.
"""

from __future__ import annotations

import contextlib

import torch

from megalite.parallel.device import host_memory_pinned

MIN_OFFLOAD_BYTES = 1024   # smaller saved tensors (norm statistics, masks of tiny models) stay


def _bytes_view(storage: torch.UntypedStorage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class SavedActivationLedger:
    """Distinct storages (data pointer -> bytes) saved for backward, parameters excluded:
    ``kept`` (left on the device) and ``offloaded`` (copied to the host). Wrap a forward in
    :meth:`hooks` to count the layers that do not offload; an :class:`ActivationOffload`
    whose ``ledger`` is this object counts its own."""

    def __init__(self, params=()):
        self.kept: dict[int, int] = {}
        self.offloaded: dict[int, int] = {}
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}

    def record(self, tensor: torch.Tensor, copy=None) -> None:
        """``tensor`` saved for backward; ``copy``: its host copy when offloaded (keyed by
        the copy: the device address may be reused once the storage is freed)."""
        st = tensor.untyped_storage()
        if st.data_ptr() not in self.param_ptrs and st.nbytes():
            if copy is None:
                self.kept[st.data_ptr()] = st.nbytes()
            else:
                self.offloaded[id(copy)] = st.nbytes()

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.offloaded.values())

    def hooks(self):
        """Saved-tensor hooks that count every saved tensor as kept and change nothing."""
        def pack(t):
            self.record(t)
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class _HostStorage:
    """One device storage's bytes in host memory, and its device copy while needed."""

    __slots__ = ("host", "nbytes", "source", "device_copy", "event", "pending", "group")

    def __init__(self, group, storage: torch.UntypedStorage):
        self.group, self.nbytes = group, storage.nbytes()
        offload = group.owner
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=offload.pinned)
        src = _bytes_view(storage, offload.device)
        stream = offload.stream
        if stream is None:
            self.host.copy_(src)
        else:   # after the kernels that produced it; the allocator waits for the copy
            stream.wait_stream(torch.cuda.current_stream(offload.device))
            with torch.cuda.stream(stream):
                self.host.copy_(src, non_blocking=True)
            src.record_stream(stream)
        self.source = storage     # held while its layer runs: no address reuse within it
        self.device_copy = None
        self.event = None
        self.pending = 0          # views packed from it and not yet unpacked

    def fetch(self) -> None:
        """Start bringing the bytes back to the device (on the side stream under CUDA)."""
        if self.device_copy is not None:
            return
        offload = self.group.owner
        stream = offload.stream
        if stream is None:
            dev = torch.empty(self.nbytes, dtype=torch.uint8, device=offload.device)
            dev.copy_(self.host)
        else:   # allocated on the side stream: no block the compute stream still uses
            with torch.cuda.stream(stream):
                dev = torch.empty(self.nbytes, dtype=torch.uint8, device=offload.device)
                dev.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        self.device_copy = dev

    def take(self) -> torch.Tensor:
        """The device bytes for one unpack (fetched now if no prefetch did)."""
        self.fetch()
        dev = self.device_copy
        if self.event is not None:
            current = torch.cuda.current_stream(dev.device)
            current.wait_event(self.event)
            dev.record_stream(current)
        self.pending -= 1
        if self.pending <= 0:     # every view unpacked: the graph's tensors hold it now
            self.device_copy, self.event = None, None
        return dev


class _Saved:
    """What the graph keeps for one offloaded saved tensor: its storage's host copy and
    the view (dtype, shape, strides, offset) to rebuild."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset")

    def __init__(self, entry: _HostStorage, t: torch.Tensor):
        self.entry, self.dtype = entry, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        entry.pending += 1


class _LayerGroup:
    """The storages one layer saved in one forward; ``previous``: the layer before it in
    the same forward (reached next in backward)."""

    def __init__(self, owner, previous, params):
        self.owner, self.previous = owner, previous
        self.storages: dict[int, _HostStorage] = {}
        self.param_ptrs = None
        self.params = params
        self.prefetched = False

    def pack(self, t: torch.Tensor):
        owner = self.owner
        if self.param_ptrs is None:   # after the layer's pre-forward hooks have run
            self.param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        st = t.untyped_storage() if type(t) in (torch.Tensor, torch.nn.Parameter) else None
        if (st is None or t.layout != torch.strided or t.device != owner.device
                or st.data_ptr() in self.param_ptrs or st.nbytes() < owner.min_bytes
                or t.is_conj() or t.is_neg()):
            if owner.ledger is not None and st is not None and st.data_ptr() not in \
                    self.param_ptrs:
                owner.ledger.record(t)
            return t
        entry = self.storages.get(st.data_ptr())
        if entry is None:
            entry = self.storages[st.data_ptr()] = _HostStorage(self, st)
            owner.offloaded_bytes += entry.nbytes
            if owner.ledger is not None:
                owner.ledger.record(t, entry)
        return _Saved(entry, t)

    def close(self) -> None:
        """The layer's forward is over: drop the references to its device storages."""
        for entry in self.storages.values():
            entry.source = None
        self.params = None

    def prefetch(self) -> None:
        if not self.prefetched:
            self.prefetched = True
            for entry in self.storages.values():
                entry.fetch()


def _unpack(saved):
    if not isinstance(saved, _Saved):
        return saved
    entry = saved.entry
    group = entry.group
    if group.previous is not None:   # backward reaches the layer before this one next
        group.previous.prefetch()
        group.previous = None
    dev = entry.take()
    return torch.empty(0, dtype=saved.dtype, device=dev.device).set_(
        dev.untyped_storage(), saved.offset, saved.size, saved.stride)


class ChunkForward:
    """One forward of one model chunk (one micro-batch): the layers it offloads, linked
    in forward order for the one-layer-ahead prefetch in backward."""

    def __init__(self, owner):
        self.owner = owner
        self.last = None

    def layer(self, index: int, module: torch.nn.Module):
        """Context for the forward of the chunk's ``index``-th layer (0-based in the chunk):
        saved-tensor hooks for the first ``num_layers``, nothing for the others."""
        if index >= self.owner.num_layers:
            return contextlib.nullcontext()
        return self._offloaded(module)

    @contextlib.contextmanager
    def _offloaded(self, module):
        group = _LayerGroup(self.owner, self.last, list(module.parameters()))
        self.last = group
        try:
            with torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack):
                yield
        finally:
            group.close()


class ActivationOffload:
    """Offloads the saved activations of the first ``num_layers`` layers of every forward
    of a chunk to host memory (see the module docstring); ``device``: where the layers
    compute (``ps.device``). ``offloaded_bytes``: bytes copied to the host so far;
    ``ledger``: an optional :class:`SavedActivationLedger` to count into."""

    def __init__(self, num_layers: int, device, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.pinned = host_memory_pinned(self.device, "--cpu-offloading")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.min_bytes = min_bytes
        self.offloaded_bytes = 0
        self.ledger: SavedActivationLedger | None = None

    def forward(self) -> ChunkForward:
        """A new forward of the chunk (call once per micro-batch)."""
        return ChunkForward(self)


def build_activation_offload(cfg, ps) -> ActivationOffload | None:
    """The chunk's offloader under ``--cpu-offloading`` (activations, at least one layer;
    on ``ps.device``), else None."""
    if not (cfg.cpu_offloading and cfg.cpu_offloading_activations
            and cfg.cpu_offloading_num_layers > 0):
        return None
    return ActivationOffload(cfg.cpu_offloading_num_layers, ps.device)
