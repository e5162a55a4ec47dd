"""File-safety rules every command follows, torch-free: a model source must exist or answer on the Hub, an output
folder must be new or empty, writable and no input, results are renamed into place once complete, a write that fails
for want of space or permission is one :class:`OutputWriteError`, and a Hub silent for ``LONGPEFT_HUB_TIMEOUT``
seconds ends a download in one HubTimeoutError.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import re
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigError, HubTimeoutError, LongpeftError, ModelSourceError, OutputFolderError, OutputWriteError


def is_local(name: str | Path) -> bool:
    """Whether ``name`` is meant as a local path: it exists, starts like one (``.``, ``/``, ``~``), is not shaped
    ``owner/name``, or its first folder exists here (``runs/missing``)."""
    text = str(name)
    if Path(text).exists() or text.count("/") != 1 or text.startswith((".", "/", "~")) or "\\" in text:
        return True
    return Path(text.split("/")[0]).is_dir()


def require_file(folder: str | Path, name: str, what: str, hint: str = "") -> Path:
    """``folder / name`` if a file, else a ModelSourceError naming ``what``, the folder and ``hint`` (what to do)."""
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
    (default :func:`hub_timeout`) seconds, and bound every later Hub download (:func:`bound_hub_requests`).
    Skipped with ``HF_HUB_OFFLINE=1``. Raises HubTimeoutError (no answer in time), ModelSourceError (no such or a
    private repository) or OSError (another failure)."""
    from huggingface_hub import HfApi, constants

    timeout = timeout or hub_timeout()
    if constants.HF_HUB_OFFLINE:
        return
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
    """Refuse a ``folder`` (``flag``) that is a file (OutputFolderError) or not writable (PermissionError)."""
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


def _size(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB" if count >= 2**20 else f"{count:,} bytes"


@contextlib.contextmanager
def writing_to(folder: str | Path, needed_bytes: int | None = None) -> Iterator[None]:
    """Turn a write in the block that fails for want of space or permission (:func:`write_failure`) into one
    OutputWriteError naming ``folder``, the bytes needed (``needed_bytes``) and those free; others pass unchanged."""
    try:
        yield
    except LongpeftError:
        raise
    except Exception as error:
        problem = write_failure(error)
        folder = Path(folder)
        refused = problem is not None and problem.startswith(("permission", "read-only"))
        filename = getattr(error, "filename", None) if isinstance(error, OSError) else None
        parent = os.path.abspath(folder.parent)  # a refused file outside it is an input that could not be read
        elsewhere = isinstance(filename, (str, Path)) and not os.path.abspath(filename).startswith(parent)
        if problem is None or refused and elsewhere:
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
    """A temporary name (this process and thread's) beside ``path`` to write to, renamed to ``path`` when the block
    succeeds (a failure leaves the old file); a full disk or a refused write is an OutputWriteError."""
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


HUB_TIMEOUT_VARIABLE = "LONGPEFT_HUB_TIMEOUT"
DEFAULT_HUB_TIMEOUT = 30.0  # seconds


def hub_timeout() -> float:
    """``LONGPEFT_HUB_TIMEOUT``: seconds (default 30) to wait on a silent Hub; a ConfigError unless a number > 0."""
    text = os.environ.get(HUB_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_HUB_TIMEOUT
    with contextlib.suppress(ValueError):
        if math.isfinite(value := float(text)) and value > 0:
            return value
    raise ConfigError(
        f"{HUB_TIMEOUT_VARIABLE}={text!r}: give the seconds to wait on a silent Hub, a number > 0 "
        f"(default {DEFAULT_HUB_TIMEOUT:g})"
    )


class _HubWait:
    """How long the Hub has sent nothing while requests (of any thread) waited on it; any answer or byte resets it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.silent_since: float | None = None  # when the Hub last sent something, while requests wait in vain
        self.gave_up: str | None = None  # the message once the wait ran out: later requests are refused at once

    def ask_again(self) -> None:
        """Forget an earlier silence (a new pre-check): requests are sent again."""
        with self.lock:
            self.silent_since, self.gave_up = None, None

    def answered(self) -> None:
        with self.lock:
            self.silent_since = None

    def budget(self, url: Any) -> float:
        """Seconds a request for ``url`` may wait now; refuses it when the wait has run out."""
        limit = hub_timeout()
        with self.lock:
            waited = 0.0 if self.silent_since is None else time.monotonic() - self.silent_since
            if self.gave_up is None and waited >= limit:
                self.gave_up = _silent_hub_message(url, limit)
            if self.gave_up is not None:
                raise HubTimeoutError(self.gave_up)
        return max(limit - waited, 0.05)

    def timed_out(self, url: Any, waiting_since: float, error: BaseException) -> None:
        """A request for ``url`` waiting since ``waiting_since`` got nothing: a HubTimeoutError once the Hub has been
        silent for the whole wait; before, the library's own error goes on (its retries run in the time left)."""
        limit = hub_timeout()
        with self.lock:
            if self.silent_since is None or waiting_since < self.silent_since:
                self.silent_since = waiting_since
            if time.monotonic() - self.silent_since < limit * 0.99:  # a socket's timeout may end a hair early
                return
            self.gave_up = _silent_hub_message(url, limit)
        raise HubTimeoutError(self.gave_up) from error


_HUB_WAIT = _HubWait()
ask_again = _HUB_WAIT.ask_again


XET_TIMEOUTS = ("HF_XET_CLIENT_CONNECT_TIMEOUT", "HF_XET_CLIENT_READ_TIMEOUT")  # hf_xet's own knobs
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/[^/]+/(.+)$")
_API = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+?)(/tree/.*|/revision/.*|/paths-info/.*)?$")


def _silent_hub_message(url: Any, limit: float) -> str:
    """One line for a Hub at ``url`` silent for ``limit`` seconds: the repo, the file, the endpoint, what to do."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(str(url))
    server, path = f"{parts.scheme}://{parts.netloc}", unquote(parts.path)
    file, api = _RESOLVE.match(path), _API.match(path)
    if file:
        kind = f"{file.group(1)[:-1]} " if file.group(1) else ""
        doing = f"while downloading {file.group(3)} of {kind}{file.group(2)}"
    elif api:
        kind = "" if api.group(1) == "models" else f"{api.group(1)[:-1]} "
        listing = (api.group(3) or "").startswith(("/tree", "/paths-info"))
        doing = f"while {'listing the files of' if listing else 'asking about'} {kind}{api.group(2)}"
    else:
        doing = f"while downloading {path.rsplit('/', 1)[-1] or path} (a file the Hub sent the download to)"
    return (
        f"the Hub at {server} sent nothing for {limit:g} s {doing}; check the network and HF_ENDPOINT, raise "
        f"{HUB_TIMEOUT_VARIABLE} on a slow link, or give a local folder (a rerun resumes what was downloaded)"
    )


def bound_hub_requests() -> None:
    """Bound every later GET and HEAD request huggingface_hub sends in this process by :func:`hub_timeout` of the
    Hub's silence (then they end in a HubTimeoutError until the next :func:`ask_again`), once, around the client
    factory in use; hf_xet's own client gets the same timeouts (:data:`XET_TIMEOUTS`) unless set."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    if getattr(factory, "bounded_by_longpeft", False):
        return
    wait = f"{max(round(hub_timeout() * 1000), 1)}ms"  # hf_xet reads durations as humantime text
    for name in XET_TIMEOUTS:
        os.environ.setdefault(name, wait)
    bounded = functools.partial(_bounded_client, factory)
    bounded.bounded_by_longpeft = True  # type: ignore[attr-defined]
    set_client_factory(bounded)


def _bounded_client(make_client: Callable[[], Any]) -> Any:
    """A client of ``make_client`` whose ``send`` of GET and HEAD requests keeps the :class:`_HubWait` clock."""
    client = make_client()
    library = sys.modules[type(client).__module__.split(".")[0]]  # httpx, or httpx2 (huggingface_hub >= 2)
    send = client.send

    def bounded_send(request: Any, **kwargs: Any) -> Any:
        if request.method not in ("GET", "HEAD"):
            return send(request, **kwargs)
        left = _HUB_WAIT.budget(request.url)
        timeouts = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            kind: left if timeouts.get(kind) is None else min(timeouts[kind], left)
            for kind in ("connect", "read", "write", "pool")
        }
        started = time.monotonic()
        try:
            response = send(request, **kwargs)
        except library.TimeoutException as error:
            _HUB_WAIT.timed_out(request.url, started, error)
            raise
        if kwargs.get("stream"):  # a download: its headers alone are no progress, its bytes are
            response.stream = _watched_body(library, response.stream, request.url, started)
        else:
            _HUB_WAIT.answered()
        return response

    client.send = bounded_send
    return client


def _watched_body(library: Any, stream: Any, url: Any, requested: float) -> Any:
    """``stream``, a download's body asked for at ``requested`` (``time.monotonic()``), whose bytes reset the
    :class:`_HubWait` clock and whose read timeouts count as silence since the last byte."""

    class Watched(library.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            last = requested
            try:
                for chunk in stream:
                    _HUB_WAIT.answered()
                    last = time.monotonic()
                    yield chunk
            except library.TimeoutException as error:
                _HUB_WAIT.timed_out(url, last, error)
                raise

        def close(self) -> None:
            stream.close()

    return Watched()
