"""The layouts whose measured peak memory checks the planner's memory model.

Rows in the shape of ``tests/layouts.py`` (:func:`tests.layouts.row`), on a tiny GPT where
activations, not parameters, are most of the peak, so the check exercises the activation
and pipeline terms and not only the parameter accounting.
"""

from __future__ import annotations

from tests.layouts import Layout, row, tiny

# hidden 64, 4 layers, seq 128, micro-batch 2, vocab 256: about 0.2 M parameters
BASE_MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128,
              "vocab_size": 256, "make_vocab_size_divisible_by": 8}
BASE_TRAIN = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 2}
MOE = {"num_experts": 4, "moe_router_topk": 2, "ffn_hidden_size": 128}
SEL = {"recompute_granularity": "selective"}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform",
        "recompute_num_layers": 1}
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
LLAMA = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}

MEMORY_CASES: tuple[Layout, ...] = (
    row("mem", 1),
    row("mem", 1, "full", model=FULL),
    row("mem", 1, "llama", model=LLAMA),
    # in bf16 the CPU's composite RMSNorm keeps fp32 copies of its input and output too
    row("mem", 1, "llama-bf16", model={**LLAMA, "bf16": True}),
    # two multi-token prediction depths: their layers, logits and the embedding looked up
    # again
    row("mem", 1, "llama-mtp", model={**LLAMA, "mtp_num_layers": 2}),
    row("mem", 2, tp=2),
    row("mem", 2, "sel", model=SEL, tp=2),
    # sequence parallelism: the linears keep this rank's [s/tp, b, h] inputs and gather them
    # again in backward; RMSNorm's composite keeps its output split over tp too
    row("mem", 2, "llama", model=LLAMA, tp=2, sp=True),
    row("mem", 2, "llama-bf16", model={**LLAMA, "bf16": True}, tp=2, sp=True),
    row("mem", 2, distopt=True),
    row("mem", 2, "og", strategy="optim_grads"),
    # ZeRO-2 with buckets of about a layer: backward holds one bucket's gradient in full
    # (two with the reduce-scatter overlapped), not the whole model's
    row("mem", 2, "og-buckets", strategy="optim_grads", bucket=20000),
    row("mem", 2, "og-buckets", strategy="optim_grads", bucket=20000, overlap_grad=True),
    row("mem", 2, "offload", strategy="optim", optim=OFFLOAD),
    row("mem", 2, "zero3", strategy="optim_grads_params"),
    row("mem", 2, pp=2),
    # Llama's RMSNorm keeps its normalised output on a CPU (torch's composite rms_norm)
    row("mem", 2, "llama", model=LLAMA, pp=2),
    row("mem", 2, pp=2, vpp=2),
    # ZB-V with two prediction depths on rank 0's chunk 1, beside their copy of the word
    # embedding (their activations for the micro-batches that chunk holds in flight)
    row("mem", 2, "mtp", model={"position_embedding_type": "rope", "mtp_num_layers": 2},
        pp=2, schedule="zbv"),
    row("mem", 2, "moe", model=MOE, ep=2),
    row("mem", 2, cp=2),
    row("mem", 4, pp=4),
    row("mem", 4, "full", model=FULL, tp=2, pp=2, distopt=True),
    row("mem", 4, "moe", model=MOE, tp=2, sp=True, ep=2, distopt=True),
    row("mem", 4, "sel", model=SEL, distopt=True),
    # fp8 linears keep their inputs quantised (per-tensor; the attention kernel's output
    # stays beside the projection's copy) and two fp8 copies of their weights per step, or
    # (mxfp8) the inputs themselves
    row("mem", 1, "fp8", model={"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}),
    row("mem", 1, "fp8-mxfp8", model={"fp8_format": "e4m3", "fp8_recipe": "mxfp8"}),
    # the routed experts' fp8 weights, two layouts each, kept through the step
    row("mem", 1, "fp8-moe",
        model={"fp8_format": "hybrid", "fp8_recipe": "tensorwise", **MOE}),
)


def case_config(lay: Layout):
    """The row's validated config on the tiny model."""
    return tiny(lay, model=dict(BASE_MODEL), train=dict(BASE_TRAIN))


def planner_config(lay: Layout):
    """The config the planner estimates: the row's, with the vocabulary the tokenizer
    really has (NullTokenizer adds an end-of-document token), as the build does."""
    from megalite.data.tokenizers import build_tokenizer

    cfg = case_config(lay)
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    return cfg


def measure_body(rank: int, world_size: int, rows: list[Layout]) -> list[dict]:
    """Pooled-rank body: this rank's measured peak for each row of this world size."""
    import torch

    from megalite.planner.measure import measure_training_peak

    torch.set_num_threads(1)
    return [measure_training_peak(case_config(lay)) for lay in rows]
