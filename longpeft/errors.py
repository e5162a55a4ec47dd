"""The errors longpeft raises for input it cannot use: one base, six kinds.

Every expected failure caused by what the user gave (a file, a folder, a key, a flag) is a :class:`LongpeftError`
whose message names it and says what to do; the command line prints it as one line and exits with status 2
(``--debug`` shows the traceback), while any other exception is a bug and keeps its traceback. Each kind also
derives from the built-in exception it stands for, so ``except ValueError`` or ``except FileNotFoundError`` around
a longpeft call keeps working. This module imports nothing: every layer of the package may raise these.
"""

from __future__ import annotations


class LongpeftError(Exception):
    """An expected failure caused by the user's input: the message names the file, field or flag and says what to
    do. The CLI prints it as one line and exits with status 2."""


class ConfigError(LongpeftError, ValueError):
    """A setting that cannot be used: a config file or key, a ``--set`` override, a command-line flag, or a method
    setting that does not fit the base model."""


class DataError(LongpeftError, ValueError):
    """Input data whose content cannot be used: training data, documents, ``longpeft.json``, eval results; the
    message names the file (and row or line)."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A data file or folder that is not there, or holds no file of the kinds read."""


class ModelSourceError(LongpeftError, FileNotFoundError):
    """A model, adapter or checkpoint that is not where it was said to be: no such folder, not on the Hub, or a
    folder longpeft did not write (a file it needs is missing)."""


class OutputFolderError(LongpeftError, FileExistsError):
    """An output folder that would overwrite something: a folder that is not empty, a file, or one of the inputs."""


class OutputWriteError(LongpeftError, OSError):
    """Results that could not be written (no space left, no permission): the message names the folder and, where
    known, the bytes it needed; nothing that looks complete was left behind (:func:`longpeft.files.writing_to`)."""


class HubTimeoutError(LongpeftError, TimeoutError):
    """A Hub endpoint that sent nothing (no answer, no byte of a download) for ``LONGPEFT_HUB_TIMEOUT`` seconds: the
    message names the endpoint, the repo and the file where known, and what to do (:mod:`longpeft.files`)."""
