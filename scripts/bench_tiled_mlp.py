"""Benchmark: the tiled MLP's peak activation memory and time in training, as ratios of the untiled MLP's.

A Llama MLP (hidden 512, intermediate 1792: Llama-3-8B's ratio 3.5) on one sequence of ``--seq-len`` tokens
(16,384), float32 on CPU: one forward and backward to its input, untiled and tiled ``--tile`` (1,024) tokens at a
time (longpeft/scale/tiling.py); then the same for a whole decoder layer of that shape under activation
checkpointing (input, attention and MLP: the layer's recompute, whose peak the tiling lowers). Both variants run in
one process on the same input. Peak memory is the largest amount of tensor memory held during the call beyond what
was held before it (reconstructed from torch.profiler's allocation events on CPU; torch.cuda's allocator on CUDA);
time is the median of ``--repeats`` calls. The two share their weights, so the gradients are compared too.

    .venv/bin/python scripts/bench_tiled_mlp.py [--seq-len 16384] [--tile 1024] [--threads 2]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from longpeft.scale.tiling import apply_tiled_mlp, remove_tiled_mlp
from longpeft.tiny import tiny_model

from benchlib import peak_bytes  # scripts/benchlib.py


def forward_backward(module, x):
    """A closure: ``module``'s forward on a fresh copy of ``x`` (requiring grad) and the backward of its sum;
    returns the input's gradient."""

    def run():
        inputs = x.detach().requires_grad_(True)
        output = module(inputs)
        output = output[0] if isinstance(output, tuple) else output
        output.float().sum().backward()
        return inputs.grad

    return run


def measure(run, repeats: int, cuda: bool) -> tuple[int, float, torch.Tensor]:
    """Peak bytes, median seconds and the result of ``run``."""
    peak = peak_bytes(run, cuda, grad=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    model = tiny_model(
        "llama",
        seed=0,
        attn_implementation="sdpa",
        hidden_size=512,
        intermediate_size=1792,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    ).to(args.device)
    model.train()
    layer = model.model.layers[0]
    x = torch.randn(1, args.seq_len, 512, generator=torch.Generator().manual_seed(0)).to(args.device)
    positions = torch.arange(args.seq_len, device=args.device)[None]
    rotary = model.model.rotary_emb(x, positions)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def checkpointed_layer(hidden):
        return layer(hidden, position_embeddings=rotary, position_ids=positions)

    rows, result = [], {"bench": "tiled_mlp", "seq_len": args.seq_len, "tile": args.tile, "device": args.device}
    for part, module in (("mlp", layer.mlp), ("checkpointed layer", checkpointed_layer)):
        peak, seconds, grad = measure(forward_backward(module, x), args.repeats, cuda)
        apply_tiled_mlp(model, args.tile)
        tiled_peak, tiled_seconds, tiled_grad = measure(forward_backward(module, x), args.repeats, cuda)
        remove_tiled_mlp(model)
        difference = (tiled_grad - grad).abs().max().item()
        rows.append((part, peak, tiled_peak, seconds, tiled_seconds, difference))
        key = part.replace(" ", "_")
        result[f"{key}_peak_mem_ratio"] = tiled_peak / peak
        result[f"{key}_time_ratio"] = tiled_seconds / seconds
        result[f"{key}_max_abs_grad_diff"] = difference
    print(
        f"{'part':<20} {'peak MiB':>9} {'tiled':>9} {'ratio':>6} {'s':>7} {'tiled s':>8} {'ratio':>6} "
        f"{'|grad diff|':>12}"
    )
    for part, peak, tiled_peak, seconds, tiled_seconds, difference in rows:
        print(
            f"{part:<20} {peak / 2**20:>9.1f} {tiled_peak / 2**20:>9.1f} {tiled_peak / peak:>6.2f} {seconds:>7.3f} "
            f"{tiled_seconds:>8.3f} {tiled_seconds / seconds:>6.2f} {difference:>12.2e}"
        )
    result["peak_mem_ratio"], result["time_ratio"] = result["mlp_peak_mem_ratio"], result["mlp_time_ratio"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
