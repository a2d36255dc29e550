"""The ``shardwise`` command. Each subcommand is one ``_add_<name>`` function that declares
its flags and a handler; the work itself lives in the subcommand's package, imported only
when that subcommand runs (so ``shardwise --help`` stays fast)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _add_run(sub: argparse._SubParsersAction) -> None:
    from shardwise.launcher.options import add_run_arguments

    parser = sub.add_parser(
        "run", allow_abbrev=False,
        help="start SCRIPT on N processes here or on every host of a hostfile (like the "
        "deepspeed and torchrun launchers)",
        description="Start SCRIPT on N local processes through torch's elastic agent, or, with "
        "a hostfile of several hosts, one node agent per host over ssh/pdsh/srun/mpirun (or "
        "this node's share with --no_ssh). Each process gets RANK, LOCAL_RANK, WORLD_SIZE, "
        "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and --local_rank=<n> as its first "
        "argument. Output lines are prefixed with '[rank<n>]: ' ('[<host> rank<n>]: ' on "
        "several nodes). If a process fails, the others are stopped and the launcher exits "
        "with the failed process's exit code. See docs/launcher.md.")
    add_run_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise import launcher

        if ns.autotuning:  # DeepSpeed's --autotuning tune|run: the autotuner drives the launcher
            from shardwise.autotuning import tune_then_run

            return tune_then_run(ns)
        return launcher.run(launcher.options_from_args(ns))

    parser.set_defaults(handler=handle)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    from shardwise.launcher.doctor import add_doctor_arguments

    parser = sub.add_parser(
        "doctor", allow_abbrev=False, help="say which deepspeed package is active; check the hosts of a hostfile "
        "before a multi-node launch",
        description="Print which 'deepspeed' this Python imports (none, shardwise's compatibility "
        "package or a real DeepSpeed). Then, over ssh, check every host of the hostfile: reachable, same python/torch/"
        "shardwise versions and training script (sha256) as this machine, and the master port "
        "free on node 0 and reachable from every node. Prints a table; exits 1 if anything failed.")
    add_doctor_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.launcher.doctor import main as doctor_main

        return doctor_main(ns)

    parser.set_defaults(handler=handle)


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    from shardwise.apps.options import add_finetune_arguments

    parser = sub.add_parser(
        "finetune", allow_abbrev=False, help="fine-tune a local causal LM on prompt/response/history chat data",
        description="Fine-tune in this process (a world of one, or the world a launcher set up). "
        "For N processes: shardwise run --num_procs N -m shardwise.apps.finetune <same flags>. "
        "See docs/finetune.md.")
    add_finetune_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.apps import finetune

        finetune.run(ns)
        return 0

    parser.set_defaults(handler=handle)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from shardwise.apps.options import add_serve_arguments

    parser = sub.add_parser(
        "serve", allow_abbrev=False, help="serve a fine-tuned chat model over HTTP",
        description="POST / ({prompt, history}), POST /v1/chat/completions (OpenAI format, streaming) "
        "and GET /health, bound to 127.0.0.1 unless --host says otherwise. See docs/finetune.md.")
    add_serve_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.apps import serve

        serve.run(ns)
        return 0

    parser.set_defaults(handler=handle)


# Future subcommands (consolidate, estimate) add one function each.
def _add_estimate(sub: argparse._SubParsersAction) -> None:
    from shardwise.profiling.estimate_cli import add_estimate_arguments

    parser = sub.add_parser(
        "estimate", allow_abbrev=False, help="memory per rank for the model states at each ZeRO stage",
        description="Per-rank device and host memory for parameters, gradients, master weights and "
        "optimizer states at ZeRO stages 0-3 with and without offload, plus activations for "
        "transformer shapes. See docs/profiling.md.")
    add_estimate_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.profiling import estimate_cli

        return estimate_cli.run(ns)

    parser.set_defaults(handler=handle)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from shardwise.planning.options import add_plan_arguments

    parser = sub.add_parser(
        "plan", allow_abbrev=False, help="lay out a run of W ranks in one process and report what each rank "
        "holds and sends",
        description="Build the process groups of every rank (torch's fake backend), the model on the meta "
        "device and each rank's ZeRO partition with the engine's own code, then print per rank: parameters, "
        "model-state bytes, an activation estimate, communication bytes per step by axis, pipeline balance "
        "and the checkpoint layout. See docs/planning.md.")
    add_plan_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.planning import report

        return report.run(ns)

    parser.set_defaults(handler=handle)


def _add_autotune(sub: argparse._SubParsersAction) -> None:
    from shardwise.launcher.options import add_run_arguments

    parser = sub.add_parser(
        "autotune", allow_abbrev=False, help="find the ZeRO stage and micro-batch size that train fastest",
        description="Run short real trials of SCRIPT (through 'shardwise run' with the same flags) over "
        "ZeRO stages and micro-batch sizes, as the config's 'autotuning' block says; write each "
        "trial, a summary and the best config to autotuning.results_dir. See docs/autotuning.md.")
    parser.add_argument("--trial_timeout", type=float, default=900.0, metavar="SECONDS",
                        help="stop a trial that runs longer (default %(default)s)")
    add_run_arguments(parser)

    def handle(ns: argparse.Namespace) -> int:
        from shardwise import autotuning

        return autotuning.run(ns)

    parser.set_defaults(handler=handle)


def _add_plot(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plot", allow_abbrev=False, help="PNG charts (loss, lr, throughput, ...) from csv_monitor output",
        description="Draw every series of a csv_monitor folder (output_path/job_name), or of each "
        "such folder inside RUN_DIR on shared axes. See docs/monitoring.md.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="csv_monitor folder (or a folder of them)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write the PNGs (default RUN_DIR/plots)")

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.monitor.plot import plot_run

        for path in plot_run(ns.run_dir, ns.out):
            print(path)
        return 0

    parser.set_defaults(handler=handle)


def _add_consolidate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "consolidate", allow_abbrev=False, help="a checkpoint as a full fp32 state dict (or a Hugging Face folder)",
        description="Stream a checkpoint's fragments (any world size, any ZeRO stage) into fp32 safetensors "
        "files of bounded size with a model.safetensors.index.json. See docs/checkpoints.md.")
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="save_dir of engine.save_checkpoint (or one tag's folder)")
    parser.add_argument("out", metavar="OUT", help="output folder")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CKPT_DIR/latest)")
    parser.add_argument("--hf-config", default=None, metavar="DIR",
                        help="a Hugging Face model folder: copy its config/tokenizer files so from_pretrained(OUT) works")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 500MB (default 5GB)")
    parser.add_argument("--exclude-frozen-parameters", action="store_true", help="leave out frozen parameters")

    def handle(ns: argparse.Namespace) -> int:
        import tempfile

        from shardwise.checkpoint.consolidate import consolidate_checkpoint
        from shardwise.checkpoint.deepspeed_format import is_deepspeed_checkpoint
        from shardwise.checkpoint.deepspeed_import import convert_deepspeed_checkpoint

        try:
            with tempfile.TemporaryDirectory(prefix="shardwise-from-deepspeed-") as tmp:
                src = ns.ckpt_dir
                if is_deepspeed_checkpoint(src, ns.tag):  # DeepSpeed's own layout: converted first
                    src = convert_deepspeed_checkpoint(src, tmp, tag=ns.tag)
                print(consolidate_checkpoint(src, ns.out, tag=None if src != ns.ckpt_dir else ns.tag,
                                             max_shard_size=ns.max_shard_size, hf_config=ns.hf_config,
                                             exclude_frozen_parameters=ns.exclude_frozen_parameters))
        except FileNotFoundError as e:  # a missing tag or file: a message, not a traceback
            raise ValueError(str(e)) from None
        return 0

    parser.set_defaults(handler=handle)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "convert", allow_abbrev=False, help="a DeepSpeed checkpoint as a native shardwise checkpoint",
        description="Read a checkpoint folder written by DeepSpeed's save_checkpoint (ZeRO 0-3, fp32/fp16/bf16; "
        "with the restricted unpickler) and write it as a shardwise checkpoint OUT/<tag> (safetensors + JSON, "
        "OUT/latest), which engine.load_checkpoint then reads at any world size and ZeRO stage without "
        "unpickling anything. See docs/checkpoints.md.")
    parser.add_argument("--from-deepspeed", required=True, metavar="DIR",
                        help="DeepSpeed save_dir (or one tag's folder)")
    parser.add_argument("out", metavar="OUT", help="output save_dir")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in DIR/latest)")

    def handle(ns: argparse.Namespace) -> int:
        from shardwise.checkpoint.deepspeed_import import convert_deepspeed_checkpoint

        try:
            print(convert_deepspeed_checkpoint(ns.from_deepspeed, ns.out, tag=ns.tag))
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        return 0

    parser.set_defaults(handler=handle)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_run, _add_doctor, _add_finetune, _add_serve,
                                                                   _add_estimate, _add_plan, _add_autotune, _add_plot,
                                                                   _add_consolidate, _add_convert]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise",
                                     description="DeepSpeed-compatible distributed training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    handler: Handler = ns.handler
    try:
        return handler(ns)
    except ValueError as exc:  # a user mistake found before anything started
        parser.exit(2, f"shardwise {ns.command}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


def deepspeed_command(argv: Sequence[str] | None = None) -> int:
    """The ``deepspeed`` console script of the compatibility package (compat/deepspeed):
    ``deepspeed ARGS`` is ``shardwise run ARGS``, as DeepSpeed's launcher takes the same flags."""
    return main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
