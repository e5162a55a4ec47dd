"""What starting ``longpeft train --launch KIND`` needs: the checks at the launch's number of processes (nodes x
GPUs), and the ``accelerate`` executable to run."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import check_launch, check_sequence_parallel_group
from .topology import gradient_accumulation


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
