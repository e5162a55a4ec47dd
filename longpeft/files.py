"""File-safety rules every command follows, torch-free: where a model comes from, where results may go, and how
they are written.

- A model source is a local folder that must exist, or a Hub repo id that must answer (with a bounded wait) before
  anything long starts (:func:`check_model_source`); a local path is never retried as a Hub id. From that check on,
  every Hub download of the process is bounded as well: a Hub that sends nothing for ``LONGPEFT_HUB_TIMEOUT`` seconds
  ends it in one :class:`~longpeft.errors.HubTimeoutError` (:mod:`longpeft.hub_wait`).
- An output folder must be new or empty, writable, and none of the inputs (:func:`check_output_folder`); results
  are written beside it and renamed into place (:func:`written_atomically`, :func:`write_text_atomically`), so a
  failure never leaves a folder that a rerun would take for complete.
- A write that fails for want of space or permission, whichever library wrote (``OSError``, safetensors'
  ``SafetensorError``, ``torch.save``'s ``RuntimeError``), ends in one :class:`OutputWriteError` naming the folder
  and the bytes needed where known (:func:`writing_to`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from .errors import HubTimeoutError, LongpeftError, ModelSourceError, OutputFolderError, OutputWriteError
from .hub_wait import HUB_TIMEOUT_VARIABLE, ask_again, bound_hub_requests, hub_timeout


def is_local(name: str | Path) -> bool:
    """Whether ``name`` is meant as a local path: it exists, starts like a path (``.``, ``/``, ``~``), does not look
    like ``owner/name``, or its first folder exists here (``runs/missing``: a path that is partly there)."""
    text = str(name)
    if Path(text).exists() or text.count("/") != 1 or text.startswith((".", "/", "~")) or "\\" in text:
        return True
    return Path(text.split("/")[0]).is_dir()


def require_file(folder: str | Path, name: str, what: str, hint: str = "") -> Path:
    """``folder / name``, which must be a file: a local folder lacking it is named as such, never retried as a Hub
    id. ``what`` names the folder (``adapter``), ``hint`` says what to do (appended).

    Raises:
        ModelSourceError: ``name`` is missing in ``folder``.
    """
    path = Path(folder) / name
    if not path.is_file():
        todo = hint or "; the folder is incomplete: copy or download it again"
        raise ModelSourceError(f"{name} is missing in {what} {folder}{todo}")
    return path


def is_whole_model(folder: Path) -> bool:
    """Whether a longpeft folder holds a whole fine-tuned model (``finetune: full`` wrote config.json and the
    weights) rather than an adapter."""
    return (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file()


_NO_ANSWER = TimeoutError()


def hub_preflight(repo_id: str, what: str, timeout: float | None = None, repo_type: str = "model") -> None:
    """Ask the Hub about ``repo_id`` (a ``repo_type`` repo: model, dataset) once, with a bounded wait, before anything
    long starts; from then on every Hub download of the process is bounded too (:func:`.hub_wait.bound_hub_requests`).

    An endpoint that accepts connections but never answers would otherwise block forever. Skipped
    with ``HF_HUB_OFFLINE=1`` (the local cache is used then). ``timeout`` defaults to :func:`hub_timeout`.

    Raises:
        HubTimeoutError: no answer within ``timeout`` seconds (the message names the endpoint).
        ModelSourceError: the Hub answered that there is no such repository (or it is private).
        OSError: the Hub answered with another failure.
    """
    from huggingface_hub import constants

    timeout = timeout or hub_timeout()
    if constants.HF_HUB_OFFLINE:
        return
    from huggingface_hub import HfApi

    bound_hub_requests()
    ask_again()  # a new check: an earlier silence no longer stops requests
    outcome: dict[str, BaseException | None] = {}

    def ask() -> None:
        try:
            HfApi().repo_info(repo_id, repo_type=repo_type, timeout=timeout)
            outcome["error"] = None
        except BaseException as error:  # reported in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=ask, daemon=True)  # a hung socket cannot keep the process alive
    thread.start()
    thread.join(timeout + 1)
    endpoint = constants.ENDPOINT
    error = outcome.get("error", _NO_ANSWER)
    if error is _NO_ANSWER or isinstance(error, HubTimeoutError):
        raise HubTimeoutError(
            f"{what} {repo_id}: the Hub at {endpoint} did not answer within {timeout:g} s; check HF_ENDPOINT and "
            f"the network ({HUB_TIMEOUT_VARIABLE} sets the wait), or give a local folder"
        )
    if error is None:
        return
    name = type(error).__name__
    if "NotFound" in name or "Gated" in name or "Unauthorized" in name:
        raise ModelSourceError(f"{what} {repo_id}: not on the Hub at {endpoint} (or private: log in first)") from None
    raise OSError(
        f"{what} {repo_id}: the Hub at {endpoint} failed ({name}: {str(error).splitlines()[0][:200]})"
    ) from None


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
    ``hint`` name it and say what to do in the error for a missing folder (:func:`check_model_source`).

    Raises:
        ModelSourceError: a Hub repo whose answer lists no file, or that the Hub client cannot read
            (:func:`asking_the_hub`), naming the repo.
    """
    check_model_source(adapter, what, hint)
    if is_local(adapter):
        return Path(adapter)
    from huggingface_hub import constants, snapshot_download

    with asking_the_hub(str(adapter), what):
        folder = Path(snapshot_download(str(adapter)))
    if not folder.is_dir() or not any(folder.iterdir()):
        raise ModelSourceError(
            f"{what} {adapter}: the Hub at {constants.ENDPOINT} lists no file in it (an empty repo, or a mirror that "
            "lists none); check the repo id and HF_ENDPOINT, or give a local folder"
        )
    return folder


# The libraries that ask the Hub and read its answers: an error raised inside them reading an answer is the answer's.
HUB_CLIENT_PACKAGES = ("huggingface_hub", "httpx", "httpcore", "httpx2", "httpcore2", "requests", "urllib3")


@contextlib.contextmanager
def asking_the_hub(repo: str, what: str) -> Iterator[None]:
    """Hub requests about ``repo`` (named by ``what``, e.g. ``adapter``) in the block: an answer of another shape
    than the Hub's, which the Hub client fails to read (its ``KeyError``, ``TypeError``, ``AttributeError``,
    ``ValueError`` or ``AssertionError``), ends in one :class:`ModelSourceError` naming the repo and the endpoint."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, ValueError, AssertionError) as error:
        if isinstance(error, LongpeftError) or not raised_in(error, HUB_CLIENT_PACKAGES, innermost=False):
            raise
        from huggingface_hub import constants

        detail = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        raise ModelSourceError(
            f"{what} {repo}: the Hub at {constants.ENDPOINT} answered in a shape its client cannot read ({detail}); "
            "check HF_ENDPOINT (a Hub mirror or proxy?), or give a local folder"
        ) from error


def raised_in(error: BaseException, packages: tuple[str, ...], innermost: bool = True) -> bool:
    """Whether ``error`` was raised in one of ``packages`` (installed libraries): its traceback's innermost frame,
    or with ``innermost=False`` any of its frames."""
    frames = []
    trace = error.__traceback__
    while trace is not None:
        frames.append(trace.tb_frame.f_code.co_filename)
        trace = trace.tb_next
    if innermost:
        frames = frames[-1:]
    return any(package in os.path.normpath(frame).split(os.sep) for frame in frames for package in packages)


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
        raise OutputFolderError(
            f"{flag} {out_dir} is not empty; choose a new or empty folder (nothing was overwritten)"
        )


_NO_SPACE = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
_NO_PERMISSION = ("permission denied", "os error 13", "read-only file system", "os error 30")
# torch.save's writer on a full disk: "[enforce fail at inline_container.cc:...] . unexpected pos ..." or
# "PytorchStreamWriter failed writing file ...: file write failed"
_TORCH_WRITE = ("enforce fail at inline_container", "pytorchstreamwriter failed writing", "file write failed")


def write_failure(error: BaseException) -> str | None:
    """What stopped a write, in words (``no space left on device``, ``permission denied``), when ``error`` (or an
    error it was raised from) is a full disk or a refused write from any library; None for anything else."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "errno", None) if isinstance(error, OSError) else None
        if code in (errno.ENOSPC, errno.EDQUOT):
            return "no space left on device"
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return "permission denied" if code != errno.EROFS else "read-only file system"
        if type(error).__name__ in ("SafetensorError", "RuntimeError", "OSError") or isinstance(error, OSError):
            text = str(error).lower()
            if any(s in text for s in _NO_SPACE):
                return "no space left on device"
            if any(s in text for s in _NO_PERMISSION):
                return "permission denied"
            if any(s in text for s in _TORCH_WRITE):
                return "the file could not be written (torch.save: a full disk?)"
        error = error.__cause__ or error.__context__
    return None


def _elsewhere(error: BaseException, folder: Path) -> bool:
    """Whether ``error`` names a file outside ``folder``'s parent (an input that could not be read, not the
    output)."""
    filename = getattr(error, "filename", None) if isinstance(error, OSError) else None
    if not isinstance(filename, (str, Path)):
        return False
    return not os.path.abspath(filename).startswith(os.path.abspath(folder.parent))


def _size(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB" if count >= 2**20 else f"{count:,} bytes"


@contextlib.contextmanager
def writing_to(folder: str | Path, needed_bytes: int | None = None) -> Iterator[None]:
    """Turn a write in the block that fails for want of space or permission (:func:`write_failure`) into one
    :class:`OutputWriteError` naming ``folder``, the bytes needed (``needed_bytes``, where known) and those free.

    Raises:
        OutputWriteError: the block's write failed that way; other errors pass unchanged.
    """
    try:
        yield
    except LongpeftError:
        raise
    except Exception as error:
        problem = write_failure(error)
        folder = Path(folder)
        refused = problem is not None and problem.startswith(("permission", "read-only"))
        if problem is None or refused and _elsewhere(error, folder):  # an input that could not be read
            raise
        sizes = []
        if needed_bytes:
            sizes.append(f"it needs about {_size(needed_bytes)}")
        existing = next((p for p in (folder, *folder.absolute().parents) if p.exists()), None)
        if existing is not None and problem.startswith(("no space", "the file")):
            with contextlib.suppress(OSError):
                sizes.append(f"{_size(shutil.disk_usage(existing).free)} free")
        todo = "free space there" if not problem.startswith(("permission", "read-only")) else "make it writable"
        amounts = f" ({', '.join(sizes)})" if sizes else ""
        raise OutputWriteError(
            f"could not write to {folder}: {problem}{amounts}; {todo} or choose another "
            "folder, and run the command again (nothing incomplete was kept)"
        ) from error


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary name beside it, renamed into place: a failure leaves
    the old file (or none), never a truncated one; a full disk or a refused write is an :class:`OutputWriteError`.
    The temporary name is the writer's own (process and thread), so concurrent writers of one path each rename a
    whole file: the last rename wins."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    with writing_to(path.parent):
        try:
            temporary.write_text(text, encoding="utf-8")
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def written_atomically(out_dir: Path, needed_bytes: int | None = None, replace: bool = False) -> Iterator[Path]:
    """A folder beside ``out_dir`` (``.NAME.partial``) to write into; its files become ``out_dir``'s only when the
    block succeeds, so a failure leaves no half-written ``out_dir``. ``out_dir`` must be new or empty
    (:func:`check_output_folder`) and absolute (``.`` has no name to write beside), unless ``replace``: then a
    folder already there is swapped for the new one once that is complete (a rerun's output replaces the last).
    A full disk or a refused write is an :class:`OutputWriteError` naming ``out_dir`` (``needed_bytes``: what the
    folder needs, where known).
    """
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    old = out_dir.with_name(f".{out_dir.name}.old")
    with writing_to(out_dir, needed_bytes):
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            yield partial
            if replace and out_dir.is_dir() and any(out_dir.iterdir()):
                shutil.rmtree(old, ignore_errors=True)
                out_dir.rename(old)
                partial.rename(out_dir)
                shutil.rmtree(old, ignore_errors=True)
            elif out_dir.is_dir():  # empty: keep the folder itself (it may be the working directory)
                for item in partial.iterdir():
                    item.rename(out_dir / item.name)
            else:
                partial.rename(out_dir)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
