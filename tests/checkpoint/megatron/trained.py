"""The ``*_trained`` Megatron-Core fixtures: runs that Megatron-Core's DDP, optimizer,
Megatron-LM's lr scheduler and ``finalize_model_grads`` train for :data:`TRAIN_STEPS`
steps on Megatron-Core's own GPT dataset over :func:`small_vocab_corpus`, saved with the
optimizer state, and the next step recorded in ``next_step.pt``, which an import must
reproduce when it resumes (``tests/checkpoint/test_megatron_resume.py``). Written by
``make_fixtures.py NAME`` (its driver and model helpers), run in the Megatron-Core venv.
"""

from __future__ import annotations

import json
import os
import sys

try:   # as part of the tests package, or beside make_fixtures.py run as a script
    from tests.checkpoint.megatron import make_fixtures as fx
except ImportError:
    import make_fixtures as fx  # type: ignore[no-redef]

# Trained fixtures, name -> (model and optimizer flags, data-parallel size): Megatron-Core's
# DDP, optimizer and scheduler (Megatron-LM's get_optimizer_param_scheduler) train
# TRAIN_STEPS steps on Megatron-Core's GPT dataset over small_vocab_corpus() and save with
# the optimizer state; one more
# step's batch, loss, learning rate and the weights after it go to next_step.pt, which an
# import must reproduce when it resumes
TRAIN_STEPS = 2
TRAIN = ["--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
         "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--adam-beta1", "0.9",
         "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--clip-grad", "1.0",
         "--micro-batch-size", "2"]
# (a vocabulary of 112 = 111 + end of document: no padding rows, whose logits Megatron's
# softmax would include and megalite's, which drops them, would not)
TRAIN = [*TRAIN, "--num-layers", "2", "--vocab-size", "111", "--split", "100,0,0"]
CORPUS_VOCAB = 111


def small_vocab_corpus(prefix: str) -> str:
    """The bundled corpus's documents with every id taken modulo :data:`CORPUS_VOCAB`,
    written at ``prefix`` (``.bin`` / ``.idx``): data the trained fixtures' small
    vocabulary can embed, which Megatron-Core's datasets and megalite's both read."""
    import numpy as np

    repo = os.path.dirname(os.path.dirname(os.path.dirname(fx.HERE)))
    sys.path.insert(0, repo)
    from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

    src = IndexedDataset(os.path.join(repo, "data", "kjv_text_document"))
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for i in range(len(src)):
            w.add_document(np.asarray(src.get(i)) % CORPUS_VOCAB)
    return prefix
LION = ["--optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99"]
TRAINED = {
    "llama_adam_trained": ([*fx.LLAMA, *TRAIN], 1),
    # the distributed optimizer's per-parameter format (Megatron-LM's default, dp_reshardable,
    # keeps flat buffers that only Megatron's own bucket layout can read)
    "llama_distopt_dp2_trained": ([*fx.LLAMA, *TRAIN, "--use-distributed-optimizer",
                                   "--dist-ckpt-optim-fully-reshardable"], 2),
    # Megatron-LM's default format of the distributed optimizer (dp_reshardable: the flat
    # per-bucket buffers), in several buckets whose parameters are padded to 64 elements
    "llama_distopt_buckets_trained": ([*fx.LLAMA, *TRAIN, "--use-distributed-optimizer",
                                       "--overlap-grad-reduce", "--ddp-bucket-size", "4000"],
                                      2),
    # the same at tp 2 x dp 2: each rank's buckets hold its tensor-parallel pieces, fc1's
    # gate and up halves apart; the weights after the next step are a checkpoint beside
    # (112 rows divide by 8 x tp: no padding rows)
    "llama_distopt_tp2_buckets_trained": ([*fx.LLAMA, *TRAIN, "--use-distributed-optimizer",
                                           "--overlap-grad-reduce", "--ddp-bucket-size",
                                           "3000", "--tensor-model-parallel-size", "2",
                                           "--make-vocab-size-divisible-by", "8"], 2),
    # experts at ep 2: Megatron chains a dense and an expert distributed optimizer, whose
    # buckets are saved under chained_<i>. prefixes
    "mixtral_distopt_ep2_buckets_trained": ([*fx.MIXTRAL, *TRAIN, "--num-layers", "1",
                                             "--use-distributed-optimizer",
                                             "--expert-model-parallel-size", "2"], 2),
    # the same at pp 2 x dp 2: each stage's buckets hold its layers (and the embedding or
    # the output layer)
    "llama_distopt_pp2_buckets_trained": ([*fx.LLAMA, *TRAIN, "--use-distributed-optimizer",
                                           "--overlap-grad-reduce", "--ddp-bucket-size",
                                           "3000", "--pipeline-model-parallel-size", "2"], 2),
    # and with virtual pipelining (4 layers, 2 stages x 2 chunks of one layer, the
    # interleaved schedule over 2 micro-batches per rank and step): each stage's two model
    # chunks have their gradient buffers, the first in several buckets
    "llama_distopt_vpp2_buckets_trained": ([*fx.LLAMA, *TRAIN, "--use-distributed-optimizer",
                                            "--overlap-grad-reduce", "--ddp-bucket-size",
                                            "1500", "--pipeline-model-parallel-size", "2",
                                            "--num-layers", "4",
                                            "--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "llama_sgd_trained": ([*fx.LLAMA, *TRAIN, "--optimizer", "sgd", "--sgd-momentum", "0.9"], 1),
    # the legacy per-rank format (--ckpt-format torch): each rank's torch optimizer state,
    # its tensors keyed by parameter index; bf16 with its fp32 main copies, at tp 2 x pp 2
    "llama_legacy_adam_trained": ([*fx.LLAMA, *TRAIN, "--ckpt-format", "torch"], 1),
    "llama_legacy_distopt_dp2_trained": ([*fx.LLAMA, *TRAIN, "--ckpt-format", "torch",
                                          "--use-distributed-optimizer",
                                          "--overlap-grad-reduce", "--ddp-bucket-size",
                                          "4000"], 2),
    "llama_legacy_distopt_bf16_tp2_trained": ([*fx.LLAMA, *TRAIN, "--ckpt-format", "torch",
                                               "--bf16", "--use-distributed-optimizer",
                                               "--overlap-grad-reduce", "--ddp-bucket-size",
                                               "3000", "--tensor-model-parallel-size", "2",
                                               "--make-vocab-size-divisible-by", "8"], 2),
    "mixtral_legacy_ep2_trained": ([*fx.MIXTRAL, *TRAIN, "--num-layers", "1", "--ckpt-format",
                                    "torch", "--expert-model-parallel-size", "2"], 2),
    # and with the distributed optimizer: each rank's distrib_optim.pt holds the dense and
    # the expert optimizer's flat buffers (the experts' over their expert data-parallel
    # group, here the rank alone)
    "mixtral_legacy_distopt_ep2_trained": ([*fx.MIXTRAL, *TRAIN, "--num-layers", "1",
                                            "--ckpt-format", "torch",
                                            "--use-distributed-optimizer",
                                            "--expert-model-parallel-size", "2"], 2),
    "llama_legacy_bf16_tp2_pp2_trained": ([*fx.LLAMA, *TRAIN, "--ckpt-format", "torch",
                                           "--bf16", "--tensor-model-parallel-size", "2",
                                           "--pipeline-model-parallel-size", "2",
                                           "--make-vocab-size-divisible-by", "8"], 1),
    # Lion (NVIDIA Emerging-Optimizers' Lion, which Megatron-Core 0.19.2 builds for
    # --optimizer lion with --adam-beta1/2 as its betas): Lion's exp_avg for the linear
    # weights, a chained Adam for the rest. Its emerging-optimizer path keeps both plain
    # with --use-distributed-optimizer too (per-parameter state, chained_<i>. prefixes)
    "llama_lion_trained": ([*fx.LLAMA, *TRAIN, *LION], 1),
    "llama_lion_distopt_dp2_trained": ([*fx.LLAMA, *TRAIN, *LION,
                                        "--use-distributed-optimizer"], 2),
    "llama_lion_bf16_trained": ([*fx.LLAMA, *TRAIN, *LION, "--bf16"], 1),
    # fp16 with a dynamic loss scale: the mixed precision optimizer's grad_scaler (scale,
    # growth and hysteresis trackers) beside its state; 1024 does not overflow here, and a
    # window of 3 leaves the growth tracker at 2 after the two steps
    "llama_fp16_trained": ([*fx.LLAMA, *TRAIN, "--fp16", "--initial-loss-scale", "1024",
                            "--loss-scale-window", "3"], 1),
    # experts: Megatron chains a dense and an expert optimizer
    "mixtral_trained": ([*fx.MIXTRAL, *TRAIN, "--num-layers", "1"], 1),
    # and with Lion, each of those a Lion over its linear weights and an Adam over the rest
    "mixtral_lion_trained": ([*fx.MIXTRAL, *TRAIN, *LION, "--num-layers", "1"], 1),
    "mixtral_lion_ep2_trained": ([*fx.MIXTRAL, *TRAIN, *LION, "--num-layers", "1",
                                  "--expert-model-parallel-size", "2"], 2),
    # --dist-ckpt-optim-fully-reshardable at tp 2 x dp 2 in several buckets: Megatron-Core
    # 0.19.2 writes its optimizer state misplaced (the main parameters are not the weights,
    # and Megatron's own resume from it takes another step than next_step.pt's), which the
    # import detects and refuses
    "llama_distopt_tp2_fully_trained": ([*fx.LLAMA, *TRAIN, "--use-distributed-optimizer",
                                         "--dist-ckpt-optim-fully-reshardable",
                                         "--overlap-grad-reduce", "--ddp-bucket-size", "3000",
                                         "--tensor-model-parallel-size", "2",
                                         "--make-vocab-size-divisible-by", "8"], 2),
    # DeepSeek-V3's step: multi-latent attention, a dense layer then routed and shared
    # experts with group-limited sigmoid routing whose expert bias moves every step, and a
    # prediction depth whose loss joins the objective
    "deepseek_v3_mtp_trained": ([*fx.DEEPSEEK_V3, *TRAIN, "--moe-layer-freq", "[0]+[1]",
                                 "--num-experts", "4", "--mtp-num-layers", "1",
                                 "--mtp-loss-scaling-factor", "0.3",
                                 "--moe-router-bias-update-rate", "0.01"], 1),
    # bf16 weights with fp32 main copies: the plain optimizer's (optimizer.state.fp32_param)
    "llama_bf16_trained": ([*fx.LLAMA, *TRAIN, "--bf16"], 1),
    # and the distributed optimizer's (optimizer.state.param)
    "llama_distopt_bf16_trained": ([*fx.LLAMA, *TRAIN, "--bf16", "--use-distributed-optimizer",
                                    "--dist-ckpt-optim-fully-reshardable"], 1),
}


def _training_shims():
    """What Megatron-Core's DDP and optimizers ask of CUDA, on CPU: devices named ``cuda``
    become the CPU, tensor types report themselves as CUDA ones (the optimizers check),
    streams do nothing, and gloo's missing reduce-scatter is an all-reduce and a slice."""
    import contextlib
    import functools

    import torch
    import torch.distributed as dist

    def on_cpu(f):
        @functools.wraps(f)
        def g(*a, **k):
            if "cuda" in str(k.get("device", "")):
                k["device"] = "cpu"
            return f(*a, **k)
        return g

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
                 "empty_like", "ones_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    to, kind = torch.Tensor.to, torch.Tensor.type

    def to_cpu(self, *a, **k):
        a = tuple("cpu" if isinstance(x, (str, torch.device)) and "cuda" in str(x) else x
                  for x in a)
        if "cuda" in str(k.get("device", "")):
            k["device"] = "cpu"
        return to(self, *a, **k)

    def cuda_type(self, *a, **k):
        out = kind(self, *a, **k)
        if not a and not k and isinstance(out, str) and ".cuda." not in out:
            return out.replace("torch.", "torch.cuda.", 1)
        return out

    class Stream:
        def wait_event(self, *a):
            pass

        def wait_stream(self, *a):
            pass

        def synchronize(self):
            pass

    torch.Tensor.to, torch.Tensor.type = to_cpu, cuda_type
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    class Done:
        def wait(self):
            pass

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        total = input.clone()
        dist.all_reduce(total, op=op, group=group)
        output.copy_(total.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        return Done() if async_op else None

    dist.reduce_scatter_tensor = dist._reduce_scatter_base = reduce_scatter


def train_worker(name: str, dest: str, corpus: str, resume: str | None = None) -> None:
    """Train fixture ``name`` (one rank of its data-parallel group; :data:`TRAINED`) on
    ``corpus`` (:func:`small_vocab_corpus`) through Megatron-Core's GPT dataset, global
    batch ``k`` being samples ``[k GBS, (k + 1) GBS)`` and each rank's micro-batch its
    slice, as Megatron-LM's pretraining sampler cuts it; save it with the optimizer state
    into ``dest`` and record the next step in ``dest/next_step.pt``: ``{"tokens": [dp, b,
    s], "lr", "loss" (the mean over dp), "params": {module name: the weight after the
    step}}`` (``labels`` beside ``tokens``; at tp, pp or ep > 1 ``params`` is absent and
    the weights after the step are the checkpoint ``dest/after_next_step``).

    With ``resume`` (a checkpoint of iteration :data:`TRAIN_STEPS` that megalite exported
    with its optimizer state), load it with Megatron-LM's ``load_checkpoint`` instead of
    training, take the next step and write how it compares with ``dest/next_step.pt``
    (``resume/resumed.json``: the iteration, consumed samples, lr, loss, both losses and
    the largest weight difference)."""
    fx._shims()
    _training_shims()
    import types

    import torch
    import torch.distributed as dist

    flags, dp = TRAINED[name]
    common = [f for f in fx.COMMON if f not in ("--no-save-optim", "--no-save-rng")]
    # micro-batches per rank and step: the interleaved schedule wants at least pp of them
    m = 2 if "--num-layers-per-virtual-pipeline-stage" in flags else 1
    sys.argv = [sys.argv[0], *common, *flags, "--no-save-rng", "--global-batch-size",
                str(2 * dp * m), "--data-path", corpus, "--save", dest, "--load",
                resume or dest]
    if resume is not None:   # megalite's exports are torch_dist, as the converter says
        sys.argv += ["--ckpt-format", "torch_dist"]
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import get_optimizer_param_scheduler

    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=True)
    dist.init_process_group("gloo")
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp,
                                  expert_model_parallel_size=ep)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    chunks = []
    for v in range(vpp) if vpp else [None]:   # (Megatron-LM's get_model: one bucketed chunk)
        model = fx._build(args, name, v)
        fx._perturb(model, mpu.get_tensor_model_parallel_rank())
        if args.bf16 or args.fp16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(core_transformer_config_from_args(args), model)
        chunks.append(DistributedDataParallel(
            core_transformer_config_from_args(args),
            DistributedDataParallelConfig(
                use_distributed_optimizer=args.use_distributed_optimizer,
                grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
                bucket_size=args.ddp_bucket_size), model, disable_bucketing=bool(v)))
    ddp = chunks[0]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, sgd_momentum=args.sgd_momentum, lr=args.lr,
        min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        lion_beta1=args.lion_beta1, lion_beta2=args.lion_beta2,
        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
        bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        params_dtype=args.params_dtype), chunks)
    scheduler = get_optimizer_param_scheduler(optimizer)
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    tokenizer = types.SimpleNamespace(eod=CORPUS_VOCAB, pad=CORPUS_VOCAB,
                                      vocab_size=CORPUS_VOCAB + 1, unique_identifiers={})
    gbs = args.global_batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [args.train_iters * gbs, 0, 0], lambda: True, GPTDatasetConfig(
            random_seed=args.seed, sequence_length=args.seq_length,
            blend=get_blend_from_list(args.data_path), split=args.split,
            path_to_cache=corpus + "_cache", tokenizer=tokenizer,
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            mid_level_dataset_surplus=0.005, create_attention_mask=False)).build()
    rank, s, dp_group = mpu.get_data_parallel_rank(), args.seq_length, mpu.get_data_parallel_group()
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]

    def micro_batch(i, j):
        """(tokens, labels, loss_mask, positions) of iteration ``i``'s ``j``-th micro-batch
        on this rank: Megatron's sampler gives it the ``b`` samples from ``j b dp + r b``
        on in global batch ``i``."""
        b = args.micro_batch_size
        first = (i - 1) * gbs + j * b * dp + rank * b
        rows = [train[k] for k in range(first, first + b)]
        return tuple(torch.stack([r[k] for r in rows])
                     for k in ("tokens", "labels", "loss_mask", "position_ids"))

    def step(i):
        """Iteration ``i``'s step on this rank's micro-batches: (tokens and labels ``[2, m,
        b, s]``, lr, dp-mean loss)."""
        tokens, labels, loss_mask, positions = micro_batch(i, 0)
        lr = optimizer.param_groups[0]["lr"]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        if m > 1:   # the interleaved schedule over the chunks and micro-batches
            batches = [micro_batch(i, j) for j in range(m)]
            loss = _interleaved_step(chunks, batches, mask, args)
            return (torch.stack([torch.stack([t, lab]) for t, lab, _, _ in batches], 1),
                    lr, _finish_step(chunks, optimizer, scheduler, args, loss, dp_group, pp)
                    / dp)
        if pp == 1:
            losses = ddp(tokens, positions, mask, labels=labels, loss_mask=loss_mask).float()
            loss = (losses * loss_mask).sum() / loss_mask.sum()
            # fp16: the loss times the scale, as Megatron's schedules do (grad_scale_func)
            (optimizer.scale_loss(loss) if args.fp16 else loss).backward()
            loss = loss.detach()
        else:   # Megatron's 1F1B schedule over the stages, one micro-batch
            loss = _pipelined_step(ddp, tokens, positions, mask, labels, loss_mask, args)
        mean = _finish_step(chunks, optimizer, scheduler, args, loss, dp_group, pp)
        return torch.stack([tokens, labels])[:, None], lr, mean / dp

    if resume is not None:
        _resumed_step(args, chunks, optimizer, scheduler, step, dest, resume)
        dist.destroy_process_group()
        return
    for i in range(1, TRAIN_STEPS + 1):
        step(i)
    args.consumed_train_samples = TRAIN_STEPS * args.global_batch_size
    save_checkpoint(TRAIN_STEPS, chunks, optimizer, scheduler, 0)
    dist.barrier()
    batch, lr, loss = step(TRAIN_STEPS + 1)
    if tp * ep * pp > 1:   # the weights after the step, whole only in a checkpoint: weights alone
        args.save = os.path.join(dest, "after_next_step")
        save_checkpoint(TRAIN_STEPS + 1, chunks, None, None, 0)
    everyone = [torch.empty_like(batch) for _ in range(dp)]
    dist.all_gather(everyone, batch, group=dp_group)
    if dist.get_rank() == 0:
        # [dp, 2 (tokens, labels), m, b, s] -> [2, m dp, b, s]: the global batch's
        # micro-batches in sample order (micro-batch j of rank r is the (j dp + r)-th)
        batches = torch.stack(everyone).permute(1, 2, 0, 3, 4).flatten(1, 2)
        record = {"tokens": batches[0], "labels": batches[1], "lr": lr, "loss": loss,
                  "grad_scaler": _scaler_state(optimizer)}
        if tp * ep * pp == 1:   # (model-parallel runs: the checkpoint after_next_step/)
            record["params"] = {k.removeprefix("module."): v.detach().clone()
                                for k, v in model.state_dict().items()
                                if "_extra_state" not in k}
        torch.save(record, os.path.join(dest, "next_step.pt"))
        with open(os.path.join(dest, "fixture.json"), "w") as f:
            json.dump({"made_by": "megatron-core " + fx._version(), "tp": tp, "pp": pp, "ep": ep,
                       "dp": dp,
                       "flags": [*common, *flags], "steps": TRAIN_STEPS,
                       "padded_vocab_size": args.padded_vocab_size}, f, indent=1)
    dist.destroy_process_group()


def _resumed_step(args, chunks, optimizer, scheduler, step, dest: str, resume: str) -> None:
    """Megatron-LM's resume of ``resume`` and its next step, against ``next_step.pt``."""
    import torch
    import torch.distributed as dist
    from megatron.training.checkpointing import load_checkpoint

    # Megatron-Core's torch-optimizer path (no Apex, no Transformer Engine: CPU) cannot
    # load distributed-optimizer state into a fresh torch Adam: preparing the load reads
    # every parameter's step count, which a fresh Adam lacks, and the copy then expects a
    # loaded tensor for the step too. Give the fresh state step 0, and copy around it
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for inner in inners:
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p] and isinstance(inner, torch.optim.Adam):
                    inner.state[p].update(exp_avg=torch.zeros_like(p), step=torch.tensor(0.0),
                                          exp_avg_sq=torch.zeros_like(p))
    # and its SGD has no init_state_fn, which its fp32 optimizer calls to prepare every
    # load (so Megatron-Core 0.19.2 resumes no fp32 SGD run from torch_dist, its own or ours)
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(o.optimizer, torch.optim.SGD) and o.init_state_fn is None:
            o.init_state_fn = _sgd_state
    setter = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        setter(self, model_param, tensors)
        if step is not None:
            state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    iteration, _ = load_checkpoint(chunks, optimizer, scheduler)
    for inner in inners:   # that path gives all parameters one step tensor, which torch's
        for state in inner.state.values():   # Adam would then advance once per parameter
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    _, lr, loss = step(iteration + 1)
    want = torch.load(os.path.join(dest, "next_step.pt"))
    scalers = {"grad_scaler": _scaler_state(optimizer),
               "want_grad_scaler": want.get("grad_scaler")}
    if dist.get_rank() == 0:   # (weights: where rank 0 holds them whole)
        got = {k.removeprefix("module."): v for k, v in chunks[0].module.state_dict().items()
               if "_extra_state" not in k}
        worst = max(((got[k].float() - w.float()).abs().max().item()
                     for k, w in want.get("params", {}).items()), default=None)
        with open(os.path.join(resume, "resumed.json"), "w") as f:
            json.dump({"iteration": iteration, "consumed_samples": args.consumed_train_samples,
                       "lr": lr, "want_lr": want["lr"], "loss": loss,
                       "want_loss": want["loss"], "max_weight_difference": worst, **scalers},
                      f, indent=1)


def _scaler_state(optimizer) -> dict | None:
    """An fp16 run's dynamic loss scale after a step (the first of a chained optimizer's
    scalers), None without one: the resume compares its own with the fixture run's."""
    first = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    scaler = getattr(first, "grad_scaler", None)
    if scaler is None or not hasattr(scaler, "_growth_tracker"):
        return None
    return {"scale": float(scaler.scale.item()), "growth_tracker": scaler._growth_tracker,
            "hysteresis_tracker": scaler._hysteresis_tracker}


def _sgd_state(opt, config=None) -> None:
    """Empty momentum buffers for a torch SGD, for a checkpoint load to fill."""
    import torch

    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _finish_step(chunks, optimizer, scheduler, args, loss, dp_group, pp) -> float:
    """The step after the backward: the gradients' reductions (and the expert bias update),
    the optimizer and scheduler; the loss summed over dp (the last stage's, on every
    stage)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    finalize_model_grads(chunks)
    assert optimizer.step()[0]
    scheduler.step(increment=args.global_batch_size)
    total = loss.clone()
    dist.all_reduce(total, group=dp_group)
    if pp > 1:
        dist.all_reduce(total, group=mpu.get_pipeline_model_parallel_group())
    return total.item()


def _interleaved_step(chunks, batches, mask, args):
    """Forward and backward of ``batches`` (this rank's micro-batches, each ``(tokens,
    labels, loss_mask, positions)``) through Megatron-Core's interleaved schedule over the
    model ``chunks``: the mean loss over them on the last stage (zero elsewhere). Each
    chunk reads its micro-batches in order from its own iterator."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, positions = next(data_iterator)
        output = model(tokens, positions, mask, labels=labels, loss_mask=loss_mask)

        def loss_func(losses):   # (a copy: the schedule divides the loss in place by m)
            loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    reduced = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
        model=chunks, num_microbatches=len(batches), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        return torch.stack([r["loss"].float() for r in reduced]).mean()
    return torch.zeros(())


def _pipelined_step(ddp, tokens, positions, mask, labels, loss_mask, args):
    """Forward and backward of one micro-batch through Megatron-Core's pipeline schedule:
    the loss on the last stage (zero on the others), detached."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        output = model(tokens, positions, mask, labels=labels, loss_mask=loss_mask)

        def loss_func(losses):
            loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    reduced = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
        num_microbatches=1, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        forward_only=False)
    if mpu.is_pipeline_last_stage():
        return reduced[0]["loss"].float()
    return torch.zeros(())
