"""Importing longpeft drops bitsandbytes' notice about its optional Hub-fetched CPU kernel, and only that."""

from __future__ import annotations

import logging
import subprocess
import sys

import longpeft


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_optional_kernel_notice_is_dropped_and_the_loggers_other_records_pass():
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    records = _Records()
    logger.addHandler(records)
    try:
        logger.warning(longpeft.BNB_OPTIONAL_KERNEL_NOTICE + ": %s. Please make sure ...", "No module named 'kernels'")
        logger.warning("some other bitsandbytes warning")
    finally:
        logger.removeHandler(records)
    assert records.messages == ["some other bitsandbytes warning"]


def test_importing_bitsandbytes_after_longpeft_prints_no_kernel_notice():
    """In a fresh interpreter, the way every CLI command starts (bitsandbytes itself prints the notice only on
    CPUs with AVX512-BF16: elsewhere this passes either way)."""
    done = subprocess.run([sys.executable, "-c", "import longpeft, bitsandbytes"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert longpeft.BNB_OPTIONAL_KERNEL_NOTICE not in done.stderr
