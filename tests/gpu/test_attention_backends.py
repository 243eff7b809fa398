"""Every attention backend on CUDA against the local one (explicit scores, fp32 softmax):
the whole model's logits and gradients, fp32 and bf16, GPT-2 (MHA) and Llama (GQA, RoPE).
A backend that cannot run here (flash without flash-attn, flash in fp32) is skipped with
``select_attention_backend``'s reason."""

from __future__ import annotations

import pytest
import torch

from megalite.config import ConfigError
from megalite.models.gpt import GPTModel
from megalite.transformer.attention_kernels import KERNELS, select_attention_backend
from tests.gpu.common import CUDA, state_on
from tests.model.common import batch, gpt2_config, llama_config

pytestmark = pytest.mark.gpu

FAMILIES = {"gpt2": gpt2_config, "llama": llama_config}
BACKENDS = [*KERNELS, "auto"]
# (logits, gradients) tolerances against local in the same dtype; bf16 rounds the
# attention output to 8 bits of mantissa in a different order per kernel
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _run(make_config, backend, dtype):
    cfg = make_config(attention_backend=backend, bf16=dtype == torch.bfloat16)
    model = GPTModel(cfg, state_on(CUDA), seed=7)
    ids, labels = batch(cfg, b=3)
    ids, labels = ids.to(CUDA), labels.to(CUDA)
    logits = model(ids)
    model(ids, labels=labels).float().mean().backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    return logits.detach().float().cpu(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_backend_matches_local(family, backend, dtype):
    try:
        chosen = select_attention_backend(backend, CUDA, dtype)
    except ConfigError as e:
        pytest.skip(str(e))
    ref_logits, ref_grads = _run(FAMILIES[family], "local", dtype)
    logits, grads = _run(FAMILIES[family], backend, dtype)
    torch.testing.assert_close(logits, ref_logits, **TOL[dtype])
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        scale = ref_grads[name].abs().max().clamp_min(1e-6)  # relative to the tensor's size
        torch.testing.assert_close(grads[name] / scale, ref_grads[name] / scale,
                                   **TOL[dtype], msg=lambda m, n=name: f"{n} ({chosen}): {m}")
