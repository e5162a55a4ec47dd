"""Benchmark: Activation Beacon's peak memory and throughput at 32x its window over 1x, beside the stock model.

A small Llama-shaped model (hidden 512, 8 query / 2 KV heads of 64 dims, MLP 1376, 4 layers, a
32K vocabulary, 2048 positions) reads a prompt of 1x and of 32x the beacon window (128 and 4096
tokens) the way ``generate`` prefills it: one logit kept, no gradient. The window is a quarter of
the hidden size, as Llama-3-8B's 1024 is of 4096, so attention over the memory weighs what it weighs
there. Beacons condense each window at a fixed ratio 8 (so both lengths pay the same beacon
overhead per token); the stock model reads the same prompts with full attention. Both run in one
process on the same inputs; time is the median of the repeats; a forward's memory is the largest
amount of tensor memory it holds beyond what was held before it (CPU: from torch.profiler's
allocation events; CUDA: torch.cuda.max_memory_allocated). Peak memory, as in the paper's Table 3,
is the model's weights plus that; the forward's own memory ratio is printed too.

Decoding is timed too: ``generate`` greedy after the long prompt, the time of ``--new-tokens`` more tokens
(the run with them minus the run with one), per token, beacon over stock.

Parallel windows: the long prompt's prefill with ``--parallel-windows`` windows per forward of the decoder stack
against one window per forward (``parallel_windows: 1``), on the same model and prompt, alternating, median of the
repeats: the speed-up is sequential time over parallel time (wall time, and process CPU time, which waiting for a
core on a shared machine does not inflate), and the largest difference of their last-token logits is printed beside
it (the two are exact up to float rounding). The rows above run the config's default.

The adapter size ratio compares the beacon weights saved with ``projection: lora`` (rank = hidden / 128,
the proportion of rank 32 at Llama-3-8B's 4096) and ``projection: full`` for this model, and the same
ratio computed for Llama-3-8B's shapes (q, k, v; rank 32).

    .venv/bin/python scripts/bench_beacon.py [--window 128] [--multiple 32] [--device cpu] [--threads 1]
        [--parallel-windows 4]

Lengths (``--lengths N ...``, in place of the rows above): beacon and stock prefill at each length (peak memory:
weights plus the forward's own; tokens/s; one untimed run first, which is the memory measurement), the peak ratio
of the longest over the shortest, and at the shortest length the beacon's logits over the last window with each
attention kernel against eager (SDPA, and flash-attn when installed on CUDA) and the parallel-window prefill against
one window per forward with each of SDPA and flash-attn (flash-attn reads a parallel group through a 2-D key mask).
``--shape llama3-8b`` builds Llama-3-8B's shape (random bf16 weights on ``--device cuda``; 16 GB) with the
``beacon-llama3-8b-instruct`` recipe's layout (window 1024, sink 1, beacon copies of q, k, v) at ratio 8.
``--report FILE`` writes the JSON after each length and check (a run stopped at a time limit keeps what ended):

    python3 scripts/bench_beacon.py --shape llama3-8b --device cuda --lengths 8192 32768 65536 131072 --repeats 1

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from longpeft.adapters.beacon import (
    BeaconConfig,
    apply_beacon,
    beacons_disabled,
    save_beacon_weights,
    set_inference_settings,
)
from longpeft.tiny import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/benchlib.py, also when loaded by path
from benchlib import peak_bytes, timed  # noqa: E402

RATIO = 8
GiB = 1024**3


def build_model(attn: str, device: str, shape: str = "small"):
    """The bench model: ``small`` (the module docstring's; fp32), or ``llama3-8b``: Llama-3-8B's shape and RoPE as
    scripts/gpu_check.py builds it, random bf16 weights made on ``device``."""
    if shape == "small":
        return tiny_model(
            "llama",
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=2048,
            attn_implementation=attn,
        ).to(device)
    from gpu_check import base_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            base_config(tiny=False), dtype=torch.bfloat16, attn_implementation=attn
        )
    return model.eval()


def bench_config(args: argparse.Namespace) -> BeaconConfig:
    """Windows of ``--window`` tokens at ratio 8; with ``--shape llama3-8b`` one sink token too, as the
    beacon-llama3-8b-instruct recipe (its other settings are BeaconConfig's defaults)."""
    return BeaconConfig(window=args.window, ratios=[RATIO], sink=1 if args.shape == "llama3-8b" else 0)


def adapter_bytes(attn: str, device: str, window: int, projection: str) -> int:
    """Size of ``beacon_adapter.safetensors`` for the bench model with this projection kind."""
    model = build_model(attn, device)
    rank = {"lora_rank": model.config.hidden_size // 128} if projection == "lora" else {}
    apply_beacon(model, BeaconConfig(window=window, ratios=[RATIO], projection=projection, **rank).settings())
    with tempfile.TemporaryDirectory() as folder:
        return save_beacon_weights(model, folder).stat().st_size


def decode_seconds_per_token(model, prompt: torch.Tensor, new_tokens: int, repeats: int, stock: bool) -> float:
    """Median seconds per greedy token that ``generate`` decodes after ``prompt`` (the prefill and first token
    subtracted: a run with ``1 + new_tokens`` tokens minus a run with one)."""

    def generate(n: int):
        def run():
            with beacons_disabled(model) if stock else contextlib.nullcontext():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        return run

    timed(generate(2))  # warm-up
    one = statistics.median(timed(generate(1)) for _ in range(repeats))
    more = statistics.median(timed(generate(1 + new_tokens)) for _ in range(repeats))
    return (more - one) / new_tokens


class ParallelPrefill(NamedTuple):
    """One prefill with one window per forward against ``windows`` per forward: medians of wall seconds and of
    process CPU seconds (steadier on a shared machine: time spent waiting for a core does not count), and the
    largest difference of their last-token logits."""

    windows: int
    sequential_s: float
    parallel_s: float
    sequential_cpu_s: float
    parallel_cpu_s: float
    max_logit_diff: float


def parallel_prefill(model, prompt: torch.Tensor, windows: int, repeats: int) -> ParallelPrefill:
    """Time the prefill of ``prompt`` with one window per forward and with ``windows``, alternating, ``repeats``
    times each after a warm-up; the model is left with the setting it had."""
    before = model.model.beacon_settings.parallel_windows
    logits, wall, cpu = {}, {1: [], windows: []}, {1: [], windows: []}

    def prefill(count: int) -> None:
        set_inference_settings(model, parallel_windows=count)

        def run():
            logits[count] = model(prompt, logits_to_keep=1).logits

        started = time.process_time()
        wall[count].append(timed(run))
        cpu[count].append(time.process_time() - started)

    for count in wall:  # warm-up
        prefill(count)
        wall[count].clear()
        cpu[count].clear()
    for _ in range(repeats):
        for count in wall:
            prefill(count)
    set_inference_settings(model, parallel_windows=before)
    median = statistics.median
    return ParallelPrefill(
        windows,
        median(wall[1]),
        median(wall[windows]),
        median(cpu[1]),
        median(cpu[windows]),
        (logits[1] - logits[windows]).abs().max().item(),
    )


def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def kernel_check(model, prompt: torch.Tensor, kernels: list[str], keep: int) -> dict:
    """The beacon's logits over the last ``keep`` tokens of ``prompt`` with each attention kernel against eager:
    the largest difference, and allclose at bf16 tolerance (atol = rtol = 5e-2). A kernel that fails is reported
    with its error; the model is left with SDPA."""
    logits, result = {}, {"tokens": prompt.shape[1], "logits_kept": keep}
    for kernel in ["eager", *kernels]:
        try:
            model.set_attn_implementation(kernel)
            with torch.no_grad():
                logits[kernel] = model(prompt, logits_to_keep=keep).logits.float()
        except Exception as error:  # a measurement: the report says what failed, the rest goes on
            result[kernel] = {"error": error_text(error)}
    model.set_attn_implementation("sdpa")
    reference = logits.get("eager")
    if reference is not None:
        result["max_abs_logit"] = reference.abs().max().item()
        for kernel in kernels:
            if kernel in logits:
                result[kernel] = {
                    "max_abs_diff": (logits[kernel] - reference).abs().max().item(),
                    "allclose_atol_rtol_5e-2": bool(torch.allclose(logits[kernel], reference, atol=5e-2, rtol=5e-2)),
                }
    return result


def length_sweep(model, args: argparse.Namespace) -> dict:
    """Beacon and stock prefill at each of ``args.lengths`` (peak memory, tokens/s), then the kernel and
    parallel-window checks at the shortest length; the report is written to ``args.report`` after each part."""
    cuda = args.device.startswith("cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    flash = cuda and has_flash_attn()
    report = {
        "bench": "beacon-lengths",
        "shape": args.shape,
        "window": args.window,
        "ratio": RATIO,
        "sink": model.model.beacon_settings.sink,
        "attn": args.attn,
        "device": args.device,
        "dtype": str(next(model.parameters()).dtype),
        "weights_gib": weights / GiB,
        "parallel_windows": model.model.beacon_settings.parallel_windows,
        "repeats": args.repeats,
        "flash_attn_installed": has_flash_attn(),
        "lengths": {},
    }

    def save() -> None:
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=2) + "\n")

    generator = torch.Generator().manual_seed(0)
    prompts = {
        n: torch.randint(7, model.config.vocab_size, (1, n), generator=generator).to(args.device) for n in args.lengths
    }
    print(
        f"Activation Beacon ({args.shape}, window {args.window}, ratio {RATIO}, attn={args.attn}, "
        f"device={args.device}) vs stock: weights {weights / GiB:.2f} GiB, median of {args.repeats}"
    )
    print(f"{'tokens':>7} {'variant':<7} {'forward GiB':>12} {'peak GiB':>9} {'tokens/s':>10}")
    for length in args.lengths:
        row = report["lengths"][str(length)] = {}
        for variant in ("beacon", "stock"):

            def run(prompt=prompts[length], stock=variant == "stock"):
                with beacons_disabled(model) if stock else contextlib.nullcontext():
                    return model(prompt, logits_to_keep=1, use_cache=True)

            try:
                memory = peak_bytes(run, cuda)  # the first run: its memory, and the warm-up of the timed ones
                seconds = statistics.median(timed(run) for _ in range(args.repeats))
            except Exception as error:  # e.g. out of memory: the report says so, the rest goes on
                row[variant] = {"error": error_text(error)}
                print(f"{length:>7} {variant:<7} {row[variant]['error']}")
                continue
            finally:
                if cuda:
                    torch.cuda.empty_cache()
            row[variant] = {
                "forward_gib": memory / GiB,
                "peak_gib": (weights + memory) / GiB,
                "seconds": seconds,
                "tokens_per_s": length / seconds,
            }
            print(
                f"{length:>7} {variant:<7} {memory / GiB:>12.3f} {(weights + memory) / GiB:>9.2f} "
                f"{length / seconds:>10.0f}"
            )
        if "error" not in row["beacon"] and "error" not in row["stock"]:
            row["beacon_over_stock_tokens_per_s"] = row["beacon"]["tokens_per_s"] / row["stock"]["tokens_per_s"]
        save()
    shortest, longest = (report["lengths"][str(n)] for n in (min(args.lengths), max(args.lengths)))
    for variant in ("beacon", "stock"):
        if "error" not in shortest[variant] and "error" not in longest[variant]:
            report[f"{variant}_peak_ratio"] = longest[variant]["peak_gib"] / shortest[variant]["peak_gib"]
            print(
                f"{variant}: peak memory at {max(args.lengths)} over {min(args.lengths)} tokens "
                f"{report[f'{variant}_peak_ratio']:.3f}"
            )
    save()
    kernels = ["sdpa", "flash_attention_2"] if flash else ["sdpa"]
    prompt = prompts[min(args.lengths)]
    report["kernels"] = kernel_check(model, prompt, kernels, min(args.window, prompt.shape[1]))
    for kernel in kernels:
        check = report["kernels"].get(kernel, {})
        print(
            f"beacon logits, {kernel} vs eager at {prompt.shape[1]} tokens: "
            + (check["error"] if "error" in check else f"max |diff| {check.get('max_abs_diff', float('nan')):.3g}")
        )
    save()
    report["parallel"] = {}
    for kernel in kernels:
        try:
            model.set_attn_implementation(kernel)
            result = parallel_prefill(model, prompt, args.parallel_windows, args.repeats)
            report["parallel"][kernel] = {**result._asdict(), "speedup": result.sequential_s / result.parallel_s}
            print(
                f"parallel prefill with {kernel}: {result.windows} windows per forward {result.parallel_s:.3f} s, "
                f"one per forward {result.sequential_s:.3f} s; last-token logits differ by at most "
                f"{result.max_logit_diff:.1e}"
            )
        except Exception as error:  # the report says which kernel failed and why
            report["parallel"][kernel] = {"error": error_text(error)}
            print(f"parallel prefill with {kernel}: {report['parallel'][kernel]['error']}")
        finally:
            model.set_attn_implementation("sdpa")
        save()
    if not flash:
        report["flash_attn_skipped"] = "flash-attn is not installed" if cuda else "flash-attn needs CUDA"
    save()
    return report


def llama3_8b_lora_over_full(rank: int = 32) -> float:
    """Beacon parameters of Llama-3-8B (hidden 4096, 32 layers, 1024-dim k/v) on q, k, v: lora(rank) over full."""
    hidden, kv, layers = 4096, 1024, 32
    full = layers * (hidden * hidden + 2 * hidden * kv) + hidden
    lora = layers * (rank * (hidden + hidden) + 2 * rank * (hidden + kv)) + hidden
    return lora / full


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        default="small",
        choices=["small", "llama3-8b"],
        help="small: the CPU bench model; llama3-8b: Llama-3-8B's shape in bf16 (CUDA, 16 GB)",
    )
    parser.add_argument("--window", type=int, help="beacon window (default: 128; 1024 with --shape llama3-8b)")
    parser.add_argument("--multiple", type=int, default=32, help="the long prompt is this many windows")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        metavar="TOKENS",
        help="prefill at each of these lengths instead (beacon and stock), and the kernel and "
        "parallel-window checks at the shortest",
    )
    parser.add_argument("--report", help="with --lengths: also write the JSON here, after each length and check")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 gives steadier ratios on a shared machine)"
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens timed after the long prompt")
    parser.add_argument(
        "--parallel-windows",
        type=int,
        default=BeaconConfig().parallel_windows,
        help="windows per forward in the parallel prefill, timed against one (default: the config's)",
    )
    args = parser.parse_args(argv)
    args.window = args.window or (1024 if args.shape == "llama3-8b" else 128)
    if args.parallel_windows < 2:
        parser.error(f"--parallel-windows {args.parallel_windows}: give 2 or more (it is timed against 1)")
    if args.shape == "llama3-8b" and not args.device.startswith("cuda"):
        parser.error("--shape llama3-8b needs --device cuda (16 GB of bf16 weights)")
    if args.lengths and min(args.lengths) < args.window:
        parser.error(f"--lengths {min(args.lengths)}: give lengths of at least the window ({args.window} tokens)")
    if args.report and not args.lengths:
        parser.error("--report goes with --lengths")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.attn, args.device, args.shape).eval()
    apply_beacon(model, bench_config(args).settings())
    if args.lengths:
        print(json.dumps(length_sweep(model, args)))
        return 0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    lengths = {"1x": args.window, f"{args.multiple}x": args.window * args.multiple}
    prompts = {k: torch.randint(7, 32000, (1, n), device=args.device) for k, n in lengths.items()}

    def forward(variant: str, length: str):
        def run():
            if variant == "stock":
                with beacons_disabled(model):
                    return model(prompts[length], logits_to_keep=1, use_cache=True)
            return model(prompts[length], logits_to_keep=1)

        return run

    runs = [(v, k) for v in ("beacon", "stock") for k in lengths]
    for run in runs:  # warm-up
        timed(forward(*run))
    times = {run: [] for run in runs}
    for _ in range(args.repeats):
        for run in runs:
            times[run].append(timed(forward(*run)))
    cuda = args.device.startswith("cuda")
    memory = {run: peak_bytes(forward(*run), cuda) for run in runs}
    speed = {run: lengths[run[1]] / statistics.median(times[run]) for run in runs}
    long = f"{args.multiple}x"

    def ratios(variant: str) -> tuple[float, float, float]:
        short_mem, long_mem = memory[(variant, "1x")], memory[(variant, long)]
        return (
            (weights + long_mem) / (weights + short_mem),
            long_mem / short_mem,
            speed[(variant, long)] / speed[(variant, "1x")],
        )

    decode = {
        variant: decode_seconds_per_token(model, prompts[long], args.new_tokens, args.repeats, variant == "stock")
        for variant in ("beacon", "stock")
    }
    parallel = parallel_prefill(model, prompts[long], args.parallel_windows, args.repeats)
    sizes = {kind: adapter_bytes(args.attn, args.device, args.window, kind) for kind in ("full", "lora")}
    print(
        f"Activation Beacon (window {args.window}, ratio {RATIO}, {model.model.beacon_settings.parallel_windows} "
        f"parallel windows) vs stock, attn={args.attn}, device={args.device}, "
        f"threads={torch.get_num_threads()}, weights {weights / 2**20:.1f} MiB, median of {args.repeats}"
    )
    print(f"{'variant':<8} {'tokens':>7} {'forward MiB':>12} {'peak MiB':>9} {'tokens/s':>10}")
    for variant, length in runs:
        mem = memory[(variant, length)]
        print(
            f"{variant:<8} {lengths[length]:>7} {mem / 2**20:>12.1f} {(weights + mem) / 2**20:>9.1f} "
            f"{speed[(variant, length)]:>10.0f}"
        )
    beacon, stock = ratios("beacon"), ratios("stock")
    print(f"{long} over 1x      peak memory   forward memory   throughput")
    print(f"beacon        {beacon[0]:>11.3f} {beacon[1]:>16.3f} {beacon[2]:>12.3f}")
    print(f"stock         {stock[0]:>11.3f} {stock[1]:>16.3f} {stock[2]:>12.3f}")
    print(
        f"decoding after {lengths[long]} tokens: beacon {decode['beacon'] * 1e3:.2f} ms/token, stock "
        f"{decode['stock'] * 1e3:.2f} ms/token (beacon / stock {decode['beacon'] / decode['stock']:.3f})"
    )
    speedup = parallel.sequential_s / parallel.parallel_s
    cpu_speedup = parallel.sequential_cpu_s / parallel.parallel_cpu_s
    print(
        f"prefill of {lengths[long]} tokens: one window per forward {parallel.sequential_s:.3f} s "
        f"(CPU {parallel.sequential_cpu_s:.3f} s), {parallel.windows} windows per forward "
        f"{parallel.parallel_s:.3f} s (CPU {parallel.parallel_cpu_s:.3f} s): speed-up {speedup:.3f} (CPU time "
        f"{cpu_speedup:.3f}); last-token logits differ by at most {parallel.max_logit_diff:.1e}"
    )
    print(
        f"beacon adapter: full {sizes['full'] / 2**20:.2f} MiB, lora {sizes['lora'] / 2**20:.2f} MiB; "
        f"Llama-3-8B q,k,v lora r32 / full = {llama3_8b_lora_over_full():.4f}"
    )
    result = {
        "bench": "beacon",
        "window": args.window,
        "ratio": RATIO,
        "long_tokens": lengths[long],
        "attn": args.attn,
        "device": args.device,
        "peak_mem_ratio": round(beacon[0], 3),
        "stock_peak_mem_ratio": round(stock[0], 3),
        "forward_mem_ratio": round(beacon[1], 3),
        "stock_forward_mem_ratio": round(stock[1], 3),
        "throughput_ratio": round(beacon[2], 3),
        "stock_throughput_ratio": round(stock[2], 3),
        "decode_ms_per_token": round(decode["beacon"] * 1e3, 3),
        "stock_decode_ms_per_token": round(decode["stock"] * 1e3, 3),
        "decode_time_ratio": round(decode["beacon"] / decode["stock"], 3),
        "parallel_windows": parallel.windows,
        "parallel_prefill_speedup": round(speedup, 3),
        "parallel_prefill_cpu_speedup": round(cpu_speedup, 3),
        "parallel_prefill_s": round(parallel.parallel_s, 4),
        "sequential_prefill_s": round(parallel.sequential_s, 4),
        "parallel_max_logit_diff": float(f"{parallel.max_logit_diff:.2e}"),
        "lora_full_size_ratio": round(sizes["lora"] / sizes["full"], 4),
        "llama3_8b_lora_full_size_ratio": round(llama3_8b_lora_over_full(), 4),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
