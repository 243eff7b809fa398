"""Activation offload (``--cpu-offloading``): bitwise the plain run, bytes as counted.

On this CPU-only host the offloaded storages are copied to (unpinned) host buffers and
back, the code path of a GPU run without the side stream. Checked:

* one process, GPT-2 and Llama, fp32 and bf16, selective and full recomputation: the loss
  and every gradient bitwise equal to the run without offload; the bytes copied to the
  host equal the offloaded layers x the bytes one layer saves (storages of at least
  ``MIN_OFFLOAD_BYTES``, parameters excluded), and the plain run's saved bytes are the
  offloaded run's kept plus offloaded bytes;
* backward brings each layer back one layer ahead and drops every device copy;
* the ``activation-offload`` rows of ``tests/layouts.py`` (dp, tp 2 + sp, pp 2 x vpp 2
  and 1F1B, recomputation, bf16): three training iterations with offload give the same
  losses and parameters, bitwise, as the same layout without it;
* the flags' errors (Megatron's ``num layers < num_layers``, weights refused).
"""

from __future__ import annotations

import re

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.models.gpt import GPTModel
from megalite.transformer import activation_offload as ao
from tests.layouts import layouts, run_by_world
from tests.model.common import batch, gpt2_config, llama_config, single_process_state

OFF = {"cpu_offloading": True}


def _layer_bytes(cfg) -> int:
    """Bytes of the storages layer 0 saves for backward in a plain forward that offload
    would copy (at least ``MIN_OFFLOAD_BYTES``, parameters excluded)."""
    model = GPTModel(cfg, single_process_state(), seed=1)
    if cfg.bf16:
        model = model.to(torch.bfloat16)
    ledger = ao.SavedActivationLedger(model.parameters())
    layer, hooks = model.decoder.layers["0"], ledger.hooks()
    layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
    layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    ids, labels = batch(cfg)
    model(ids, labels=labels)
    return sum(b for b in ledger.kept.values() if b >= ao.MIN_OFFLOAD_BYTES)


def _run(cfg, seed=1):
    model = GPTModel(cfg, single_process_state(), seed=seed)
    if cfg.bf16:
        model = model.to(torch.bfloat16)
    ledger = ao.SavedActivationLedger(model.parameters())
    if model.decoder.offload is not None:
        model.decoder.offload.ledger = ledger
    ids, labels = batch(cfg)
    with ledger.hooks():
        loss = model(ids, labels=labels).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return model, loss.detach(), grads, ledger


CASES = {
    "gpt2": (gpt2_config, {}),
    "llama": (llama_config, {}),
    "gpt2-bf16": (gpt2_config, {"bf16": True}),
    "llama-selective": (llama_config, {"recompute_granularity": "selective"}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("offloaded", [1, 2])
def test_bitwise_and_bytes(case, offloaded):
    make, extra = CASES[case]
    _, plain_loss, plain_grads, plain = _run(make(num_layers=3, **extra))
    model, loss, grads, ledger = _run(make(num_layers=3, cpu_offloading=True,
                                           cpu_offloading_num_layers=offloaded, **extra))
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], plain_grads[name]), name
    per_layer = _layer_bytes(make(num_layers=3, **extra))
    assert per_layer > 0
    assert ledger.offloaded_bytes == offloaded * per_layer
    assert model.decoder.offload.offloaded_bytes == offloaded * per_layer
    assert ledger.kept_bytes + ledger.offloaded_bytes == plain.kept_bytes


def test_gpt2_layer_bytes_match_the_planner_formula():
    """The compute-dtype elements the planner counts per layer (fp32 statistics are below
    the copy threshold and stay) x 4 bytes = what one offloaded layer copies."""
    from megalite.config import ParallelConfig
    from megalite.planner.memory import layer_activation_elements

    cfg = gpt2_config(num_layers=3, **OFF, cpu_offloading_num_layers=1)
    _, _, _, ledger = _run(cfg)
    want = layer_activation_elements(cfg, ParallelConfig(), micro_batch=2)["act"] * 4
    assert ledger.offloaded_bytes == want


def test_full_recompute_has_nothing_to_offload():
    """uniform recomputes every layer (its checkpoint keeps the unit input only); block
    recomputes the first layer and offloads the next one that runs plainly."""
    full = {"recompute_granularity": "full", "recompute_num_layers": 1}
    _, loss0, grads0, _ = _run(gpt2_config(num_layers=3, **full))
    for method, want_layers in (("uniform", 0), ("block", 1)):
        model, loss, grads, ledger = _run(gpt2_config(
            num_layers=3, recompute_method=method, **full, **OFF, cpu_offloading_num_layers=1))
        assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads)
        assert (ledger.offloaded_bytes > 0) == bool(want_layers), method


def test_backward_prefetches_one_layer_ahead_and_drops_device_copies(monkeypatch):
    events = []
    fetch, take = ao._HostStorage.fetch, ao._HostStorage.take

    def logged_fetch(self):
        if self.device_copy is None:
            events.append(("fetch", self.group))
        fetch(self)

    def logged_take(self):
        events.append(("take", self.group))
        return take(self)

    monkeypatch.setattr(ao._HostStorage, "fetch", logged_fetch)
    monkeypatch.setattr(ao._HostStorage, "take", logged_take)
    model, _, _, _ = _run(gpt2_config(num_layers=4, **OFF, cpu_offloading_num_layers=3))
    order = []   # groups in the order backward first takes from them
    for kind, group in events:
        if kind == "take" and group not in order:
            order.append(group)
    assert len(order) == 3
    fetched = {g: next(i for i, e in enumerate(events) if e == ("fetch", g)) for g in order}
    taken = {g: next(i for i, e in enumerate(events) if e == ("take", g)) for g in order}
    for n, (later, earlier) in enumerate(zip(order, order[1:])):
        # backward's first unpack of a layer starts fetching the layer before it (one ahead,
        # not two), which backward uses after it
        assert fetched[earlier] < taken[later] < taken[earlier]
        assert n == 0 or fetched[earlier] > taken[order[n - 1]]
    assert all(e.device_copy is None for g in order for e in g.storages.values())


def test_eval_and_no_grad_offload_nothing():
    cfg = gpt2_config(num_layers=3, **OFF, cpu_offloading_num_layers=2)
    model = GPTModel(cfg, single_process_state(), seed=1)
    ids, labels = batch(cfg)
    with torch.no_grad():
        model(ids, labels=labels)
    model.eval()
    model(ids, labels=labels).sum().backward()
    assert model.decoder.offload.offloaded_bytes == 0


def test_flags_and_errors():
    cfg = parse_args(["--cpu-offloading", "--cpu-offloading-num-layers", "1",
                      "--num-layers", "2"])
    m = cfg.model
    assert m.cpu_offloading and m.cpu_offloading_num_layers == 1
    assert m.cpu_offloading_activations and not m.cpu_offloading_weights
    bad = {
        "must be >= 0 and < num_layers (2)": {**OFF, "cpu_offloading_num_layers": 2},
        "needs --cpu-offloading": {"cpu_offloading_num_layers": 1},
        "--cpu-offloading-weights is not supported": {**OFF, "cpu_offloading_weights": True},
        "offloads nothing": {**OFF, "cpu_offloading_activations": False},
    }
    for message, kw in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            gpt2_config(**kw)
    with pytest.raises(ConfigError, match="offloads nothing"):
        parse_args(["--cpu-offloading", "--no-cpu-offloading-activations"])
    with pytest.raises(ConfigError, match="pinned host memory, which device meta"):
        ao.ActivationOffload(1, "meta")


# -- the layout rows: offload against the same layout without it ------------------------
ROWS = layouts("activation-offload")
PLAIN_DROPS = ("cpu_offloading", "cpu_offloading_num_layers")


def _body(rank, world_size, rows):
    from tests.optim.common import config, train_run

    out = []
    for layout in rows:
        runs = []
        for model in ({k: v for k, v in layout.model.items() if k not in PLAIN_DROPS},
                      layout.model):
            cfg = config(world_size, model=model, optim=layout.optim, **layout.parallel)
            result, params, _, offloaded = train_run(
                cfg, inspect=lambda c: sum(getattr(ch.decoder.offload, "offloaded_bytes", 0)
                                           for ch in _chunks(c.model)))
            runs.append((dict(result.losses), params, offloaded))
        out.append(runs)
    return out


def _chunks(model):
    from megalite.pipeline.layout import model_chunks

    return [getattr(c, "module", c) for c in model_chunks(model)]


@pytest.fixture(scope="module")
def trained():
    return run_by_world(ROWS, _body)


@pytest.mark.parametrize("layout", [pytest.param(r, marks=pytest.mark.slow)
                                    if "slow" in r.tags else r for r in ROWS], ids=str)
def test_layout_matches_plain_run(layout, trained):
    for rank, ((losses0, params0, off0), (losses, params, off)) in enumerate(
            trained(layout)):
        assert off0 == 0 and off > 0, (layout.name, rank, off)
        assert losses == losses0, (layout.name, rank)
        assert params.keys() == params0.keys()
        for name in params:
            assert torch.equal(params[name], params0[name]), (layout.name, rank, name)


@pytest.mark.slow
def test_compiled_layers_offload_bitwise():
    """``--compile``: the compiled layers' saved tensors go through the same hooks."""
    from megalite.models.compile import compile_model

    runs = []
    for extra in ({}, {**OFF, "cpu_offloading_num_layers": 1}):
        cfg = gpt2_config(**extra)
        model = compile_model(GPTModel(cfg, single_process_state(), seed=1))
        ids, labels = batch(cfg)
        loss = model(ids, labels=labels).sum()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                     getattr(model.decoder.offload, "offloaded_bytes", 0)))
    (loss0, grads0, _), (loss, grads, off) = runs
    assert off > 0 and torch.equal(loss, loss0)
    assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
