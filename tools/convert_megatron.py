"""The Megatron-LM conversions of ``convert_checkpoint.py``: a Megatron-Core checkpoint
(``torch_dist`` or legacy rank files) into a megalite one, with the optimizer state where
Megatron saved one megalite reads, so that the run resumes; and a megalite checkpoint into
a Megatron-Core ``torch_dist`` one, with the optimizer state and the lr schedule's position
where the run has them, so that Megatron-LM resumes it (megalite.checkpoint.megatron)."""

from __future__ import annotations

from megalite.config import ConfigError, ParallelConfig
from tools.conversion import ConversionError, progress, tokenizer_flags, training_flags


def megatron_to_megalite(args) -> None:
    from megalite.checkpoint.consolidated import save_full_model
    from megalite.checkpoint.megatron import read_megatron

    with progress(2, "convert", "step") as bar:
        bar.set_postfix_str("reading the Megatron checkpoint")
        imported = read_megatron(args.load_dir, args.ckpt_step,
                                 load_optim=not args.no_load_optim)
        bar.update(1)
        cfg = imported.cfg
        cfg.parallel = ParallelConfig(   # (whether Megatron sharded its optimizer stays)
            tensor_model_parallel_size=args.target_tensor_parallel_size,
            pipeline_model_parallel_size=args.target_pipeline_parallel_size,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
        try:
            cfg.validate(args.target_tensor_parallel_size * args.target_pipeline_parallel_size)
        except ConfigError as exc:
            raise ConfigError(f"the target layout does not fit the model: {exc}") from None
        bar.set_postfix_str("saving the checkpoint")
        try:
            path = save_full_model(cfg, imported.state, args.save_dir, imported.optimizer)
        except (KeyError, ValueError) as exc:
            raise ConversionError(f"cannot convert {imported.source.directory}: "
                                  f"{str(exc).strip(chr(34))}") from None
        bar.update(1)
    for note in imported.notes:
        print(f"note: {note}")
    src = imported.source
    step = "release" if src.iteration is None else f"iteration {src.iteration}"
    flags = training_flags(cfg) + tokenizer_flags(cfg)
    if imported.optimizer is not None:
        o = imported.optimizer
        if cfg.train.per_microbatch_loss:   # Megatron's default objective, not megalite's
            flags.append("--per-microbatch-loss")
        print(f"wrote {path} (Megatron {src.format} {step}, "
              f"{sum(t.numel() for t in imported.state.values()):,} parameters, the "
              f"{cfg.optim.optimizer} state of step {o.step}, {o.consumed_samples:,} samples "
              "consumed)")
        print("resume it with the Megatron-LM run's own flags (megalite takes them) and "
              f"--load {args.save_dir} --no-load-rng, without --finetune: the optimizer "
              "state, the lr schedule's position and the data position (sample "
              f"{o.consumed_samples}) carry on"
              + ("; add --per-microbatch-loss, the loss normalisation of a Megatron run "
                 "without --calculate-per-token-loss" if cfg.train.per_microbatch_loss
                 else "") + "; its architecture flags:\n  "
              "pretrain/pretrain_gpt.py " + " ".join(flags)
              + f" --load {args.save_dir} --no-load-rng --save <dir> ...")
        return
    print(f"wrote {path} (Megatron {src.format} {step}, "
          f"{sum(t.numel() for t in imported.state.values()):,} parameters)")
    print("continue training with:\n  pretrain/pretrain_gpt.py " + " ".join(flags)
          + f" --load {args.save_dir} --finetune --save <dir> ...")


def megalite_to_megatron(args) -> None:
    from megalite.checkpoint.consolidated import (
        checkpoint_config,
        load_full_model,
        load_full_training_state,
    )
    from megalite.checkpoint.megatron import SUPPORTED, arguments, mapping, optimizer
    from megalite.checkpoint.megatron.writer import write_megatron

    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    with progress(2, "convert", "step") as bar:
        bar.set_postfix_str("loading the checkpoint")
        cfg, iteration = checkpoint_config(args.load_dir, args.ckpt_step)
        if args.no_load_optim:
            full = load_full_model(args.load_dir, iteration)[1].full_state_dict()
            state = scheduler = None
        else:
            _, full, state, scheduler = load_full_training_state(args.load_dir, iteration)
        bar.update(1)
        problems = (arguments.unsupported(arguments.megatron_args(cfg, tp, pp))
                    + arguments.unexportable(cfg.model))
        unmapped = mapping.unmapped(full)
        if unmapped:
            problems.append(f"{len(unmapped)} tensors with no Megatron-Core counterpart, "
                            f"e.g. {', '.join(unmapped[:3])}")
        if problems:
            raise ConversionError(f"cannot convert {args.load_dir} to Megatron: "
                                  f"{'; '.join(problems)}; megalite writes {SUPPORTED}")
        bar.set_postfix_str("writing torch_dist")
        impl = args.transformer_impl or cfg.model.transformer_impl or mapping.TE
        distributed = (args.target_optimizer_format == "distributed"
                       if args.target_optimizer_format
                       else cfg.parallel.data_parallel_sharding_strategy != "no_shard")
        # the megalite run's own expert parallel size unless given (an import's is 1)
        ep = args.target_expert_model_parallel_size or (
            cfg.parallel.expert_model_parallel_size if cfg.model.num_experts else 1)
        expert_parallel = ep > 1
        why = None if state is None else optimizer.not_exportable(cfg, distributed,
                                                                  expert_parallel)
        out = None
        if state is not None and why is None:
            out = optimizer.to_megatron_optimizer(
                cfg, full, state, scheduler, cfg.model.padded_vocab_size(tp), impl,
                distributed, expert_parallel=expert_parallel)
        directory = write_megatron(cfg, full, args.save_dir, iteration, tp, pp, impl, out, ep)
        bar.update(1)
    print(f"wrote {directory} (Megatron-Core torch_dist, iteration {iteration}, vocabulary "
          f"padded to {cfg.model.padded_vocab_size(tp)}, names of --transformer-impl "
          f"{impl}{_optimizer_written(state, out, distributed and cfg.optim.optimizer != 'lion')})")
    if why is not None:
        print(f"note: the optimizer state is not written ({why})")
    if out is None:
        print(f"load it in Megatron-LM with --ckpt-format torch_dist --load "
              f"{args.save_dir} --finetune and the model's flags")
        return
    if cfg.optim.optimizer == "lion":   # Megatron-Core keeps a Lion run's optimizers plain
        flag = (", with or without --use-distributed-optimizer (Megatron-Core keeps Lion's "
                "optimizers plain either way)")
    else:
        flag = (", with --use-distributed-optimizer" if distributed
                else ", without --use-distributed-optimizer")
    if cfg.model.num_experts and ep == 1:   # the optimizer chain depends on ep > 1
        flag += (", at --expert-model-parallel-size 1 (for a run at expert parallel N > 1 "
                 "convert with --target-expert-model-parallel-size N: Megatron gives its "
                 "experts an optimizer of their own there)")
    elif cfg.model.num_experts:
        flag += f", at --expert-model-parallel-size {ep}"
    print(f"resume the run in Megatron-LM with its flags and --ckpt-format torch_dist --load "
          f"{args.save_dir}, without --finetune" + flag
          + f": the optimizer state, the lr schedule's position and the data position "
          f"(sample {state['consumed_samples']}) carry on")


def _optimizer_written(state, out, distributed: bool) -> str:
    """The conversion summary's words on the optimizer state."""
    if out is None:
        return ", weights only"
    return (f", the {state['step']}-step optimizer state for "
            f"{'--use-distributed-optimizer' if distributed else 'the plain optimizer'}")
