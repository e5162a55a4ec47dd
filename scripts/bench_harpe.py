"""HARPE per-head RoPE vs standard RoPE: training-step time and peak memory, as ratios.

Same model (Llama-shaped, multi-head like Llama-2, hidden 512, 4 layers, head_dim 64), same batch,
LoRA r=8 on q/k/v/o with AdamW, SDPA attention. Time: the two variants' steps are interleaved in
one process (so machine load hits both alike) and the medians compared. Memory: each variant runs
in a fresh process; on CPU the figure is the peak resident memory above the built model
(ru_maxrss), on CUDA ``torch.cuda.max_memory_allocated`` above the built model. Resident memory
on a busy CPU is noisy, so the bench also reports the deterministic size of the tensors autograd
saves for the backward (``saved_activation_ratio``).

    python scripts/bench_harpe.py [--seq-len 1024] [--batch 1] [--steps 5] [--device cpu]

Target: time_ratio and peak_mem_ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def build(variant: str, args: argparse.Namespace):
    """The benchmark model (LoRA-wrapped, train mode) with standard or per-head RoPE."""
    import torch
    from peft import LoraConfig, get_peft_model

    from longpeft.adapters.harpe import apply_head_bases, uniform_bases
    from longpeft.tiny import tiny_model

    model = tiny_model(
        "llama-mha",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=args.seq_len,
        vocab_size=4096,
        attn_implementation="sdpa",
    ).to(args.device)
    if variant == "harpe":
        apply_head_bases(model, uniform_bases(1e4, 1e6, model.config.num_key_value_heads))
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optimizer


def train_step(model, optimizer, ids) -> float:
    """One forward + backward + AdamW step; returns the loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _batch(args: argparse.Namespace):
    import torch

    return torch.randint(0, 4096, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)).to(
        args.device
    )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step of both variants, steps interleaved (after one warm-up step each)."""
    from tqdm.auto import tqdm

    runs = {variant: build(variant, args) for variant in ("rope", "harpe")}
    ids = _batch(args)
    times: dict[str, list[float]] = {"rope": [], "harpe": []}
    for model, optimizer in runs.values():
        train_step(model, optimizer, ids)
    for _ in tqdm(range(args.steps), desc="interleaved steps", unit="pair"):
        for variant, (model, optimizer) in runs.items():
            _sync(args.device)
            start = time.perf_counter()
            train_step(model, optimizer, ids)
            _sync(args.device)
            times[variant].append(time.perf_counter() - start)
    return times


def memory_worker(variant: str, args: argparse.Namespace) -> float:
    """Peak memory (MiB) of two training steps above the built model, in this (fresh) process."""
    import torch

    model, optimizer = build(variant, args)
    ids = _batch(args)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(2):
            train_step(model, optimizer, ids)
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        train_step(model, optimizer, ids)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def saved_activation_mib(variant: str, args: argparse.Namespace) -> float:
    """MiB of distinct tensor storages autograd keeps for the backward of one training forward.

    Deterministic (unlike resident memory on a shared CPU); parameters are not counted.
    """
    import torch

    model, _ = build(variant, args)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(input_ids=_batch(args), labels=_batch(args)).loss
    loss.backward()
    return sum(storages.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory-worker", choices=["rope", "harpe"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        print(json.dumps({"peak_mib": memory_worker(args.memory_worker, args)}))
        return

    memory = {}
    for variant in ("rope", "harpe"):
        command = [
            sys.executable,
            __file__,
            "--memory-worker",
            variant,
            "--seq-len",
            str(args.seq_len),
            "--batch",
            str(args.batch),
            "--device",
            args.device,
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        memory[variant] = json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]
    saved = {variant: saved_activation_mib(variant, args) for variant in ("rope", "harpe")}
    times = time_interleaved(args)
    median = {variant: statistics.median(values) for variant, values in times.items()}

    print(
        f"\nLoRA training step, Llama-shaped 4 x 512 (8 heads x 64), batch {args.batch} x {args.seq_len} tokens, "
        f"{args.device}"
    )
    print(f"{'variant':<14}{'median s/step':>15}{'peak MiB over model':>22}{'saved for backward MiB':>25}")
    for variant, label in (("rope", "standard RoPE"), ("harpe", "HARPE")):
        print(f"{label:<14}{median[variant]:>15.3f}{memory[variant]:>22.1f}{saved[variant]:>25.1f}")
    print(
        json.dumps(
            {
                "bench": "harpe",
                "seq_len": args.seq_len,
                "batch": args.batch,
                "device": args.device,
                "time_ratio": round(median["harpe"] / median["rope"], 3),
                "peak_mem_ratio": round(memory["harpe"] / memory["rope"], 3),
                "saved_activation_ratio": round(saved["harpe"] / saved["rope"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
