"""The ``dapo-megatron`` command line.

One executable with a sub-command per task (``config``, ``plan``, ``train``, ``eval``,
``convert``, ``bench``). Sub-commands import their
components lazily, so ``dapo-megatron --help`` and ``dapo-megatron config`` work on any
machine, with or without megatron's GPU extras. Exit status: 0 on success, 2 for a
config or usage error (with a message that names the key, the value and the rule), 1 for
a failure while running (a dead or hung worker, a diverged run, dynamic sampling
exhausted), 75 when ``train`` stopped on SIGTERM/SIGUSR1 after saving, or without the
save when it did not fit in ``trainer.stop_grace_s`` (run it again with ``--resume``),
128 + the signal's number when such a signal came while it was still starting (nothing
to save), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from dapo_megatron import __version__
from dapo_megatron.bench.phases import PHASE_HELP, PHASES
from dapo_megatron.config import ConfigError, load_config, source_of


class ExitCode(enum.IntEnum):
    """What the command's exit status says (a SLURM script or a user's wrapper acts on it)."""

    OK = 0
    FAILED = 1
    """The run failed (a member died or hung, training diverged, dynamic sampling ran
    dry): the message says what, and how to resume."""
    USAGE = 2
    """Bad input (a config, an argument, a file): nothing was started or changed."""
    PREEMPTED = 75
    """``train`` stopped by SIGTERM/SIGUSR1 after saving (EX_TEMPFAIL: run it again with
    --resume)."""
    INTERRUPTED = 130
    """Ctrl-C: everything the command started was stopped."""


def signalled(signum: int) -> int:
    """The status of a run stopped by signal ``signum`` while it was starting (nothing
    to save): 128 + the signal's number, as a shell reports a process the signal killed."""
    return 128 + signum


def _cmd_config(args: argparse.Namespace) -> int:
    from dapo_megatron.run.preflight import preflight

    config = load_config(args.file, args.overrides)
    preflight(config)
    if args.show_prompt is not None:
        from dapo_megatron.data import describe_prompt
        from dapo_megatron.run.system import load_run_data

        tokenizer, train_data, _, _ = load_run_data(config)
        print(describe_prompt(train_data, args.show_prompt, tokenizer))
        return ExitCode.OK
    sys.stdout.write(config.to_yaml())
    return ExitCode.OK


def _cmd_plan(args: argparse.Namespace) -> int:
    from dapo_megatron.plan import format_plan, make_plan

    config = load_config(args.file, args.overrides)
    plan = make_plan(config, signal_lead_s=args.signal_lead_s)
    print(format_plan(plan))
    if not plan.fits:
        for problem in plan.problems:
            print(
                f"dapo-megatron plan: error: {source_of(config, *problem.keys)}: layout does not fit: {problem.message}",
                file=sys.stderr,
            )
        print(f"dapo-megatron plan: smallest change that fits: {plan.suggestion}", file=sys.stderr)
        return ExitCode.USAGE
    if args.rehearse:
        return _rehearse(config, args)
    return ExitCode.OK


def _rehearse(config, args: argparse.Namespace) -> int:
    """``plan --rehearse``: place the job on a simulated cluster; 2 when it cannot be placed."""
    import logging

    from dapo_megatron.orchestration.group_calls import MemberFailed
    from dapo_megatron.orchestration.rehearsal import format_rehearsal, rehearse
    from dapo_megatron.plan import stage_sync_bytes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        rehearsal = rehearse(config, cpus_per_node=args.cpus_per_node, spare_nodes=args.spare_nodes)
    except (MemberFailed, ValueError, RuntimeError) as exc:
        print(f"dapo-megatron plan: error: the job cannot be placed: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(format_rehearsal(rehearsal, stage_sync_bytes(config)))
    if rehearsal.problems:
        print(
            f"dapo-megatron plan: error: the rehearsed placement has {len(rehearsal.problems)} problem(s)",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    return ExitCode.OK


def _cmd_train(args: argparse.Namespace) -> int:
    import logging

    from dapo_megatron.run.signals import Preempted
    from dapo_megatron.run.trainer import TrainingDiverged, train

    config = load_config(args.file, args.overrides)
    logging.basicConfig(
        level=config.logging.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    from dapo_megatron.algo import DynamicSamplingExhausted
    from dapo_megatron.orchestration.group_calls import MemberFailed
    from dapo_megatron.run.signals import StartupInterrupted, StopOutOfTime
    from dapo_megatron.run.step import GenerationAheadFailed, StaleBatch
    from dapo_megatron.weight_sync.bucket import WeightSyncError

    try:
        result = train(config, resume=args.resume or args.resume_from is not None, resume_from=args.resume_from)
    except (DynamicSamplingExhausted, TrainingDiverged) as exc:
        print(f"dapo-megatron train: error: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    except Preempted as exc:
        print(f"dapo-megatron train: {exc}", file=sys.stderr)
        return ExitCode.PREEMPTED
    except StartupInterrupted as exc:
        print(f"dapo-megatron train: {exc}", file=sys.stderr)
        return signalled(exc.signum)
    except StopOutOfTime as exc:  # the job is still requeued: it resumes from the previous checkpoint
        print(f"dapo-megatron train: error: {exc}", file=sys.stderr)
        print(f"dapo-megatron train: {_resume_hint(config, args.resume)}", file=sys.stderr)
        return ExitCode.PREEMPTED
    except (MemberFailed, WeightSyncError, GenerationAheadFailed, StaleBatch) as exc:
        # A member failed, hung or fell behind: the same message whichever it was.
        print(f"dapo-megatron train: error: {exc}", file=sys.stderr)
        print(f"dapo-megatron train: {_resume_hint(config, args.resume)}", file=sys.stderr)
        return ExitCode.FAILED
    if result.already_complete:
        print(
            f"the run in {result.run_dir} is complete: its checkpoint {result.last_checkpoint} is at step "
            f"{result.steps} of trainer.num_steps={config.trainer.num_steps}; nothing to do (raise "
            "trainer.num_steps to train further)"
        )
        return ExitCode.OK
    print("\n".join(result.summary(config)))
    return ExitCode.OK


def _resume_hint(config, resumed: bool) -> str:
    """Where a failed run can continue from (``resumed``: it was itself a resumed run)."""
    from dapo_megatron.ckpt.dcp_io import latest_checkpoint

    save_dir = config.checkpoint_save_dir
    try:
        latest = latest_checkpoint(save_dir)
    except FileNotFoundError as exc:
        return f"the checkpoint folder is inconsistent: {exc}"
    if latest is None:
        return (
            f"no checkpoint was written to {save_dir} yet; run the same command without --resume to start again "
            "(the folder is reused, its earlier metrics kept aside)"
        )
    return f"the last complete checkpoint is {latest}; {'run again with' if resumed else 'add'} --resume to continue from it"


def _cmd_eval(args: argparse.Namespace) -> int:
    import logging

    from dapo_megatron.run.evaluation import evaluate, format_table
    from dapo_megatron.run.preflight import check_inputs_exist, check_reward

    config = load_config(args.file, args.overrides)
    check_reward(config)
    check_inputs_exist(config)
    logging.basicConfig(
        level=config.logging.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    result = evaluate(config, ckpt=args.ckpt, hf_dir=args.hf_dir, out_dir=args.out)
    print(format_table(result.summary))
    print(f"wrote {result.out_dir / 'summary.json'} and {result.out_dir / 'problems.jsonl'}")
    return ExitCode.OK


def _cmd_bench(args: argparse.Namespace) -> int:
    import json
    import logging

    from dapo_megatron.bench.report import format_report
    from dapo_megatron.bench.run import BenchOptions, check_phases, run_bench
    from dapo_megatron.run.preflight import check_inputs_exist, check_reward

    config = load_config(args.file, args.overrides)
    check_reward(config)
    check_inputs_exist(config)
    logging.basicConfig(
        level=config.logging.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    options = BenchOptions(
        phases=check_phases(args.phases.split(",")),
        steps=args.steps,
        warmup=args.warmup,
        reward_responses=args.reward_responses,
        peak_tflops=args.peak_tflops,
        peak_tb_per_s=args.peak_tb_per_s,
        extra={"command": " ".join(["dapo-megatron", "bench", args.file, *args.overrides])},
    )
    from dapo_megatron.run.signals import StartupInterrupted

    try:
        result = run_bench(config, options)
    except StartupInterrupted as exc:  # bench never gets past "starting": any signal ends it
        print(f"dapo-megatron bench: {exc}", file=sys.stderr)
        return signalled(exc.signum)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return ExitCode.OK


def _cmd_report(args: argparse.Namespace) -> int:
    from dapo_megatron.run.report import write_report

    try:
        path = write_report(args.run, args.out, args.steps)
    except FileNotFoundError as exc:
        print(f"dapo-megatron report: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"wrote {path}")
    return ExitCode.OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from dapo_megatron.ckpt.convert import run_cli

    run_cli(args.direction, args, log=lambda line: print(line, file=sys.stderr))
    return ExitCode.OK


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``convert`` sub-commands (shared with tools/convert_ckpt/)."""
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_megatron = directions.add_parser(
        "hf-to-megatron",
        help="HF safetensors -> Megatron dist checkpoint (loads at any tp/pp layout)",
        description="Convert a Hugging Face checkpoint (Qwen2/Qwen2.5, Qwen3) into a megatron-core torch_dist checkpoint.",
    )
    to_megatron.add_argument("--hf-dir", required=True, help="folder with config.json and *.safetensors")
    to_megatron.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    to_hf = directions.add_parser(
        "megatron-to-hf",
        help="Megatron dist checkpoint -> HF safetensors shards + config + tokenizer",
        description="Convert a megatron-core torch_dist checkpoint (converted or trained) back into HF format.",
    )
    to_hf.add_argument("--ckpt", required=True, help="checkpoint folder, or a save folder with a 'latest' file")
    to_hf.add_argument("--hf-config", required=True, help="folder with the model's config.json and tokenizer files")
    to_hf.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="size of each safetensors file (default 5)")
    for sub in (to_megatron, to_hf):
        sub.add_argument("--overwrite", action="store_true", help="replace an existing output folder (after success)")
        sub.add_argument(
            "--dtype",
            choices=["keep", "bfloat16", "float16", "float32"],
            default="keep",
            help="dtype of the written tensors (default: as stored); verification rounds both sides to it",
        )
        verify = sub.add_mutually_exclusive_group()
        verify.add_argument(
            "--verify",
            dest="verify",
            action="store_true",
            default=None,
            help="compare logits with transformers' own model (default: on up to 2 GiB)",
        )
        verify.add_argument("--no-verify", dest="verify", action="store_false", help="skip the logit comparison")
        sub.add_argument("--quiet", action="store_true", help="print the final summary line only")


def _config_arguments(command: argparse.ArgumentParser, func) -> None:
    """A run config and its dotted overrides, the arguments of every config-driven command."""
    command.add_argument("file", metavar="FILE.yaml", help="run config")
    command.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. parallel.tp_size=8")
    command.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dapo-megatron`` and its sub-commands."""
    parser = argparse.ArgumentParser(
        prog="dapo-megatron",
        description="DAPO reinforcement-learning training on megatron-core (CPU or GPU).",
    )
    parser.add_argument("--version", action="version", version=f"dapo-megatron {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = commands.add_parser(
        "config",
        help="validate a run config and print it fully resolved, as YAML",
        description="Load FILE.yaml strictly, apply section.key=value overrides, fill the "
        "model shape from model.hf_config, check the layout, and print the resolved config.",
    )
    _config_arguments(config, _cmd_config)
    config.add_argument(
        "--show-prompt",
        type=int,
        metavar="N",
        help="instead of the config, show training prompt N (from 0) as the model gets it: the rendered text, its "
        "tokens, and what the tokenizer turns them back into (a tokenizer that cannot represent the text shows here)",
    )

    plan = commands.add_parser(
        "plan",
        help="check a layout and estimate per-GPU memory before queueing a job",
        description="Validate the layout against the world size and model shape, count parameters, and estimate "
        "per-GPU memory (weights, gradients, distributed optimizer, activations, log-prob buffers, SGLang). "
        "Exits 2 with the reason and the smallest change that fits when it does not fit.",
    )
    _config_arguments(plan, _cmd_plan)
    plan.add_argument(
        "--rehearse",
        action="store_true",
        help="also place the whole job on a simulated cluster of the config's nodes and GPUs (a local Ray instance "
        "that declares them; no GPU needed), through the code train uses, with stand-in ranks and engines; print the "
        "per-node map and check it (every GPU one rank, engines on their node's GPUs and fed from it)",
    )
    plan.add_argument(
        "--signal-lead-s",
        type=float,
        metavar="S",
        help="the job's --signal lead time (sbatch --signal=B:USR1@S): check that trainer.stop_grace_s and the "
        "workers' clean-up fit in it",
    )
    plan.add_argument(
        "--cpus-per-node",
        type=int,
        default=32,
        metavar="N",
        help="CPUs each simulated node declares (default 32; at least parallel.num_devices_per_node)",
    )
    plan.add_argument(
        "--spare-nodes",
        type=int,
        default=None,
        metavar="N",
        help="simulated nodes besides the actor's, for separate engines (rollout.colocate=false); default: as many as "
        "the engines' GPUs fill",
    )

    train = commands.add_parser(
        "train",
        help="run DAPO training (Ray, the Megatron actor, rollout engines)",
        description="Start (or join, with ray.address) a Ray cluster, place the Megatron actor's ranks and the "
        "rollout engines, and run trainer.num_steps DAPO steps, logging to TensorBoard, metrics.jsonl and the console.",
    )
    _config_arguments(train, _cmd_train)
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint of the run folder (or checkpoint.load_dir): actor, "
        "optimizer, step and data position",
    )
    train.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue the run from this checkpoint of its own (e.g. the one before a damaged latest one); later "
        "steps' metrics are dropped and their checkpoints replaced as the run reaches them again",
    )

    evaluate = commands.add_parser(
        "eval",
        help="avg@k and pass@k of a checkpoint on the validation files (as the trainer validates)",
        description="Sample rollout.val_n_samples responses per validation problem with the rollout.val_* settings "
        "and report avg@k and pass@k per data source and overall; repeated problems are counted once.",
    )
    _config_arguments(evaluate, _cmd_eval)
    weights = evaluate.add_mutually_exclusive_group(required=True)
    weights.add_argument("--ckpt", help="a Megatron checkpoint (or a save folder with a 'latest' file)")
    weights.add_argument("--hf-dir", help="an HF model folder (safetensors)")
    evaluate.add_argument(
        "--out",
        help="output folder (default: eval/<name>-<time> in the run folder the weights come from, else beside them)",
    )

    bench = commands.add_parser(
        "bench",
        help="measure every phase of a DAPO step against this machine's ceilings",
        description="Start the run's system (Ray, the actor, the engines) and time generation, the old-log-prob "
        "pass, the DAPO updates, weight sync, the reward and whole steps; report seconds, tokens/s, peak memory, "
        "model FLOPs and their fraction of a plain matmul, a plain copy and (on a GPU) the published peak.",
    )
    _config_arguments(bench, _cmd_bench)
    bench.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated, from: " + "; ".join(f"{name} ({what})" for name, what in PHASE_HELP.items()),
    )
    bench.add_argument("--steps", type=int, default=3, help="measured repetitions of each phase (default 3)")
    bench.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (default 1)")
    bench.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    bench.add_argument("--reward-responses", type=int, default=2000, help="responses in the reward mix")
    bench.add_argument("--peak-tflops", type=float, help="per-device peak to compute MFU against (default: published)")
    bench.add_argument("--peak-tb-per-s", type=float, help="per-device memory bandwidth (default: published)")

    report = commands.add_parser(
        "report",
        help="one self-contained HTML page of a run (also of a run in progress)",
        description="Plots of the learning curve, the mismatch, the phases of a step and dynamic sampling's keep rate, "
        "and the best, worst and most frequent responses of chosen steps (docs/running.md).",
    )
    report.add_argument("run", type=Path, help="the run folder (trainer.output_dir)")
    report.add_argument("--out", type=Path, help="the page to write (default: RUN/report.html)")
    report.add_argument(
        "--steps", type=int, nargs="+", help="the steps whose responses are shown (default: first, middle, last)"
    )
    report.set_defaults(func=_cmd_report)

    convert = commands.add_parser(
        "convert",
        help="convert checkpoints between Hugging Face and Megatron formats",
        description="Exact, streaming HF <-> Megatron conversion for Qwen2/Qwen2.5, Qwen3 and Qwen3-MoE (verified against "
        "transformers).",
    )
    add_convert_arguments(convert)
    convert.set_defaults(func=_cmd_convert)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``parser``'s arguments, with a config-driven command's ``key=value`` overrides
    allowed anywhere after its FILE (``train run.yaml --resume a.b=1`` as well as
    ``train run.yaml a.b=1 --resume``), in the order given."""
    args, extras = parser.parse_known_args(argv)
    unknown = [e for e in extras if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if args.command is None:
        parser.print_help()
        return ExitCode.USAGE
    try:
        return args.func(args)
    except ConfigError as exc:  # includes ConversionError and DataError: bad input, explained
        print(f"dapo-megatron {args.command}: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print(f"dapo-megatron {args.command}: interrupted; everything it started was stopped", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
