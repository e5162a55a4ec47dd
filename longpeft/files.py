"""File-safety rules every command follows, torch-free: where a model comes from, where results may go, and how
they are written.

- A model source is a local folder that must exist, or a Hub repo id that must answer (with a bounded wait) before
  anything long starts (:func:`check_model_source`); a local path is never retried as a Hub id.
- An output folder must be new or empty, writable, and none of the inputs (:func:`check_output_folder`); results
  are written beside it and renamed into place (:func:`written_atomically`), so a failure never leaves a folder
  that a rerun would take for complete.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import ModelSourceError, OutputFolderError


def is_local(name: str | Path) -> bool:
    """Whether ``name`` is meant as a local path (it exists, or does not look like ``owner/name``)."""
    text = str(name)
    return Path(text).exists() or text.count("/") != 1 or text.startswith((".", "/", "~"))


def is_whole_model(folder: Path) -> bool:
    """Whether a longpeft folder holds a whole fine-tuned model (``finetune: full`` wrote config.json and the
    weights) rather than an adapter."""
    return (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file()


def hub_preflight(repo_id: str, what: str, timeout: float | None = None) -> None:
    """Ask the Hub about ``repo_id`` once, with a bounded wait, before anything long starts.

    An endpoint that accepts connections but never answers would otherwise block forever. Skipped
    with ``HF_HUB_OFFLINE=1`` (the local cache is used then). ``timeout`` defaults to
    ``LONGPEFT_HUB_TIMEOUT`` seconds (30).

    Raises:
        TimeoutError: no answer within ``timeout`` seconds (the message names the endpoint).
        ModelSourceError: the Hub answered that there is no such repository (or it is private).
        OSError: the Hub answered with another failure.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return
    import os
    import threading

    timeout = timeout or float(os.environ.get("LONGPEFT_HUB_TIMEOUT", "30"))

    from huggingface_hub import HfApi

    outcome: dict[str, BaseException | None] = {}

    def ask() -> None:
        try:
            HfApi().model_info(repo_id, timeout=timeout)
            outcome["error"] = None
        except BaseException as error:  # reported in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=ask, daemon=True)  # a hung socket cannot keep the process alive
    thread.start()
    thread.join(timeout + 1)
    endpoint = constants.ENDPOINT
    if "error" not in outcome:
        raise TimeoutError(
            f"{what} {repo_id}: the Hub at {endpoint} did not answer within {timeout:.0f} s; check HF_ENDPOINT and "
            "the network, or give a local folder"
        )
    error = outcome["error"]
    if error is None:
        return
    name = type(error).__name__
    if "NotFound" in name or "Gated" in name or "Unauthorized" in name:
        raise ModelSourceError(f"{what} {repo_id}: not on the Hub at {endpoint} (or private: log in first)") from None
    raise OSError(f"{what} {repo_id}: the Hub at {endpoint} failed ({name}: "
                  f"{str(error).splitlines()[0][:200]})") from None


def check_model_source(name: str | Path, what: str, hint: str = "") -> None:
    """A local model folder must exist; a Hub id must answer (bounded wait) before anything long starts.

    ``hint``: what to do instead, appended to the error for a missing folder.

    Raises:
        ModelSourceError: no such local folder, or no such Hub repo (see :func:`hub_preflight` for the others).
    """
    if is_local(name):
        if not Path(name).is_dir():
            raise ModelSourceError(f"{what} {name}: no such folder (and not a Hub repo id owner/name){hint}")
    else:
        hub_preflight(str(name), what)


def local_adapter_dir(adapter: str | Path, what: str = "adapter", hint: str = "") -> Path:
    """A local folder for an adapter given as a folder or a Hub repo id (downloaded once, cached); ``what`` and
    ``hint`` name it and say what to do in the error for a missing folder (:func:`check_model_source`)."""
    check_model_source(adapter, what, hint)
    if is_local(adapter):
        return Path(adapter)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(adapter)))


def check_writable_folder(folder: str | Path, flag: str) -> None:
    """Fail now, not after hours of work, when results could not be written to ``folder`` (named by ``flag``).

    Raises:
        OutputFolderError: ``folder`` is a file.
        PermissionError: the nearest existing folder on its path is not writable.
    """
    import os

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputFolderError(f"{flag} {folder} is a file; choose a folder")
    parent = next(p for p in (folder.resolve(), *folder.resolve().parents) if p.exists())
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{flag} {folder}: {parent} is not writable")


def check_output_folder(out_dir: Path, protected: dict[str, Path], flag: str = "--out") -> None:
    """Refuse, before any work, an output folder that would overwrite something: a file, a folder
    that is not empty, one of the ``protected`` folders (the adapter, the base), or an unwritable place.
    ``flag`` names the option that gave the folder.

    Raises:
        OutputFolderError: naming the flag, the folder and what it would overwrite.
        PermissionError: the folder could not be written.
    """
    target = out_dir.resolve()
    for what, folder in protected.items():
        if folder.exists() and target == folder.resolve():
            raise OutputFolderError(f"{flag} {out_dir} is {what}; writing there would overwrite it")
    check_writable_folder(out_dir, flag)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise OutputFolderError(f"{flag} {out_dir} is not empty; choose a new or empty folder (nothing was "
                                "overwritten)")


@contextlib.contextmanager
def written_atomically(out_dir: Path) -> Iterator[Path]:
    """A folder beside ``out_dir`` (``.NAME.partial``) to write into; its files become ``out_dir``'s only when the
    block succeeds, so a failure leaves no half-written ``out_dir``. ``out_dir`` must be new or empty
    (:func:`check_output_folder`) and absolute (``.`` has no name to write beside).
    """
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        if out_dir.is_dir():  # empty: keep the folder itself (it may be the working directory)
            for item in partial.iterdir():
                item.rename(out_dir / item.name)
        else:
            partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
