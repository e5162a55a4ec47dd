"""scripts/gpu_check.py: its --tiny mode runs the whole check for real on CPU; without CUDA the GPU mode stops
with a message (and a JSON line)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_tiny_mode_trains_compares_with_the_planner_and_checks_the_kernels(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--tokens", "256", "--steps", "2",
                           "--work-dir", str(tmp_path), "--report", str(tmp_path / "report.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "report.json").read_text()) == report  # the file a time-limited call keeps
    assert report["ok"] and report["tiny"] and list(report["runs"]) == ["sdpa"]
    assert 240 <= report["tokens"] <= 256  # the longest conversation that fits the sample length
    run = report["runs"]["sdpa"]
    assert len(run["step_seconds"]) == 2 and len(run["losses"]) == 2 and all(math.isfinite(x) for x in run["losses"])
    assert run["tokens_per_second"] > 0
    spec = json.loads((tmp_path / "run-sdpa" / "adapter" / "longpeft.json").read_text())
    assert spec["methods"]["rope"]["rope_theta"] == 2e8  # the 80K recipe's settings were applied
    resolved = json.loads((tmp_path / "run-sdpa" / "recipe.resolved.json").read_text())
    assert resolved["quantization"]["bnb_4bit_quant_type"] == "nf4" and resolved["lora"]["r"] == 32
    assert resolved["data"]["dropped"] == 0 and resolved["data"]["longest"] == report["tokens"]  # every step at length
    plan = report["planner"]["sdpa"]
    assert plan["attention"] == "sdpa" and set(plan["utilisation"]) == {"matmuls", "attention", "source"}
    assert plan["peak_gib"] > 0 and set(plan["terms_gib"]) >= {"base weights", "checkpointed layer inputs"}
    assert report["kernels"]["flash_attn_installed"] in (True, False)
    for method in ("harpe", "string"):
        check = report["kernels"][method]
        assert (check["kernels"] == ["sdpa", "eager"] and check["allclose_atol_rtol_5e-2"]
                and check["max_abs_diff"] < 1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_mode_without_cuda_says_so():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "--tiny" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False


@pytest.mark.slow  # two tiny training runs of the GPU script (2 min): `make test-slow` runs it
def test_a_second_call_reuses_the_kept_base_and_trains_afresh(tmp_path):
    """With --work-dir the random base is written once; each call trains again (a kept run folder is not resumed).
    --set overrides reach both the training run and the planner."""
    common = [sys.executable, str(SCRIPT), "--tiny", "--tokens", "128", "--steps", "1", "--work-dir", str(tmp_path),
              "--attentions", "sdpa", "--no-kernel-check"]
    reports = []
    for extra in ([], ["--set", "lora.r=8"]):
        proc = subprocess.run(common + extra, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "base_written_seconds" in reports[0] and "base_written_seconds" not in reports[1]
    assert all(r["ok"] and r["kernels"] is None and len(r["runs"]["sdpa"]["losses"]) == 1 for r in reports)
    assert json.loads((tmp_path / "run-sdpa" / "recipe.resolved.json").read_text())["lora"]["r"] == 8
    lora = [r["planner"]["sdpa"]["terms_gib"]["LoRA"] for r in reports]
    assert lora[0] == pytest.approx(4 * lora[1])  # r 32 -> 8


@pytest.mark.parametrize(("flags", "message"), [
    (["--tiny", "--attentions", "flash_attention_2"], "--tiny trains with SDPA only"),
    (["--tokens", "8"], "--tokens must be >= 64"),
])
def test_bad_flags_are_refused_with_the_reason(flags, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr
