"""Importing longpeft drops two notices of the libraries underneath, and only those: bitsandbytes' about its optional
Hub-fetched CPU kernel, and DeepSpeed's about falling back to the CPU on a machine without CUDA."""

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
    done = subprocess.run(
        [sys.executable, "-c", "import longpeft, bitsandbytes"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert longpeft.BNB_OPTIONAL_KERNEL_NOTICE not in done.stderr


def test_deepspeeds_cpu_notice_is_dropped_only_without_cuda(monkeypatch):
    import torch

    logger = logging.getLogger("DeepSpeed")
    records = _Records()
    logger.addHandler(records)
    try:
        logger.warning(longpeft.DEEPSPEED_CPU_NOTICE + ". If you have GPU or other accelerator, ...")
        logger.warning("some other DeepSpeed warning")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a CUDA device torch sees: the notice passes
        logger.warning(longpeft.DEEPSPEED_CPU_NOTICE + ". If you have GPU or other accelerator, ...")
    finally:
        logger.removeHandler(records)
    assert records.messages == [
        "some other DeepSpeed warning",
        longpeft.DEEPSPEED_CPU_NOTICE + ". If you have GPU or other accelerator, ...",
    ]


def test_importing_deepspeed_after_longpeft_prints_no_cpu_notice():
    """A fresh interpreter without CUDA, as a CPU command starts (skipped where DeepSpeed is not installed)."""
    import importlib.util

    import pytest
    import torch

    if importlib.util.find_spec("deepspeed") is None or torch.cuda.device_count() > 0:
        pytest.skip("needs DeepSpeed installed and no CUDA device")
    done = subprocess.run(
        [sys.executable, "-c", "import longpeft, deepspeed"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert longpeft.DEEPSPEED_CPU_NOTICE not in done.stdout + done.stderr
