"""``longpeft train RECIPE [--resume] [--launch KIND --gpus G [--nodes N ...]]``: train in this process, or start a
launch of several (:mod:`longpeft.launch.start`)."""

from __future__ import annotations

import argparse
import json

from ..errors import ConfigError
from ..launch.kinds import LAUNCHES
from ..launch.start import launch_training
from ..launch.teardown import deepspeed_on_cpu, exit_without_teardown
from ..recipes.schema import load_recipe
from ..recipes.validate import validate_recipe
from .arguments import add_recipe_arguments, number


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand."""
    train = subparsers.add_parser("train", help="train a recipe (QLoRA + RoPE-base expansion, HARPE, ...)")
    add_recipe_arguments(train)
    train.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint after a kill")
    train.add_argument(
        "--allow-recipe-change",
        action="store_true",
        help="with --resume: continue even though training keys of the recipe changed",
    )
    train.add_argument(
        "--launch",
        choices=LAUNCHES,
        help="run on several GPUs with accelerate and longpeft's config of that kind (see longpeft/launch/)",
    )
    train.add_argument(
        "--gpus", type=int, help="with --launch: number of GPUs (processes; default: every CUDA device)"
    )
    train.add_argument("--print-command", action="store_true", help="with --launch: print the command, do not run it")
    nodes = train.add_argument_group("past one node (with --launch; run the same command on every node)")
    nodes.add_argument("--nodes", type=number(int, 1), help="number of nodes (default 1); --gpus is per node")
    nodes.add_argument(
        "--node-rank", type=int, help="this node's rank, 0 to nodes - 1 (0: the node at --main-address)"
    )
    nodes.add_argument(
        "--main-address",
        metavar="HOST:PORT",
        help="address of the node of rank 0 and a free port on it, the same on every node",
    )
    nodes.add_argument(
        "--print-slurm",
        action="store_true",
        help="print a SLURM batch script that runs this launch "
        "on --nodes nodes of --gpus GPUs (one srun task per node), do not train",
    )
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    if args.launch:
        from ..scale import shape_from_config, shape_of  # the planner imports torch: only a launch reads the heads

        # plan's checks before any process starts (each launched process runs them again)
        validation = validate_recipe(load_recipe(args.recipe, args.overrides))
        base = validation.base  # the config validation read (its revision, from the Hub), else the local files
        model_shape = shape_of if base is None else lambda _name: shape_from_config(base.config.to_dict())
        return launch_training(
            validation.recipe,
            args.recipe,
            args.launch,
            model_shape,
            gpus=args.gpus,
            overrides=args.overrides,
            train_flags=["--resume"] * args.resume + ["--allow-recipe-change"] * args.allow_recipe_change,
            nodes=args.nodes,
            node_rank=args.node_rank,
            main_address=args.main_address,
            print_command=args.print_command,
            print_slurm=args.print_slurm,
        )
    launch_flags = {
        "--gpus": args.gpus is not None,
        "--print-command": args.print_command,
        "--nodes": args.nodes,
        "--node-rank": args.node_rank is not None,
        "--main-address": args.main_address,
        "--print-slurm": args.print_slurm,
    }
    given = [flag for flag, present in launch_flags.items() if present]
    if given:
        raise ConfigError(
            f"{given[0]} goes with --launch ddp|fsdp2|zero3|ulysses (without --launch the recipe trains "
            "in this one process)"
        )
    from ..recipes.runner import run  # torch and the training stack: `longpeft --help` and plan do without

    result = run(
        load_recipe(args.recipe, args.overrides), resume=args.resume, allow_recipe_change=args.allow_recipe_change
    )
    print(json.dumps({"adapter": str(result.adapter_dir), **result.metrics}, indent=2, default=str))
    if deepspeed_on_cpu():
        exit_without_teardown()
    return 0
