"""Training past one node: `train --launch KIND --nodes N --node-rank R --main-address HOST:PORT`, `--print-slurm`,
the planner's inter-node line, and two "nodes" on this machine (two launches of one CPU process each, gloo) against
one node of two processes, killed and resumed across the two."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from longpeft.cli import main
from longpeft.launch import check_sequence_parallel_group, launch_command
from longpeft.launch.nodes import Nodes, parse_main_address
from longpeft.recipes.checkpoints import checkpoint_step, latest_checkpoint
from longpeft.recipes.runner import run
from longpeft.recipes.schema import load_recipe
from longpeft.scale import estimate
from longpeft.scale.network import add_inter_node

from conftest import write_chat_jsonl  # tests/conftest.py
from run_helpers import assert_resumed_as_uninterrupted, assert_same_weights, logged_losses  # tests/run_helpers.py

QLORA_80K = "llama3-8b-instruct-80k-qlora"  # global batch 8, one sample per GPU; Llama-3-8B: 32 heads, 8 KV heads


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def printed_command(capsys, *argv: str) -> list[str]:
    assert main(["train", *argv, "--print-command"]) == 0, capsys.readouterr().err
    return shlex.split(capsys.readouterr().out)


def test_node_flags_become_accelerates_machine_arguments(capsys):
    """Every node runs the same command but --node-rank; the processes are nodes x --gpus; DeepSpeed launches use
    torchrun on each node (accelerate's default for them is DeepSpeed's ssh launcher over a hostfile); Ulysses'
    group spans every node."""
    batch = ("--set", "train.global_batch_size=16")
    ddp = printed_command(
        capsys,
        QLORA_80K,
        "--launch",
        "ddp",
        "--gpus",
        "8",
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--main-address",
        "10.0.0.1:29600",
        *batch,
    )
    assert ddp[ddp.index("--num_processes") : ddp.index("-m")] == [
        "--num_processes",
        "16",
        "--mixed_precision",
        "bf16",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29600",
    ]
    assert ddp[ddp.index("-m") :] == ["-m", "longpeft.cli", "train", QLORA_80K, "--set", "train.global_batch_size=16"]
    zero3 = printed_command(
        capsys,
        QLORA_80K,
        "--launch",
        "zero3",
        "--gpus",
        "8",
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--main-address",
        "node001:29500",
        *batch,
        "--resume",
    )
    assert flag(zero3, "--deepspeed_multinode_launcher") == "standard" and flag(zero3, "--machine_rank") == "0"
    assert zero3[-1] == "--resume" and flag(zero3, "--main_process_ip") == "node001"
    ulysses = printed_command(
        capsys,
        QLORA_80K,
        "--launch",
        "ulysses",
        "--gpus",
        "8",
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--main-address",
        "[fd00::1]:29500",
        "--set",
        "model.load_in_4bit=false",
    )
    assert flag(ulysses, "--parallelism_config_sp_size") == "16" and flag(ulysses, "--num_processes") == "16"
    assert flag(ulysses, "--main_process_ip") == "fd00::1" and "--deepspeed_multinode_launcher" in ulysses
    one_node = printed_command(capsys, QLORA_80K, "--launch", "ddp", "--gpus", "8", "--main-address", "10.0.0.1:29601")
    assert "--num_machines" not in one_node and flag(one_node, "--main_process_port") == "29601"
    assert parse_main_address("localhost:1") == ("localhost", 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--nodes", "2", "--node-rank", "2", "--main-address", "h:29500"],
            "--node-rank 2 is out of range for --nodes 2",
        ),
        (["--nodes", "2", "--node-rank", "-1", "--main-address", "h:29500"], "--node-rank -1 is out of range"),
        (["--node-rank", "1"], "--node-rank 1 is out of range for --nodes 1"),
        (["--nodes", "2", "--node-rank", "1"], "--nodes 2: give --main-address HOST:PORT"),
        (["--nodes", "2", "--main-address", "10.0.0.1"], "--main-address '10.0.0.1': give HOST:PORT"),
        (["--nodes", "2", "--main-address", "http://10.0.0.1:29500"], "give HOST:PORT"),
        (["--nodes", "2", "--main-address", ":29500"], "give HOST:PORT"),
        (["--nodes", "2", "--main-address", "10.0.0.1:0"], "port 0 is out of range (1 to 65535)"),
        (["--nodes", "2", "--main-address", "10.0.0.1:65536"], "port 65536 is out of range (1 to 65535)"),
        (["--nodes", "2", "--main-address", "[fd00::zz]:29500"], "is not an IPv6 address"),
        # the recipe's global batch 8 cannot be split over 16 data-parallel processes
        (
            ["--nodes", "2", "--main-address", "h:29500", "--set", "train.global_batch_size=8"],
            "global_batch_size=8 is not a multiple of train.per_device_batch_size=1 x 16 data-parallel processes: "
            "--set train.global_batch_size to a multiple of 16",
        ),
        # Ulysses over 8 nodes x 8 GPUs: 64 processes cannot share 32 heads
        (
            ["--nodes", "8", "--main-address", "h:29500", "--launch", "ulysses"]
            + ["--set", "model.load_in_4bit=false"],
            "does not divide 32",
        ),
        # the launch's own checks still hold past one node
        (
            ["--nodes", "2", "--main-address", "h:29500", "--launch", "ulysses"],
            "--launch ulysses with model.load_in_4bit",
        ),
        (["--nodes", "2", "--print-slurm", "--node-rank", "1"], "--print-slurm with --node-rank"),
        (["--nodes", "2", "--print-slurm", "--main-address", "h:29500"], "--print-slurm with --main-address"),
        (["--nodes", "2", "--print-slurm", "--print-command"], "--print-slurm and --print-command: choose one"),
    ],
)
def test_bad_node_flags_are_refused_with_the_reason(capsys, argv, message):
    if "--launch" not in argv:
        argv = [*argv, "--launch", "ddp"]
    if "--print-slurm" not in argv:
        argv = [*argv, "--print-command"]
    assert main(["train", QLORA_80K, "--gpus", "8", "--set", "train.global_batch_size=64", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["--nodes", "--node-rank", "--main-address", "--print-slurm"])
def test_node_flags_need_launch(capsys, name):
    value = {"--nodes": ["2"], "--node-rank": ["1"], "--main-address": ["h:1"], "--print-slurm": []}[name]
    assert main(["train", "tiny-cpu", name, *value]) == 2
    assert f"{name} goes with --launch" in capsys.readouterr().err


def test_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["train", QLORA_80K, "--launch", "ddp", "--gpus", "8", "--nodes", "0", "--print-command"])
    assert "--nodes: 0 is out of range: must be >= 1" in capsys.readouterr().err
    assert main(["train", QLORA_80K, "--launch", "ddp", "--nodes", "2", "--print-slurm"]) == 2
    assert "--print-slurm: give --gpus G" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--nodes must be >= 1"):
        Nodes(0)


def test_ulysses_group_must_split_the_heads():
    """DeepSpeed's rule (``UlyssesSPAttentionHF``): query heads divisible by the group, KV heads a multiple or a
    divisor of it. Qwen2-7B's 28 heads and 4 KV heads over 2 nodes x 7 GPUs: heads split, KV heads do not."""
    check_sequence_parallel_group(16, 32, 8)
    check_sequence_parallel_group(4, 32, 8)
    check_sequence_parallel_group(32, 32, 8)  # KV heads replicated 4 times
    with pytest.raises(ValueError, match="14 does not divide 32"):
        check_sequence_parallel_group(14, 32, 8)
    with pytest.raises(ValueError, match="4 KV heads must be a multiple or a divisor of the processes"):
        check_sequence_parallel_group(14, 28, 4)


def test_slurm_script_runs_one_launch_per_node(tmp_path, capsys):
    """--print-slurm: one task per node, each running the command `train --node-rank R --main-address HOST:PORT`
    would give on that node, R from $SLURM_NODEID and HOST the allocation's first host. Executed by bash with stand-in
    scontrol, srun (one task per node id) and accelerate (which records its arguments)."""
    overrides = ["--set", "train.global_batch_size=8"]
    assert (
        main(["train", QLORA_80K, "--launch", "zero3", "--gpus", "4", "--nodes", "2", "--print-slurm", *overrides])
        == 0
    )
    script = tmp_path / "job.sh"
    script.write_text(capsys.readouterr().out)
    text = script.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        'scontrol show hostnames "$SLURM_JOB_NODELIST"',
    ):
        assert line in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    stand_ins = {
        "scontrol": '[ "$1 $2" = "show hostnames" ] && [ "$3" = "gpu-[07-08]" ] && printf "gpu-07\\ngpu-08\\n"',
        # srun's options, then one task per node (SLURM_NODEID set), as SLURM starts them
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
        'for node in 0 1; do SLURM_NODEID=$node "$@" || exit $?; done',
        "accelerate": f'{shlex.quote(sys.executable)} -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" '
        f"> {shlex.quote(str(out))}/node-$SLURM_NODEID.json",
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    recipe = load_recipe(QLORA_80K, ["train.global_batch_size=8"])
    environment = {key: value for key, value in os.environ.items() if key != "MAIN_PORT"}
    environment.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-[07-08]")
    for port_env, port in (({}, 29500), ({"MAIN_PORT": "29611"}, 29611)):  # MAIN_PORT=29611 sbatch job.sh
        env = {**environment, **port_env}
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        for rank in (0, 1):
            expected = launch_command(
                recipe, QLORA_80K, "zero3", 4, ["train.global_batch_size=8"], Nodes(2, rank, "gpu-07", port)
            )
            assert json.loads((out / f"node-{rank}.json").read_text()) == expected[1:]  # after `accelerate`


def test_plan_adds_the_gradient_all_reduce_between_nodes(capsys):
    """Ring all-reduce: every GPU sends 2 (P - 1) / P x the gradient bytes per synchronisation. Llama-3-8B QLoRA, r 32
    on q, k, v, o and the full embedding trained: the trainable parameters counted from the published shapes."""
    lora = 32 * 32 * ((4096 + 4096) + (4096 + 1024) + (4096 + 1024) + (4096 + 4096))  # layers x r x (in + out)
    trainable = lora + 128256 * 4096
    recipe = load_recipe(QLORA_80K, ["train.global_batch_size=32"])
    ddp = add_inter_node(estimate(recipe, gpus=16, launch="ddp", samples=3500), recipe, nodes=2, gbps=400)
    traffic = ddp.assumptions["inter_node"]
    steps = math.ceil(3500 / 32)
    sent = 2 * 15 / 16 * trainable * 4  # float32 LoRA and embedding gradients, once per optimizer step
    assert traffic["gradient_bytes"] == trainable * 4
    assert traffic["bytes_per_step"] == pytest.approx(sent, rel=1e-12)
    assert traffic["seconds_per_step"] == pytest.approx(sent / 50e9, rel=1e-12)  # 400 Gb/s = 50 GB/s
    assert traffic["optimizer_steps"] == steps and traffic["hours"] == pytest.approx(steps * sent / 50e9 / 3600)
    # ZeRO-3: bf16 gradients (the compute dtype), reduce-scattered at each of 32 / 16 = 2 micro-batches, one gather
    zero3 = add_inter_node(estimate(recipe, gpus=16, launch="zero3", samples=3500), recipe, 2, 100).assumptions
    assert zero3["inter_node"]["bytes_per_step"] == pytest.approx((2 + 1) * 15 / 16 * trainable * 2, rel=1e-12)
    assert zero3["inter_node"]["seconds_per_step"] == pytest.approx((2 + 1) * 15 / 16 * trainable * 2 / 12.5e9)
    # Ulysses: one sequence-parallel group of all 16 GPUs trains one sample, so 32 micro-batches per step
    bf16 = load_recipe(QLORA_80K, ["train.global_batch_size=32", "model.load_in_4bit=false"])
    ulysses = add_inter_node(estimate(bf16, gpus=16, launch="ulysses"), bf16, 2).assumptions["inter_node"]
    assert ulysses["reductions_per_step"] == 32 and ulysses["gbps"] == 400

    assert (
        main(
            [
                "plan",
                QLORA_80K,
                "--gpus",
                "8",
                "--nodes",
                "2",
                "--samples",
                "3500",
                "--set",
                "train.global_batch_size=32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "on 16 GPUs" in out and "= 1.3 h" in out  # nodes x GPUs in the time estimate
    line = next(line for line in out.splitlines() if line.startswith("inter-node:"))
    assert line.startswith(
        f"inter-node: 2 nodes x 8 GPUs, gradient all-reduce of {trainable * 4 / 1e9:.2f} GB: "
        f"{sent / 1e9:.2f} GB sent per GPU per optimizer step, {sent / 50e9:.3g} s at 400 Gb/s "
        "per GPU"
    )
    assert main(["plan", QLORA_80K, "--gpus", "16", "--samples", "3500", "--set", "train.global_batch_size=32"]) == 0
    single = capsys.readouterr().out
    assert "inter-node" not in single and "on 16 GPUs" in single and "= 1.3 h" in single


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "2"], "longpeft plan --nodes 2: give --gpus G"),
        (["--gpus", "8", "--inter-node-gbps", "100"], "--inter-node-gbps goes with --nodes N > 1"),
        (
            ["--gpus", "8", "--nodes", "2"],
            "train.global_batch_size=8 is not a multiple of train.per_device_batch_size=1 "
            "x 16 data-parallel processes: --set train.global_batch_size to a multiple",
        ),
    ],
)
def test_plan_node_flags_are_checked(capsys, argv, message):
    assert main(["plan", QLORA_80K, *argv]) == 2
    assert message in capsys.readouterr().err


# Two "nodes" on this machine: each `longpeft train` starts one accelerate launch of one CPU process (gloo).
STEPS = 8
TRAIN = (
    "train.max_steps=8",
    "train.save_steps=2",
    "train.global_batch_size=2",
    "train.per_device_batch_size=1",
    "data.max_length=256",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_train(
    out: Path, base: Path, data: Path, *launch: str, train: tuple[str, ...] = TRAIN
) -> tuple[subprocess.Popen, Path]:
    """``longpeft train tiny-cpu --launch ...`` in the background on CPU processes; its output goes to a log."""
    overrides = [f"model.name_or_path={base}", f"data.source={data}", f"output_dir={out}", *train]
    argv = [sys.executable, "-m", "longpeft.cli", "train", "tiny-cpu", *launch]
    argv += [word for override in overrides for word in ("--set", override)]
    # gloo on CPU processes, also on a machine with GPUs; one thread per process, as torchrun sets for 2 per node
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    log = out.with_name(f"{out.name}-{len(list(out.parent.glob(f'{out.name}-*.log')))}.log")
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env), log


def finish(*started: tuple[subprocess.Popen, Path]) -> None:
    for proc, log in started:
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]


def two_nodes(
    out: Path, base: Path, data: Path, *extra: str, launch: str = "ddp", train: tuple[str, ...] = TRAIN
) -> list[tuple[subprocess.Popen, Path]]:
    """Both nodes of a 2-node run of one process each, started together (node 1 joins node 0's rendezvous)."""
    address = f"127.0.0.1:{free_port()}"
    return [
        start_train(
            out,
            base,
            data,
            "--launch",
            launch,
            "--gpus",
            "1",
            "--nodes",
            "2",
            "--node-rank",
            str(rank),
            "--main-address",
            address,
            *extra,
            train=train,
        )
        for rank in (0, 1)
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def two_node_run(tiny_base_dirs, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two-nodes") / "run"
    finish(*two_nodes(out, tiny_base_dirs("llama"), data))
    return out


def test_two_nodes_train_as_one_node_of_two_processes(tiny_base_dirs, data, two_node_run, tmp_path):
    """Two launches of one process each (--nodes 2, ranks 0 and 1, rendezvous at 127.0.0.1) give the losses
    (rel 1e-4) and adapter (atol 1e-5) of one launch of two processes (--gpus 2), the same global batch."""
    one_node = tmp_path / "one-node"
    finish(
        start_train(
            one_node,
            tiny_base_dirs("llama"),
            data,
            "--launch",
            "ddp",
            "--gpus",
            "2",
            "--main-address",
            f"127.0.0.1:{free_port()}",
        )
    )
    for folder in (two_node_run, one_node):
        resolved = json.loads((folder / "recipe.resolved.json").read_text())
        assert resolved["world_size"] == 2 and resolved["distributed_type"].endswith("MULTI_CPU")
    steps, losses = logged_losses(two_node_run)
    assert steps == list(range(1, STEPS + 1))
    assert losses == pytest.approx(logged_losses(one_node)[1], rel=1e-4)
    assert_same_weights(
        one_node / "adapter" / "adapter_model.safetensors",
        two_node_run / "adapter" / "adapter_model.safetensors",
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.slow  # 2 min: two launches killed and started again; test_recipes' kill-and-resume runs in make test
def test_two_nodes_killed_after_a_checkpoint_resume_to_the_uninterrupted_run(
    tiny_base_dirs, data, two_node_run, tmp_path
):
    """Both nodes killed (SIGKILL, every process of both launches) once a checkpoint is complete, then both started
    again with --resume: the adapter and losses of the run that was never interrupted."""
    killed, base = tmp_path / "killed", tiny_base_dirs("llama")
    started = two_nodes(killed, base, data)
    deadline = time.monotonic() + 600
    while latest_checkpoint(killed) is None:
        assert time.monotonic() < deadline and all(proc.poll() is None for proc, _ in started), "\n".join(
            log.read_text()[-3000:] for _, log in started
        )
        time.sleep(0.02)
    processes = [psutil.Process(proc.pid) for proc, _ in started]
    for process in [child for parent in processes for child in parent.children(recursive=True)][::-1] + processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    for proc, _ in started:
        proc.wait(timeout=60)
    reached = checkpoint_step(latest_checkpoint(killed))
    assert reached < STEPS and not (killed / "adapter").exists(), "the run ended before the kill"
    resumed = two_nodes(killed, base, data, "--resume")
    finish(*resumed)
    assert all(f"resuming from {killed / 'checkpoints'}" in log.read_text() for _, log in resumed)
    assert_resumed_as_uninterrupted(two_node_run, killed, list(range(1, STEPS + 1)))


@pytest.mark.slow  # 1.5 min: DeepSpeed's start, twice; `make test-slow` runs it
def test_ulysses_group_spanning_two_nodes_equals_one_process(tiny_base_dirs, data, tmp_path):
    """--launch ulysses on two one-process nodes: DeepSpeed started by torchrun on each node, one sequence-parallel
    group of both (each sequence split across the nodes, heads exchanged all-to-all): the losses (rel 1e-3) and
    adapter (atol 1e-4) of one process with the same global batch. Sequences are padded to 256 tokens (gloo gathers
    only equal shapes across the group)."""
    base, out = tiny_base_dirs("llama"), tmp_path / "ulysses"
    train = (
        "data.max_length=256",
        "train.max_steps=2",
        "train.global_batch_size=1",
        "train.per_device_batch_size=1",
        "trl.pad_to_multiple_of=256",
    )
    finish(*two_nodes(out, base, data, launch="ulysses", train=train))
    resolved = json.loads((out / "recipe.resolved.json").read_text())
    assert resolved["distributed_type"].endswith("DEEPSPEED") and resolved["world_size"] == 2
    assert resolved["effective_global_batch_size"] == 1  # both nodes read the same sequence
    single = run(
        load_recipe(
            "tiny-cpu", [f"model.name_or_path={base}", f"data.source={data}", f"output_dir={tmp_path / 'one'}", *train]
        )
    )
    assert logged_losses(out)[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-3)
    assert_same_weights(
        single.adapter_dir / "adapter_model.safetensors",
        out / "adapter" / "adapter_model.safetensors",
        atol=1e-4,
        rtol=1e-3,
    )
