"""Plain single-process references for the MoE tests (and the benchmark).

Nothing here is used by megalite itself: the per-expert loop is what the grouped GEMM
replaces, and :func:`naive_moe` is the MoE layer written token by token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.layers.activations import activation


def expert_loop(x, tokens_per_expert, fc1, fc2, *, swiglu, fc1_bias=None, fc2_bias=None):
    """The grouped MLP as a Python loop over experts: ``x`` ``[M, h]`` sorted by expert."""
    outs = []
    # split / unbind (not slicing) so backward does not build a full-size zero tensor
    # per expert: a fair baseline, as if each expert had its own weights
    w1, w2 = fc1.unbind(0), fc2.unbind(0)
    b1 = fc1_bias.unbind(0) if fc1_bias is not None else [0] * len(w1)
    b2 = fc2_bias.unbind(0) if fc2_bias is not None else [0] * len(w1)
    for e, seg in enumerate(x.split(tokens_per_expert.tolist())):
        outs.append(activation(seg @ w1[e] + b1[e], swiglu) @ w2[e] + b2[e])
    return torch.cat(outs)


def naive_moe(x, router_weight, fc1, fc2, *, k, swiglu, fc1_bias=None, fc2_bias=None,
              keep=None):
    """``x`` ``[T, h]`` -> ``[T, h]``: Mixtral routing (softmax over all experts, top-k,
    renormalize), each token through its experts one at a time. ``keep`` ``[T, E]`` bool
    optionally drops (token, expert) pairs after routing (capacity)."""
    probs = torch.softmax(F.linear(x.float(), router_weight.float()), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for p, e in zip(top[t], idx[t].tolist()):
            if keep is not None and not keep[t, e]:
                continue
            hid = x[t] @ fc1[e] + (fc1_bias[e] if fc1_bias is not None else 0)
            y = activation(hid, swiglu) @ fc2[e] + (fc2_bias[e] if fc2_bias is not None else 0)
            acc = acc + p * y
        rows.append(acc)
    return torch.stack(rows)
