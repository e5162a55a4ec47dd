"""``longpeft train RECIPE [--resume] [--launch KIND --gpus G [--nodes N ...]]``: train in this process, or start a
launch of several with ``accelerate launch``."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess

from ..errors import ConfigError
from ..launch import launch_command
from ..launch.kinds import LAUNCHES
from ..launch.nodes import DEFAULT_MAIN_PORT, Nodes, parse_main_address, slurm_script
from ..launch.start import accelerate_executable, check_processes
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
        help="print a SLURM batch script that runs this launch on --nodes nodes of --gpus GPUs (one srun task per "
        "node), do not train",
    )
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    if args.launch:
        return _launch(args)
    flags = ("gpus", "print_command", "nodes", "node_rank", "main_address", "print_slurm")
    given = [name for name in flags if (value := getattr(args, name)) not in (None, "") and value is not False]
    if given:
        raise ConfigError(
            f"--{given[0].replace('_', '-')} goes with --launch ddp|fsdp2|zero3|ulysses (without --launch the recipe "
            "trains in this one process)"
        )
    from ..recipes.runner import run  # torch and the training stack: `longpeft --help` and plan do without

    result = run(
        load_recipe(args.recipe, args.overrides), resume=args.resume, allow_recipe_change=args.allow_recipe_change
    )
    print(json.dumps({"adapter": str(result.adapter_dir), **result.metrics}, indent=2, default=str))
    if deepspeed_on_cpu():
        exit_without_teardown()
    return 0


def _launch(args: argparse.Namespace) -> int:
    """``train --launch KIND``: the recipe validated and checked at nodes x GPUs processes (:func:`check_processes`),
    then ``accelerate launch`` run (its exit status), or its command or a SLURM script that runs it on every node
    printed. Without ``--gpus``, every CUDA device of this machine."""
    import torch  # the planner imports it too: only a launch counts the devices and reads the heads

    from ..scale import shape_from_config, shape_of

    # plan's checks before any process starts (each launched process runs them again)
    validation = validate_recipe(load_recipe(args.recipe, args.overrides))
    recipe, base, launch = validation.recipe, validation.base, args.launch
    # the config validation read (its revision, from the Hub), else the local files
    model_shape = shape_of if base is None else lambda _name: shape_from_config(base.config.to_dict())
    if args.print_slurm and args.print_command:
        raise ConfigError("--print-slurm and --print-command: choose one (the script holds the command)")
    devices = torch.cuda.device_count()
    if args.print_slurm and args.gpus is None:
        raise ConfigError("--print-slurm: give --gpus G, the GPUs of each node (the script asks SLURM for them)")
    gpus = args.gpus if args.gpus is not None else devices
    if gpus < 1:
        raise ConfigError(f"--launch {launch}: give --gpus N >= 1 (this machine shows {devices} CUDA devices)")
    count = args.nodes or 1
    if args.print_slurm:
        for flag, given in (("--node-rank", args.node_rank is not None), ("--main-address", args.main_address)):
            if given:
                raise ConfigError(
                    f"--print-slurm with {flag}: the script takes each node's rank from $SLURM_NODEID and the main "
                    "address from the first host of the allocation (MAIN_PORT=PORT sbatch ... changes the port)"
                )
        place = Nodes(count, host="MAIN_HOST")  # the script replaces the address and the rank
    else:
        host, port = parse_main_address(args.main_address) if args.main_address else (None, DEFAULT_MAIN_PORT)
        place = Nodes(count, args.node_rank or 0, host, port)
    check_processes(recipe, launch, gpus * count, model_shape)
    train_flags = ["--resume"] * args.resume + ["--allow-recipe-change"] * args.allow_recipe_change
    command = [*launch_command(recipe, args.recipe, launch, gpus, args.overrides, place), *train_flags]
    if args.print_slurm:
        print(slurm_script(command, f"longpeft-{recipe.name}", count, gpus), end="")
    elif args.print_command:
        print(shlex.join(command))
    else:
        return subprocess.call([accelerate_executable(), *command[1:]])
    return 0
