"""``longpeft plan RECIPE``: validate a recipe as train does and print every resolved setting; ``--build`` builds the
trainer, ``--gpus G`` prints the memory and time estimate (:mod:`longpeft.scale`), ``--list`` the bundled recipes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ConfigError
from ..launch.kinds import LAUNCHES
from ..recipes.schema import bundled_recipes, load_recipe
from ..recipes.validate import validate_recipe, with_stand_in
from .arguments import add_recipe_arguments, number


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    plan = subparsers.add_parser("plan", help="validate a recipe and print every resolved setting")
    add_recipe_arguments(plan, optional=True)
    plan.add_argument("--list", action="store_true", help="list the bundled recipes")
    plan.add_argument("--build", action="store_true", help="also load the model and data and build the trainer")
    plan.add_argument(
        "--stand-in",
        metavar="ARCH",
        help="replace the model with a tiny random one of this architecture (e.g. llama) and the data with the "
        "offline demo set: builds the trainer with every other setting, no download",
    )
    plan.add_argument("--output-dir", help="override the recipe's output_dir (where --build writes the tiny base)")
    scale = plan.add_argument_group("memory and time estimate (no download; see longpeft/scale/plan.py)")
    positive = number(float, 0, inclusive=False)
    scale.add_argument(
        "--gpus", type=number(int, 1), help="estimate per-GPU peak memory by term and wall time on this many GPUs"
    )
    scale.add_argument(
        "--launch",
        choices=LAUNCHES,
        help="how the GPUs share the work, as train --launch "
        "(default ddp: a whole replica per GPU; fsdp2, zero3, ulysses shard it)",
    )
    scale.add_argument(
        "--gpu-memory", type=positive, default=80.0, metavar="GIB", help="memory of one GPU (default 80)"
    )
    scale.add_argument("--gpu", default="h100", help="GPU kind for the peak FLOP/s: h100, h200, a100, a800, l40s")
    scale.add_argument(
        "--mfu",
        type=number(float, 0, 1, inclusive=False),
        help="one FLOPs utilisation, in (0, 1], for the matmuls and attention alike (default: measured on "
        "h100/h200, by attention kernel; other GPUs 0.35 for 4-bit bases, 0.45 otherwise)",
    )
    scale.add_argument(
        "--nodes",
        type=number(int, 1),
        default=1,
        help="nodes of --gpus GPUs each (default 1): the "
        "estimate runs on nodes x GPUs, and adds the gradient traffic between nodes",
    )
    scale.add_argument(
        "--inter-node-gbps",
        type=positive,
        metavar="GBPS",
        help="with --nodes N > 1: network bandwidth each GPU has to other nodes, in Gb/s (default 400: "
        "one NDR InfiniBand port per GPU)",
    )
    scale.add_argument(
        "--samples",
        type=number(int, 1),
        help="rows of the training data (default: the rows of a local data.source after the recipe's length "
        "filters, the demo set's size, else 1000); their lengths follow the local data's, else data.max_length "
        "each; train.max_steps, when set, decides instead",
    )
    scale.add_argument(
        "--longest",
        action="store_true",
        help="print the longest sample (tokens) whose step fits in "
        "--gpu-memory with the recipe's settings, and the memory terms at that length",
    )
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(bundled_recipes()))
        return 0
    if not args.recipe:
        raise ConfigError("longpeft plan: give a recipe (or --list)")
    overrides = with_stand_in(args.overrides, args.stand_in) if args.stand_in else list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    recipe = load_recipe(args.recipe, overrides)
    validation = validate_recipe(recipe, stand_in=bool(args.stand_in))  # train's checks, before any weight loads
    print(f"longpeft plan: {validation.summary()}", file=sys.stderr)
    if args.launch and args.gpus is None:
        raise ConfigError(f"longpeft plan --launch {args.launch}: give --gpus N (the estimate is per GPU)")
    if args.nodes > 1 and args.gpus is None:
        raise ConfigError(f"longpeft plan --nodes {args.nodes}: give --gpus G, the GPUs of each node")
    if args.inter_node_gbps is not None and args.nodes == 1:
        raise ConfigError(
            "longpeft plan --inter-node-gbps goes with --nodes N > 1 (one node's GPUs talk over its own "
            "links, which the plan does not model)"
        )
    if args.gpus is not None:
        _print_estimate(args, recipe, validation.base)
        return 0
    if not args.build:
        # where train writes: output_dir with {name} filled in, as an absolute path (as recipe.resolved.json says)
        output_dir = str(recipe.resolved_output_dir().resolve())
        print(json.dumps({"recipe": {**recipe.model_dump(), "output_dir": output_dir}}, indent=2, default=str))
        return 0
    from ..recipes.runner import prepare  # builds the model and the trainer: torch

    print(json.dumps(prepare(recipe, validation=validation).resolved, indent=2, default=str))
    return 0


def _print_estimate(args: argparse.Namespace, recipe: Any, base: Any) -> None:
    """``plan --gpus``: the memory and time estimate's table on nodes x GPUs, or ``--longest``'s sample; the model's
    shape from ``base``, the config validation read, when it could."""
    # the planner, the data's lengths and the longest sample's search import torch: plan without --gpus does not
    from ..recipes.plan_data import count_sample_lengths
    from ..scale import estimate, shape_from_config
    from ..scale.network import DEFAULT_INTER_NODE_GBPS, add_inter_node

    machine = dict(gpus=args.gpus * args.nodes, gpu_memory_gib=args.gpu_memory, gpu=args.gpu, launch=args.launch)
    if args.longest:
        from ..recipes.plan_data import longest_trainable_sample

        longest = longest_trainable_sample(recipe, **machine)
        print("\n".join([*longest.lines(), f"the plan at {max(longest.tokens, longest.step):,} tokens:"]))
        table = longest.plan.table().splitlines()
        print("\n".join(line for line in table if not line.startswith(("time:", "lever:"))))
        return
    shape = None if base is None else shape_from_config(base.config.to_dict())
    lengths = count_sample_lengths(recipe)
    plan = estimate(recipe, **machine, mfu=args.mfu, samples=args.samples, shape=shape, sample_lengths=lengths)
    if args.nodes > 1:
        add_inter_node(plan, recipe, args.nodes, args.inter_node_gbps or DEFAULT_INTER_NODE_GBPS)
    print(plan.table())
