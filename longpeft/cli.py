"""The ``longpeft`` command: train | plan | merge | export | push | convert-beacon | synth | eval | demo."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .errors import ConfigError
from .launch import LAUNCHES


def _recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML path or bundled recipe name (see `longpeft plan --list`)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.max_steps=10 (repeatable)",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from .recipes.schema import load_recipe
    from .recipes.validate import validate_recipe

    if args.launch:  # plan's checks before any process starts (each launched process runs them again)
        return launch_training(args, validate_recipe(load_recipe(args.recipe, args.overrides)).recipe)
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
    from .recipes.runner import run

    result = run(
        load_recipe(args.recipe, args.overrides), resume=args.resume, allow_recipe_change=args.allow_recipe_change
    )
    print(json.dumps({"adapter": str(result.adapter_dir), **result.metrics}, indent=2, default=str))
    if deepspeed_on_cpu():
        exit_without_teardown()
    return 0


def deepspeed_on_cpu() -> bool:
    """Whether this process trains under DeepSpeed on CPU processes (gloo), as the tests do."""
    import torch

    return (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        and torch.distributed.is_initialized()
        and not torch.cuda.is_available()
    )


def exit_without_teardown() -> None:
    """End a finished DeepSpeed CPU run with status 0, skipping the interpreter's teardown: there DeepSpeed 0.19.8's
    CPU processes abort about 1 run in 10 ("terminate called without an active exception", SIGABRT) after the run
    has saved everything, which failed the launch. Every process waits for the others first."""
    import torch

    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_training(args: argparse.Namespace, recipe) -> int:
    """``train --launch KIND --gpus G [--nodes N --node-rank R --main-address HOST:PORT]``: check the combination at
    N x G processes, then run (or print) ``accelerate launch``, or print a SLURM script that runs it on every node."""
    import shlex
    import subprocess

    from .launch import launch_command
    from .launch.nodes import DEFAULT_MAIN_PORT, Nodes, parse_main_address, slurm_script

    if args.print_slurm and args.print_command:
        raise ConfigError("--print-slurm and --print-command: choose one (the script holds the command)")
    devices = torch_cuda_devices()
    gpus = args.gpus if args.gpus is not None else devices
    if args.print_slurm and args.gpus is None:
        raise ConfigError("--print-slurm: give --gpus G, the GPUs of each node (the script asks SLURM for them)")
    if gpus < 1:
        raise ConfigError(f"--launch {args.launch}: give --gpus N >= 1 (this machine shows {devices} CUDA devices)")
    count = args.nodes or 1
    if args.print_slurm:
        for flag, given in (("--node-rank", args.node_rank is not None), ("--main-address", args.main_address)):
            if given:
                raise ConfigError(
                    f"--print-slurm with {flag}: the script takes each node's rank from "
                    "$SLURM_NODEID and the main address from the first host of the allocation "
                    "(MAIN_PORT=PORT sbatch ... changes the port)"
                )
        nodes = Nodes(count, host="MAIN_HOST")  # the script replaces the address and the rank
    else:
        host, port = parse_main_address(args.main_address) if args.main_address else (None, DEFAULT_MAIN_PORT)
        nodes = Nodes(count, args.node_rank or 0, host, port)
    check_processes(recipe, args.launch, gpus * count)
    command = launch_command(recipe, args.recipe, args.launch, gpus, args.overrides, nodes)
    command += ["--resume"] * args.resume + ["--allow-recipe-change"] * args.allow_recipe_change
    if args.print_slurm:
        print(slurm_script(command, f"longpeft-{recipe.name}", count, gpus), end="")
        return 0
    if args.print_command:
        print(shlex.join(command))
        return 0
    return subprocess.call([accelerate_executable(), *command[1:]])


def accelerate_executable() -> str:
    """The ``accelerate`` of this Python environment (beside its interpreter, so an environment that is not on PATH
    works), else the one on PATH; a ConfigError when neither exists."""
    import shutil
    from pathlib import Path

    beside = Path(sys.executable).with_name("accelerate")
    found = str(beside) if beside.is_file() else shutil.which("accelerate")
    if found is None:
        raise ConfigError(
            f"train --launch runs `accelerate launch`, and accelerate is not installed beside "
            f"{sys.executable} nor on PATH: pip install accelerate (longpeft's requirements pin it)"
        )
    return found


def check_processes(recipe, launch: str, processes: int) -> None:
    """What ``train --launch`` refuses at ``processes`` (nodes x GPUs per node): the launch's own checks, a Ulysses
    group (every process) that cannot split the model's heads, a global batch the data-parallel ranks do not divide."""
    from .launch import check_launch, check_sequence_parallel_group
    from .launch.topology import gradient_accumulation

    check_launch(recipe, launch)
    if launch == "ulysses":
        from .scale import shape_of

        try:
            shape = shape_of(recipe.model.name_or_path)
        except ConfigError:  # not on this machine: DeepSpeed checks the heads when the model is built
            print(
                f"longpeft train: {recipe.model.name_or_path}'s config.json is not on this machine; Ulysses' group "
                f"of {processes} processes is checked against its heads when training starts",
                file=sys.stderr,
            )
        else:
            check_sequence_parallel_group(processes, shape.heads, shape.kv_heads)
    gradient_accumulation(recipe, 1 if launch == "ulysses" else processes)  # a Ulysses group trains one sample


def _number(kind: type, low: float, high: float | None = None, inclusive: bool = True):
    """An argparse type: a ``kind`` number >= ``low`` (> with ``inclusive=False``) and <= ``high``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < low or (value == low and not inclusive) or (high is not None and value > high):
            bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {bound}")
        return value

    return parse


def torch_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def cmd_plan(args: argparse.Namespace) -> int:
    from .recipes.schema import bundled_recipes, load_recipe

    if args.list:
        print("\n".join(bundled_recipes()))
        return 0
    if not args.recipe:
        raise ConfigError("longpeft plan: give a recipe (or --list)")
    from .recipes.validate import validate_recipe, with_stand_in

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
        from .recipes.plan_data import count_sample_lengths
        from .scale import estimate
        from .scale.network import DEFAULT_INTER_NODE_GBPS, add_inter_node

        if args.longest:
            from .recipes.longest import longest_sample

            longest = longest_sample(
                recipe, gpus=args.gpus * args.nodes, gpu_memory_gib=args.gpu_memory, gpu=args.gpu, launch=args.launch
            )
            print("\n".join([*longest.lines(), f"the plan at {max(longest.tokens, longest.step):,} tokens:"]))
            table = longest.plan.table().splitlines()
            print("\n".join(line for line in table if not line.startswith(("time:", "lever:"))))
            return 0
        plan = estimate(
            recipe,
            gpus=args.gpus * args.nodes,
            gpu_memory_gib=args.gpu_memory,
            gpu=args.gpu,
            mfu=args.mfu,
            samples=args.samples,
            launch=args.launch,
            sample_lengths=count_sample_lengths(recipe),
        )
        if args.nodes > 1:
            add_inter_node(plan, recipe, args.nodes, args.inter_node_gbps or DEFAULT_INTER_NODE_GBPS)
        print(plan.table())
        return 0
    # where train writes: output_dir with {name} filled in, as an absolute path
    output_dir = str(recipe.resolved_output_dir().resolve())
    if not args.build:
        print(json.dumps({"recipe": {**recipe.model_dump(), "output_dir": output_dir}}, indent=2, default=str))
        return 0
    from .recipes.runner import prepare

    prepared = prepare(recipe, validation=validation)
    shown = {**prepared.resolved, "recipe": {**prepared.resolved["recipe"], "output_dir": output_dir}}
    print(json.dumps(shown, indent=2, default=str))
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from .hub import export, merge

    action = export if args.command == "export" else merge
    result = action(
        args.adapter,
        args.out,
        base=args.base,
        dtype=args.dtype,
        verify=not args.no_verify,
        without=tuple(args.without),
        base_id=args.base_id,
    )
    print(json.dumps(result, indent=2))
    if result.get("max_abs_logit_diff") is not None:
        print(
            f"merged model vs base + adapter on a fixed 32-token probe: max |logit diff| = "
            f"{result['max_abs_logit_diff']:.3g} ({args.dtype} merged model against the adapter run in {args.dtype}; "
            "bfloat16 rounding alone gives differences of order 0.1-1, float32 of order 1e-5)"
        )
    from .hub import serving_note

    print(serving_note(result["out_dir"]))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .hub import push

    print(
        push(
            args.source,
            args.repo,
            merged=args.merged,
            dtype=args.dtype,
            private=args.private,
            dry_run=args.dry_run,
            base_id=args.base_id,
            base=args.base,
        )
    )
    return 0


def cmd_convert_beacon(args: argparse.Namespace) -> int:
    from .convert import convert_authors_beacon

    print(json.dumps(convert_authors_beacon(args.source, args.out, base=args.base), indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.out, max_steps=args.max_steps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longpeft", description="Parameter-efficient context extension.")
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error (or set LONGPEFT_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a recipe (QLoRA + RoPE-base expansion, HARPE, ...)")
    _recipe_arguments(train)
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
    nodes.add_argument("--nodes", type=_number(int, 1), help="number of nodes (default 1); --gpus is per node")
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

    plan = sub.add_parser("plan", help="validate a recipe and print every resolved setting")
    plan.add_argument("recipe", nargs="?", help="recipe YAML path or bundled recipe name")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
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
    scale.add_argument(
        "--gpus", type=_number(int, 1), help="estimate per-GPU peak memory by term and wall time on this many GPUs"
    )
    scale.add_argument(
        "--launch",
        choices=LAUNCHES,
        help="how the GPUs share the work, as train --launch "
        "(default ddp: a whole replica per GPU; fsdp2, zero3, ulysses shard it)",
    )
    scale.add_argument(
        "--gpu-memory",
        type=_number(float, 0, inclusive=False),
        default=80.0,
        metavar="GIB",
        help="memory of one GPU (default 80)",
    )
    scale.add_argument("--gpu", default="h100", help="GPU kind for the peak FLOP/s: h100, h200, a100, a800, l40s")
    scale.add_argument(
        "--mfu",
        type=_number(float, 0, 1, inclusive=False),
        help="one FLOPs utilisation, in (0, 1], "
        "for the matmuls and attention alike (default: measured on h100/h200, by attention kernel; "
        "other GPUs 0.35 for 4-bit bases, 0.45 otherwise)",
    )
    scale.add_argument(
        "--nodes",
        type=_number(int, 1),
        default=1,
        help="nodes of --gpus GPUs each (default 1): the "
        "estimate runs on nodes x GPUs, and adds the gradient traffic between nodes",
    )
    scale.add_argument(
        "--inter-node-gbps",
        type=_number(float, 0, inclusive=False),
        metavar="GBPS",
        help="with --nodes N > 1: network bandwidth each GPU has to other nodes, in Gb/s (default 400: "
        "one NDR InfiniBand port per GPU)",
    )
    scale.add_argument(
        "--samples",
        type=_number(int, 1),
        help="rows of the training data (default: the rows of a "
        "local data.source after the recipe's length filters, the demo set's size, else 1000); their "
        "lengths follow the local data's, else data.max_length each; train.max_steps, when set, "
        "decides instead",
    )
    scale.add_argument(
        "--longest",
        action="store_true",
        help="print the longest sample (tokens) whose step fits in "
        "--gpu-memory with the recipe's settings, and the memory terms at that length",
    )
    plan.set_defaults(func=cmd_plan)

    for name, default_dtype, text in (
        ("merge", "float32", "merge an adapter into its base (plain from_pretrained loads the result)"),
        ("export", "bfloat16", "merge, cast and write a shareable safetensors folder with its model card"),
    ):
        command = sub.add_parser(name, help=text)
        command.add_argument("adapter", help="adapter folder (with longpeft.json) or Hub id")
        command.add_argument("--out", required=True, help="output folder")
        command.add_argument("--base", help="base model (default: the one named in longpeft.json)")
        command.add_argument("--dtype", default=default_dtype, choices=["float32", "bfloat16", "float16"])
        command.add_argument("--no-verify", action="store_true", help="skip the logits check against base + adapter")
        command.add_argument(
            "--without",
            action="append",
            default=[],
            metavar="METHOD",
            help="leave out an inference-time method (string), so the merged model loads without its "
            "modeling file (trust_remote_code); repeatable",
        )
        command.add_argument(
            "--base-id",
            help="the base model's Hub id (owner/name), recorded in longpeft.json and "
            "the card when the adapter names its base by a local path (the card leaves a path out)",
        )
        command.set_defaults(func=cmd_merge)

    push = sub.add_parser(
        "push", help="share an adapter (or the merged model), or a fully fine-tuned model, on the Hugging Face Hub"
    )
    push.add_argument(
        "source",
        help="adapter folder, model folder of a finetune: full run, or run folder (containing adapter/ or model/)",
    )
    push.add_argument("--repo", required=True, help="Hub repo id, owner/name")
    push.add_argument(
        "--merged",
        action="store_true",
        help="upload the merged model instead of the adapter (a whole "
        "model, merged or fully fine-tuned, is uploaded as it is either way)",
    )
    push.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of an uploaded model (--merged, or a fully fine-tuned one; default bfloat16); an "
        "adapter is uploaded as saved",
    )
    push.add_argument(
        "--private",
        action="store_true",
        help="make the repository private (an existing public one "
        "too); without it a new repository gets the account's default visibility and an existing one "
        "keeps its own",
    )
    push.add_argument(
        "--base-id",
        help="the base model's Hub id, written into the card and longpeft.json "
        "(default: the Hub id recorded in longpeft.json; a local base is named nowhere in the upload, with a "
        "warning)",
    )
    push.add_argument(
        "--base", help="the base model to merge into with --merged (default: the one named in longpeft.json)"
    )
    push.add_argument(
        "--dry-run", metavar="DIR", help="write exactly the folder that would be uploaded, upload nothing"
    )
    push.set_defaults(func=cmd_push)

    convert = sub.add_parser(
        "convert-beacon",
        help="turn an authors' Activation Beacon model (full checkpoint + remote code) into a longpeft adapter",
        description="Reads only the beacon settings and beacon tensors of the authors' released model (no remote "
        "code runs) and writes longpeft.json + beacon_adapter.safetensors for the matching stock base; then "
        "longpeft.load(BASE, OUT) gives the stock base with those beacons.",
    )
    convert.add_argument(
        "source", help="the authors' model: local folder or Hub id (e.g. namespace-Pt/beacon-qwen-2-7b-instruct)"
    )
    convert.add_argument("--base", required=True, help="the stock model it was built on (e.g. Qwen/Qwen2-7B-Instruct)")
    convert.add_argument("--out", required=True, help="new adapter folder")
    convert.set_defaults(func=cmd_convert_beacon)

    from .eval.cli import register as register_eval
    from .synth_data.cli import add_synth_arguments, cmd_synth

    synth = sub.add_parser("synth", help="build synthetic long-context training data (LLM or offline procedural)")
    add_synth_arguments(synth)
    synth.set_defaults(func=cmd_synth)
    register_eval(sub)

    demo = sub.add_parser("demo", help="the whole path on a tiny model on CPU: data, train, eval, merge, card")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument("--max-steps", type=int, default=None, help="cap the training steps (quick checks)")
    demo.set_defaults(func=cmd_demo)
    return parser


def error_message(exc: BaseException) -> str | None:
    """The one line the command line prints for an expected error, or None for a bug (which keeps its traceback).

    Expected: longpeft's own :class:`~longpeft.errors.LongpeftError` (bad input, named); a full disk or a refused
    write from any library (``OSError``, safetensors' ``SafetensorError``, ``torch.save``'s ``RuntimeError``); and
    what the libraries underneath raise for bad files or a failing environment: a corrupt safetensors file, a file
    ``torch.load`` refuses (a pickle payload), a Hub or network failure (huggingface_hub, httpx), settings refused by
    pydantic, text that is not YAML, JSON or UTF-8, any other ``OSError``, a package not installed. A ``KeyError``,
    ``TypeError`` or ``AttributeError`` is a bug, except when raised inside a Hub or HTTP client reading a server's
    answer (a wrong-shape answer); any other exception (a bare ``ValueError``, ...) is a bug too.
    """
    import pickle

    import pydantic
    import yaml
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from safetensors import SafetensorError

    from .errors import HubTimeoutError, LongpeftError
    from .files import HUB_CLIENT_PACKAGES, raised_in, write_failure
    from .reading import REFUSED_FOR_SAFETY

    text = " ".join(str(exc).split())
    detail = f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
    if isinstance(exc, LongpeftError):  # longpeft's own messages are written to be read as they are
        return str(exc).strip() or type(exc).__name__
    silent_hub = _cause_of_kind(exc, HubTimeoutError)  # a library turned a silent Hub into its own error
    if silent_hub is not None:
        return str(silent_hub)
    if isinstance(exc, (KeyError, TypeError, AttributeError)):
        if raised_in(exc, HUB_CLIENT_PACKAGES):
            what = f"KeyError {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else detail
            return (
                f"a server gave an answer of an unexpected shape ({what}); check HF_ENDPOINT (a Hub mirror or "
                "proxy?), or give a local folder"
            )
        return None
    problem = write_failure(exc)
    if problem is not None:
        return f"a write failed: {problem} ({detail}); free space or choose a writable folder, and run again"
    if isinstance(exc, SafetensorError):
        return f"a safetensors file could not be read ({detail}); re-create or download it again"
    if isinstance(exc, pickle.UnpicklingError):
        return f"torch.load: {REFUSED_FOR_SAFETY} ({detail}); use .safetensors files or files longpeft wrote"
    if isinstance(exc, pydantic.ValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()[:5])
        return f"invalid settings ({exc.title}): {problems}"
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        where = f" at {mark.name}:{mark.line + 1}" if mark is not None else ""
        return f"not valid YAML{where} ({getattr(exc, 'problem', None) or text})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
    if isinstance(exc, HFValidationError):
        return f"not a local folder nor a Hub repo id ({text}); give an existing folder or a Hub id owner/name"
    if isinstance(exc, HfHubHTTPError) or _is_network_error(exc):
        return (
            f"the Hugging Face Hub or the network failed ({detail}); check the network, HF_ENDPOINT and the "
            "repo id, or give a local folder"
        )
    if isinstance(exc, (OSError, ImportError, UnicodeDecodeError)):
        return text or type(exc).__name__
    return None


def _cause_of_kind(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first error of ``kind`` among the errors ``exc`` was raised from or while handling, else None."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _is_network_error(exc: BaseException) -> bool:
    """An HTTP client's error: httpx's or httpx2's (not ``OSError`` subclasses) or requests' (whichever
    huggingface_hub uses)."""
    import importlib

    kinds: list[type[BaseException]] = []
    for name in ("httpx", "httpx2"):  # huggingface_hub 1 uses httpx, 2 httpx2
        try:
            library = importlib.import_module(name)
        except ImportError:
            continue
        kinds += [library.HTTPError, library.InvalidURL]
    try:
        import requests

        kinds.append(requests.RequestException)
    except ImportError:
        pass
    return isinstance(exc, tuple(kinds))


UNEXPECTED_EXIT = 1  # an error nobody anticipated (a bug), after its traceback; bad input exits 2


def main(argv: list[str] | None = None) -> int:
    """Run one ``longpeft`` command; returns its exit status.

    The one error boundary of every command: an expected error (:func:`error_message`) prints
    ``longpeft COMMAND: error: MESSAGE`` on one line and returns 2, an interrupt returns 130; any other exception
    (a bug) prints its traceback, then one line saying so and how to report it, and returns 1. ``--debug`` (or
    ``LONGPEFT_DEBUG=1``) lets every error propagate with its traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"longpeft {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug or os.environ.get("LONGPEFT_DEBUG"):
            raise
        message = error_message(exc)
        if message is None:
            import traceback

            traceback.print_exc()
            print(
                f"longpeft {args.command}: unexpected error ({type(exc).__name__}), a bug in longpeft or a library it "
                "calls rather than a problem with your input: run with --debug and report the traceback",
                file=sys.stderr,
            )
            return UNEXPECTED_EXIT
        print(f"longpeft {args.command}: error: {message}\n(run with --debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
