"""scripts/gpu_check.py: its --tiny mode runs the whole check for real on CPU; without CUDA the GPU mode stops
with a message (and a JSON line); runs get their own environment variables; the allocator's pools are summed per
stream. scripts/gpu_session.sh: --tiny rehearses every part on CPU, each writing its file; the deadline skips parts."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SESSION = ROOT / "scripts" / "gpu_session.sh"
GiB = 1024**3


@pytest.fixture(scope="module")
def gpu_check():
    """scripts/gpu_check.py as a module (it imports torch and longpeft only inside its functions)."""
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = sys.modules["gpu_check_script"] = importlib.util.module_from_spec(spec)  # NamedTuple looks it up
    spec.loader.exec_module(module)
    return module


def test_tiny_mode_trains_compares_with_the_planner_and_checks_the_kernels(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--tokens",
            "256",
            "--steps",
            "2",
            "--work-dir",
            str(tmp_path),
            "--report",
            str(tmp_path / "report.json"),
            "--set",
            "env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "report.json").read_text()) == report  # the file a time-limited call keeps
    assert report["ok"] and report["tiny"] and list(report["runs"]) == ["sdpa"]
    assert 240 <= report["tokens"] <= 256  # the longest conversation that fits the sample length
    run = report["runs"]["sdpa"]
    assert len(run["step_seconds"]) == 2 and len(run["losses"]) == 2 and all(math.isfinite(x) for x in run["losses"])
    assert run["tokens_per_second"] > 0
    # env.NAME reached the training run's process (and not the planner's recipe, which would refuse the key)
    assert run["allocator_config"] == "expandable_segments:True"
    assert run["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
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
        assert (
            check["kernels"] == ["sdpa", "eager"] and check["allclose_atol_rtol_5e-2"] and check["max_abs_diff"] < 1e-4
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_mode_without_cuda_says_so():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "--tiny" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False


@pytest.mark.slow  # two tiny training runs of the GPU script (2 min): `make test-slow` runs it
def test_a_second_call_reuses_the_kept_base_and_trains_afresh(tmp_path):
    """With --work-dir the random base is written once; each call trains again (a kept run folder is not resumed).
    --set overrides reach both the training run and the planner."""
    common = [
        sys.executable,
        str(SCRIPT),
        "--tiny",
        "--tokens",
        "128",
        "--steps",
        "1",
        "--work-dir",
        str(tmp_path),
        "--attentions",
        "sdpa",
        "--no-kernel-check",
    ]
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


def test_env_overrides_go_to_each_runs_process_and_not_to_the_recipe(gpu_check, monkeypatch):
    args = gpu_check.parse_args(
        [
            "--tiny",
            "--set",
            "lora.r=8",
            "--set",
            "env.A=1",
            "--variant",
            "kept",
            "tokens=128",
            "train.offload_checkpoints=true",
            "env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "--variant",
            "plain",
            "env.A=",
        ]
    )
    kept, plain = gpu_check.planned_runs(args, ["sdpa"])
    assert kept == gpu_check.Run(
        "kept",
        "sdpa",
        ["lora.r=8", "train.offload_checkpoints=true"],
        128,
        3,
        {"A": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    assert plain == gpu_check.Run("plain", "sdpa", ["lora.r=8"], 1024, 3, {"A": ""})
    monkeypatch.setenv("A", "from the caller")
    monkeypatch.setenv("B", "kept")
    assert gpu_check.run_environment(kept.env)["A"] == "1"
    assert "A" not in gpu_check.run_environment(plain.env)  # an empty value removes the variable
    assert gpu_check.run_environment(plain.env)["B"] == "kept" and os.environ["A"] == "from the caller"


def test_the_allocators_segments_are_summed_per_stream(gpu_check):
    """The shape of torch.cuda.memory_snapshot()'s segments (only the keys read), the compute stream 0."""
    segments = [
        {"stream": 0, "total_size": 2 * GiB, "allocated_size": GiB, "address": 1},
        {"stream": 0x7F00, "total_size": 3 * GiB, "allocated_size": GiB // 2, "address": 2},
        {"stream": 0, "total_size": GiB, "allocated_size": 0, "address": 3},
    ]
    assert gpu_check.pools_by_stream(segments, 0) == {
        "compute": {"reserved_gib": 3.0, "allocated_gib": 1.0, "segments": 2},
        "stream 0x7f00": {"reserved_gib": 3.0, "allocated_gib": 0.5, "segments": 1},
    }
    assert set(gpu_check.pools_by_stream(segments, 0x7F00)) == {"compute", "stream 0x0"}
    assert gpu_check.pools_by_stream([], 0) == {}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tiny", "--attentions", "flash_attention_2"], "--tiny trains with SDPA only"),
        (["--tokens", "8"], "--tokens must be >= 64"),
        (["--tiny", "--set", "env.=1"], "--set env.=1: give KEY=VALUE"),
        (["--tiny", "--set", "lora.r"], "--set lora.r: give KEY=VALUE"),
    ],
)
def test_bad_flags_are_refused_with_the_reason(flags, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr


def session(tmp_path: Path, *args: str, deadline: int | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    """scripts/gpu_session.sh with ARGS, its $OUT in tmp_path/out, this interpreter as its python."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env.pop("GPU_SESSION_DEADLINE", None)
    if deadline is not None:
        env["GPU_SESSION_DEADLINE"] = str(deadline)
    return subprocess.run(
        ["bash", str(SESSION), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )


def parts_of(tmp_path: Path) -> dict[str, dict]:
    return {entry["part"]: entry for entry in json.loads((tmp_path / "out" / "parts.json").read_text())["parts"]}


def test_the_session_skips_the_parts_its_deadline_leaves_no_time_for(tmp_path):
    proc = session(tmp_path, "--tiny", "liger", "80k", deadline=0)
    assert proc.returncode == 0, proc.stderr
    parts = parts_of(tmp_path)
    assert list(parts) == ["liger", "80k"] and all(entry["status"] == "skipped" for entry in parts.values())
    assert parts["80k"]["file"] == "qlora_80k.json" and "0 s were left" in parts["80k"]["note"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["parts.json", "session.log"]
    assert "80k: skipped" in proc.stdout and "80k: skipped" in (tmp_path / "out" / "session.log").read_text()


@pytest.mark.parametrize(
    ("args", "deadline", "message"),
    [
        (["--tiny", "90k"], None, "'90k' is no part or flag"),
        (["--tiny"], "9m", "GPU_SESSION_DEADLINE=9m: give whole seconds"),
    ],
)
def test_the_session_refuses_bad_parts_and_deadlines(tmp_path, args, deadline, message):
    proc = session(tmp_path, *args, deadline=deadline)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_session_without_cuda_says_so(tmp_path):
    proc = session(tmp_path, "80k")
    assert proc.returncode == 2 and "no CUDA GPU here" in proc.stdout and "--tiny" in proc.stdout


@pytest.mark.slow  # every part for real on the tiny model: 3 minutes or more on 2 CPU cores (`make test-slow`)
def test_the_tiny_session_runs_every_part_and_each_writes_its_file(tmp_path):
    proc = session(tmp_path, "--tiny", deadline=3000, timeout=3600)  # a loaded machine takes 3 to 8 minutes
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = tmp_path / "out"
    parts = parts_of(tmp_path)
    assert list(parts) == ["80k", "262k", "liger", "tests", "beacon"]
    assert all(entry["status"] == "ok" and (out / entry["file"]).stat().st_size > 0 for entry in parts.values())
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back from $OUT
    runs = json.loads((out / "qlora_80k.json").read_text())["runs"]
    assert set(runs) == {"all256", "kept256"} and runs["all256"]["losses"] == runs["kept256"]["losses"]
    assert runs["kept256"]["checkpointing"]["offload"] and runs["kept256"]["allocator_config"] is None
    long = json.loads((out / "qlora_262k.json").read_text())["runs"]["long2048"]
    assert long["tokens"] > 1900 and all(math.isfinite(x) for x in long["losses"])
    checks = json.loads((out / "liger.json").read_text())
    assert checks["runs"] == {} and checks["kernels"]["harpe"]["allclose_atol_rtol_5e-2"] and "liger" in checks
    assert " passed" in (out / "pytest.log").read_text()
    beacon = json.loads((out / "beacon.json").read_text())
    assert set(beacon["lengths"]) == {"128", "256"} and beacon["kernels"]["sdpa"]["allclose_atol_rtol_5e-2"]
    assert beacon["parallel"]["sdpa"]["max_logit_diff"] < 1e-4 and beacon["beacon_peak_ratio"] > 0
