"""File-safety rules every command follows, torch-free: a model source must exist or answer on the Hub
(:func:`check_model_source`); an output folder must be new or empty, writable and no input
(:func:`check_output_folder`); results are renamed into place once complete (:func:`written_atomically`); a write that
fails for want of space or permission, in any library, is one :class:`OutputWriteError` (:func:`writing_to`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

from .errors import HubTimeoutError, LongpeftError, ModelSourceError, OutputFolderError, OutputWriteError
from .hub_wait import HUB_TIMEOUT_VARIABLE, ask_again, bound_hub_requests, hub_timeout


def is_local(name: str | Path) -> bool:
    """Whether ``name`` is meant as a local path: it exists, starts like one (``.``, ``/``, ``~``), is not shaped
    ``owner/name``, or its first folder exists here (``runs/missing``)."""
    text = str(name)
    if Path(text).exists() or text.count("/") != 1 or text.startswith((".", "/", "~")) or "\\" in text:
        return True
    return Path(text.split("/")[0]).is_dir()


def require_file(folder: str | Path, name: str, what: str, hint: str = "") -> Path:
    """``folder / name``, which must be a file, else a ModelSourceError naming ``what`` (``adapter``) and the folder,
    with ``hint`` (what to do) appended."""
    path = Path(folder) / name
    if not path.is_file():
        todo = hint or "; the folder is incomplete: copy or download it again"
        raise ModelSourceError(f"{name} is missing in {what} {folder}{todo}")
    return path


def is_whole_model(folder: Path) -> bool:
    """Whether a longpeft folder holds a whole model (config.json, no adapter_config.json) rather than an adapter."""
    return (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file()


_NO_ANSWER = TimeoutError()


def hub_preflight(repo_id: str, what: str, timeout: float | None = None, repo_type: str = "model") -> None:
    """Ask the Hub about ``repo_id`` (of ``repo_type``; ``what`` names its role) once, waiting at most ``timeout``
    (default :func:`hub_timeout`) seconds, and bound every later Hub download (:func:`.hub_wait.bound_hub_requests`).
    Skipped with ``HF_HUB_OFFLINE=1``. Raises HubTimeoutError (no answer in time), ModelSourceError (no such or a
    private repository) or OSError (another failure)."""
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
    """Refuse a missing local folder (ModelSourceError + ``hint``) or Hub repo (:func:`hub_preflight`)."""
    if not is_local(name):
        hub_preflight(str(name), what)
    elif not Path(name).is_dir():
        raise ModelSourceError(f"{what} {name}: no such folder (and not a Hub repo id owner/name){hint}")


def local_adapter_dir(adapter: str | Path, what: str = "adapter", hint: str = "") -> Path:
    """A local folder for an adapter given as a folder or a Hub repo id (downloaded, cached), checked by
    :func:`check_model_source` (``what``, ``hint``); a ModelSourceError for a Hub repo listing no file."""
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


# The libraries that ask the Hub and read its answers.
HUB_CLIENT_PACKAGES = ("huggingface_hub", "httpx", "httpcore", "httpx2", "httpcore2", "requests", "urllib3")


@contextlib.contextmanager
def asking_the_hub(repo: str, what: str) -> Iterator[None]:
    """Turn a Hub answer about ``repo`` (``what``: ``adapter``) that the Hub client fails to read (its ``KeyError``,
    ``TypeError``, ``AttributeError``, ``ValueError``, ``AssertionError``) into one ModelSourceError."""
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
    """Whether ``error`` was raised in one of ``packages``: its innermost frame, or with ``innermost=False`` any."""
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
    if innermost:
        frames = frames[-1:]
    return any(package in os.path.normpath(frame).split(os.sep) for frame in frames for package in packages)


def check_writable_folder(folder: str | Path, flag: str) -> None:
    """Refuse now a ``folder`` (named by ``flag``) that is a file (OutputFolderError) or whose nearest existing
    folder is not writable (PermissionError)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputFolderError(f"{flag} {folder} is a file; choose a folder")
    parent = next(p for p in (folder.resolve(), *folder.resolve().parents) if p.exists())
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{flag} {folder}: {parent} is not writable")


def check_output_folder(out_dir: Path, protected: dict[str, Path], flag: str = "--out") -> None:
    """Refuse, before any work, an output folder (given by ``flag``) that is a file, not empty, one of the
    ``protected`` folders (``{what: folder}``) or unwritable: OutputFolderError, or PermissionError."""
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
# torch.save's writer on a full disk
_TORCH_WRITE = ("enforce fail at inline_container", "pytorchstreamwriter failed writing", "file write failed")


def write_failure(error: BaseException) -> str | None:
    """What stopped a write, in words (``no space left on device``, ``permission denied``), when ``error`` or one it
    was raised from is a full disk or a refused write; None for anything else."""
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
    """Whether ``error`` names a file outside ``folder``'s parent (an input, not the output)."""
    filename = getattr(error, "filename", None) if isinstance(error, OSError) else None
    if not isinstance(filename, (str, Path)):
        return False
    return not os.path.abspath(filename).startswith(os.path.abspath(folder.parent))


def _size(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB" if count >= 2**20 else f"{count:,} bytes"


@contextlib.contextmanager
def writing_to(folder: str | Path, needed_bytes: int | None = None) -> Iterator[None]:
    """Turn a write in the block that fails for want of space or permission (:func:`write_failure`) into one
    OutputWriteError naming ``folder``, the bytes needed (``needed_bytes``, where known) and those free; other
    errors pass unchanged."""
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
        sizes = [f"it needs about {_size(needed_bytes)}"] if needed_bytes else []
        existing = next((p for p in (folder, *folder.absolute().parents) if p.exists()), None)
        if existing is not None and not refused:
            with contextlib.suppress(OSError):
                sizes.append(f"{_size(shutil.disk_usage(existing).free)} free")
        todo = "make it writable" if refused else "free space there"
        amounts = f" ({', '.join(sizes)})" if sizes else ""
        raise OutputWriteError(
            f"could not write to {folder}: {problem}{amounts}; {todo} or choose another "
            "folder, and run the command again (nothing incomplete was kept)"
        ) from error


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary name of this process and thread beside ``path`` to write to, renamed to ``path`` when the block
    succeeds: a failure leaves the old file (or none), concurrent writers each rename a whole file; a full disk or a
    refused write is an OutputWriteError."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    with writing_to(path.parent):
        try:
            yield temporary
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` (:func:`replaced_atomically`); returns the path."""
    with replaced_atomically(Path(path)) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


@contextlib.contextmanager
def written_atomically(out_dir: Path, needed_bytes: int | None = None, replace: bool = False) -> Iterator[Path]:
    """A folder beside ``out_dir`` (``.NAME.partial``) to write into; its files become ``out_dir``'s only when the
    block succeeds. ``out_dir`` must be absolute and new or empty, unless ``replace``: then a folder already there
    is swapped for the complete new one. Failed writes are as in :func:`writing_to` (``needed_bytes``)."""
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
