"""Starting ``longpeft train --launch KIND``: the checks at the launch's number of processes (nodes x GPUs), then
``accelerate launch`` run here, its command printed, or a SLURM script printed that runs it on every node."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import check_launch, check_sequence_parallel_group, launch_command
from .nodes import DEFAULT_MAIN_PORT, Nodes, parse_main_address, slurm_script
from .topology import gradient_accumulation


def launch_training(
    recipe: Any,
    recipe_name: str,
    launch: str,
    model_shape: Callable[[str], Any],
    gpus: int | None = None,
    overrides: Sequence[str] = (),
    train_flags: Sequence[str] = (),
    nodes: int | None = None,
    node_rank: int | None = None,
    main_address: str | None = None,
    print_command: bool = False,
    print_slurm: bool = False,
) -> int:
    """``train --launch KIND --gpus G [--nodes N --node-rank R --main-address HOST:PORT]`` of a validated ``recipe``
    (``recipe_name`` as given, ``overrides`` its ``--set`` values, ``train_flags`` what each process's ``longpeft
    train`` adds): check the combination at N x G processes (``model_shape``: name_or_path -> the model's heads,
    :func:`check_processes`), then run ``accelerate launch`` and return its exit status, or print its command or a
    SLURM script that runs it on every node and return 0. ``gpus`` None: every CUDA device of this machine."""
    if print_slurm and print_command:
        raise ConfigError("--print-slurm and --print-command: choose one (the script holds the command)")
    devices = cuda_devices()
    if print_slurm and gpus is None:
        raise ConfigError("--print-slurm: give --gpus G, the GPUs of each node (the script asks SLURM for them)")
    gpus = gpus if gpus is not None else devices
    if gpus < 1:
        raise ConfigError(f"--launch {launch}: give --gpus N >= 1 (this machine shows {devices} CUDA devices)")
    count = nodes or 1
    if print_slurm:
        for flag, given in (("--node-rank", node_rank is not None), ("--main-address", main_address)):
            if given:
                raise ConfigError(
                    f"--print-slurm with {flag}: the script takes each node's rank from "
                    "$SLURM_NODEID and the main address from the first host of the allocation "
                    "(MAIN_PORT=PORT sbatch ... changes the port)"
                )
        place = Nodes(count, host="MAIN_HOST")  # the script replaces the address and the rank
    else:
        host, port = parse_main_address(main_address) if main_address else (None, DEFAULT_MAIN_PORT)
        place = Nodes(count, node_rank or 0, host, port)
    check_processes(recipe, launch, gpus * count, model_shape)
    command = [*launch_command(recipe, recipe_name, launch, gpus, list(overrides), place), *train_flags]
    if print_slurm:
        print(slurm_script(command, f"longpeft-{recipe.name}", count, gpus), end="")
        return 0
    if print_command:
        print(shlex.join(command))
        return 0
    return subprocess.call([accelerate_executable(), *command[1:]])


def cuda_devices() -> int:
    """The CUDA devices this machine shows (torch imported here: the command line imports this module)."""
    import torch

    return torch.cuda.device_count()


def accelerate_executable() -> str:
    """The ``accelerate`` of this Python environment (beside its interpreter, so an environment that is not on PATH
    works), else the one on PATH; a ConfigError when neither exists."""
    beside = Path(sys.executable).with_name("accelerate")
    found = str(beside) if beside.is_file() else shutil.which("accelerate")
    if found is None:
        raise ConfigError(
            f"train --launch runs `accelerate launch`, and accelerate is not installed beside "
            f"{sys.executable} nor on PATH: pip install accelerate (longpeft's requirements pin it)"
        )
    return found


def check_processes(recipe: Any, launch: str, processes: int, model_shape: Callable[[str], Any]) -> None:
    """What ``train --launch`` refuses at ``processes`` (nodes x GPUs per node): the launch's own checks, a Ulysses
    group (every process) that cannot split the model's heads, a global batch the data-parallel ranks do not divide.
    ``model_shape(name_or_path)`` gives the model's ``heads`` and ``kv_heads``, or raises ConfigError when its
    config.json is not on this machine (:func:`longpeft.scale.shape_of`)."""
    check_launch(recipe, launch)
    if launch == "ulysses":
        try:
            shape = model_shape(recipe.model.name_or_path)
        except ConfigError:  # not on this machine: DeepSpeed checks the heads when the model is built
            print(
                f"longpeft train: {recipe.model.name_or_path}'s config.json is not on this machine; Ulysses' group "
                f"of {processes} processes is checked against its heads when training starts",
                file=sys.stderr,
            )
        else:
            check_sequence_parallel_group(processes, shape.heads, shape.kv_heads)
    gradient_accumulation(recipe, 1 if launch == "ulysses" else processes)  # a Ulysses group trains one sample
