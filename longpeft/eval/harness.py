"""lm-evaluation-harness tasks (``lm-eval``, optional extra ``eval``) on an extended model: lm-eval's ``HFLM`` over
the model ``longpeft.load`` returns, with the extended length of its ``longpeft.json`` as ``max_length``
(docs/methods.md). lm-eval is imported only when a function here runs; without it the error names the extra."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..spec import ContextSpec

INSTALL_HINT = "pip install 'longpeft[eval]' (or pip install lm-eval==0.4.13)"


def import_lm_eval() -> Any:
    """The ``lm_eval`` package, or a ConfigError naming what to install."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (HFLM; fails on a partial install)
        import lm_eval.tasks  # noqa: F401
    except ImportError as error:
        what = error.name or "lm_eval"
        raise ConfigError(
            f"longpeft eval harness needs lm-evaluation-harness ({what} is not importable): {INSTALL_HINT}"
        ) from None
    return lm_eval


def recorded_spec(folder: str | Path | None) -> ContextSpec | None:
    """The ``ContextSpec`` of the ``longpeft.json`` in a local adapter or merged-model folder, or None."""
    from ..spec import SPEC_FILENAME, ContextSpec

    return ContextSpec.load(folder) if folder is not None and (Path(folder) / SPEC_FILENAME).is_file() else None


def extended_length(model_or_adapter: str | Path | None) -> int | None:
    """The context length recorded in ``longpeft.json`` of a local adapter or merged-model folder: the adapted model's
    ``max_position_embeddings``, or its ``target_length`` when longer (Activation Beacon and STRING read past their
    positions); None when the folder has no ``longpeft.json`` (a plain model)."""
    spec = recorded_spec(model_or_adapter)
    return None if spec is None else max(spec.max_position_embeddings, spec.target_length or 0)


def without_model_object_notice(record: logging.LogRecord) -> bool:
    """A logging filter: drops the notice lm-eval's HFLM logs whenever it is given a built model rather than a name
    (advice for lm-eval's own launcher, accelerate or parallelize=True, which a model handed over here never goes
    through), lets every other record through."""
    return not str(record.msg).startswith("`pretrained` model kwarg is not of type `str`")


def harness_lm(model: Any, tokenizer: Any, max_length: int | None = None, batch_size: int = 1) -> Any:
    """lm-eval's ``HFLM`` over an already built ``model`` (e.g. ``longpeft.load(...)``) and its ``tokenizer``, without
    the notice HFLM logs for every built model. ``max_length``: tokens a request may hold (longer contexts are cut from
    the left; give :func:`extended_length`); None: the model config's ``max_position_embeddings``."""
    import_lm_eval()
    from lm_eval.models import huggingface

    huggingface.eval_logger.addFilter(without_model_object_notice)
    try:
        return huggingface.HFLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=batch_size)
    finally:
        huggingface.eval_logger.removeFilter(without_model_object_notice)


def task_manager(tasks: Sequence[str], include_path: str | Path | None, metadata: dict[str, Any] | None) -> Any:
    """lm-eval's ``TaskManager``: over ``include_path`` alone when it defines all ``tasks`` (indexing lm-eval's own
    ~15,000 task files takes 10-30 s), else over lm-eval's tasks and ``include_path``."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        own = TaskManager(include_path=str(include_path), include_defaults=False, metadata=metadata)
        if all(task in own.all_tasks for task in tasks):
            return own
    return TaskManager(include_path=str(include_path) if include_path else None, metadata=metadata)


def run_harness(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    max_length: int | None = None,
    include_path: str | Path | None = None,
    limit: int | float | None = None,
    batch_size: int = 1,
    num_fewshot: int | None = None,
    chat: bool = False,
    metadata: dict[str, Any] | None = None,
    log_samples: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` (task, group or tag names, e.g. ``["ruler"]``, or of tasks in the YAML files under
    ``include_path``, searched besides lm-eval's) on ``model`` with :func:`harness_lm`; returns lm-eval's result dict
    (``results``, ``groups``, ``configs``, ...; ``samples`` with each request and the model's answers when
    ``log_samples``). ``limit``: documents per task (a float < 1: that fraction); ``num_fewshot``: None for each
    task's; ``chat``: lm-eval's ``apply_chat_template``; ``metadata``: passed to the tasks (RULER reads
    ``max_seq_lengths`` and ``tokenizer``); ``seed``: lm-eval's Python, NumPy, torch and few-shot seeds. Raises
    ConfigError when lm-eval is missing, ``tasks`` is empty or unknown to lm-eval, or ``batch_size > 1`` on a model
    with a method on that reads a padded request differently from the request alone (Activation Beacon)."""
    from ..adapters import applied_methods

    methods = applied_methods(model) if batch_size > 1 else []  # lm-eval pads a batch's requests to one length
    why = [method.padded_batches for method in methods if method.padded_batches]
    if why:
        raise ConfigError(
            f"--batch-size {batch_size}: lm-eval pads the requests of a batch to one length, and {why[0]}; use "
            "--batch-size 1"
        )
    lm_eval = import_lm_eval()
    if not tasks:
        raise ConfigError("--tasks: give at least one lm-eval task or group, e.g. --tasks ruler")
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: no such folder (it should hold task YAML files)")
    manager = task_manager(tasks, include_path, metadata)
    unknown = [task for task in tasks if task not in manager.all_tasks and not Path(task).is_file()]
    if unknown:
        where = f" nor under --include-path {include_path}" if include_path else ""
        raise ConfigError(
            f"--tasks {', '.join(unknown)}: not a task, group or tag of lm-eval{where} (list them with "
            "`lm-eval ls tasks`)"
        )
    results = lm_eval.simple_evaluate(
        model=harness_lm(model, tokenizer, max_length=max_length, batch_size=batch_size),
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=chat,
        log_samples=log_samples,
        bootstrap_iters=0,
        **dict.fromkeys(("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seed),
    )
    results["longpeft"] = {"max_length": max_length, "tasks": list(tasks), "limit": limit}
    return results
