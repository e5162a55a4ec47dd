"""The 80K recipe on a real GPU, without downloads: peak memory and tokens/s beside the planner's estimate,
and the HARPE and STRING flash-attn paths against their SDPA paths.

1. Writes a random-weight Llama-3-8B-shaped base (shape from the planner's table of known bases; bf16 safetensors,
   built on the GPU) and one long conversation per step, in the demo tokenizer's words, at ``--tokens`` tokens
   (81,920).
2. Trains it with the 80K recipe (``llama3-8b-instruct-80k-qlora``: NF4 base, LoRA r32 on q/k/v/o, the full
   embedding trained, RoPE base 2e8, assistant-only loss through TRL's fused LM head, gradient checkpointing),
   one sample per optimizer step, through longpeft's own runner: once per attention kernel (flash-attn when
   installed, and SDPA), each in a fresh process so its peak memory is its own.
3. Compares with ``longpeft.scale.estimate`` on one GPU, per kernel: peak memory and step time (the planner's
   FLOPs at its utilisations for the matmuls and for that attention kernel). ``--set KEY=VALUE`` changes the
   recipe for both (e.g. ``model.load_in_4bit=false``, ``train.activation_offloading=true``); ``env.NAME=VALUE``
   sets an environment variable for the training run's process only (e.g.
   ``env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; an empty value removes it). On CUDA it also records
   which kernels torch's SDPA runs (``sdpa_kernels``) and, at each step's end, what torch's caching allocator
   holds per CUDA stream (each stream has its own pool: ``step_memory[].pools``, from ``torch.cuda.memory_snapshot``),
   with its retries after a failed allocation and its inactive split blocks, so a reserved peak far above the
   allocated one says whose pool holds the cache.
4. Builds a small Llama-3-like model twice, SDPA and flash-attn, with the same weights, and compares the logits
   with HARPE per-head bases and with STRING on (max abs difference, and allclose at bf16 tolerance).

The last line printed is one JSON object (``--report FILE`` also writes it after each part, so a call stopped at a
time limit keeps what finished). ``--no-train`` runs only the checks of step 4 (and ``--liger-check``). Without
CUDA it stops with a message; ``--tiny`` runs the same code on a tiny model on CPU in seconds (SDPA only; the kernel
comparison is SDPA against eager there). Without flash-attn on a CUDA machine it trains with SDPA only and compares
SDPA against eager (``kernels.flash_attn_installed: false``). ``scripts/gpu_session.sh`` runs it, with the other
GPU checks, as a lent machine's calls allow.

    python scripts/gpu_check.py                 # on a CUDA machine (about 16 GB of disk for the random base)
    python scripts/gpu_check.py --tiny          # anywhere, seconds

On a lent GPU machine with short calls, keep the base between calls and train one kernel per call:

    python scripts/gpu_check.py --work-dir /tmp/gc --attentions sdpa --no-kernel-check --report $OUT/sdpa.json
    python scripts/gpu_check.py --work-dir /tmp/gc --attentions flash_attention_2 --report $OUT/flash.json

The packages the GPU image lacks travel as wheels: ``scripts/gpu_wheels.sh`` downloads them and prints the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

RECIPE = "llama3-8b-instruct-80k-qlora"
BASE_ID = "meta-llama/Meta-Llama-3-8B-Instruct"  # its shape, from longpeft.scale.plan.KNOWN_SHAPES
GiB = 1024**3


def base_config(tiny: bool):
    """The base's transformers config: Llama-3-8B's shape (or the tiny test model's), Llama-3's RoPE and ids."""
    from longpeft.scale.plan import KNOWN_SHAPES
    from longpeft.tiny import tiny_config

    if tiny:
        return tiny_config("llama", attn_implementation="sdpa")
    shape = KNOWN_SHAPES[BASE_ID]
    return tiny_config(
        "llama",
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        tie_word_embeddings=shape["tied"],
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
        pad_token_id=None,
        attn_implementation="sdpa",
    )


def write_base(folder: Path, tiny: bool) -> None:
    """Random weights (seeded) in bf16 (fp32 for the tiny CPU model), built on the device, and the demo tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from longpeft.tiny import demo_tokenizer

    device = "cpu" if tiny else "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(base_config(tiny), dtype=torch.float32 if tiny else torch.bfloat16)
    model.save_pretrained(folder)
    demo_tokenizer().save_pretrained(folder)
    del model
    if not tiny:
        torch.cuda.empty_cache()


def write_data(path: Path, base: Path, tokens: int, samples: int) -> int:
    """``samples`` copies of one conversation of at most ``tokens`` tokens (a long user turn, a short answer), so
    that every step runs at the measured length (conversations drawn with other seeds tokenize to other lengths:
    longer ones were dropped, shorter ones inflated tokens/s); returns the length."""
    import random

    from transformers import AutoTokenizer

    from longpeft.synth_data.corpus import corpus_texts

    tokenizer = AutoTokenizer.from_pretrained(base)
    words = " ".join(corpus_texts(n=40, seed=0)).split()

    def conversation(n_words: int, seed: int) -> list[dict[str, str]]:
        rng = random.Random(seed)
        text = " ".join(rng.choice(words) for _ in range(n_words))
        return [
            {"role": "user", "content": f"{text}\nWhat is the first word?"},
            {"role": "assistant", "content": text.split()[0]},
        ]

    def length(n_words: int) -> int:
        return len(
            tokenizer.apply_chat_template(conversation(n_words, 0), tokenize=True, return_dict=True)["input_ids"]
        )

    low, high = 1, tokens  # every word is at least one token: the longest conversation within `tokens`
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if length(middle) <= tokens else (low, middle - 1)
    with path.open("w") as handle:
        for _ in range(samples):
            handle.write(json.dumps({"messages": conversation(low, 0)}) + "\n")
    return length(low)


def recipe_for(
    base: Path, data: Path, out: Path, attention: str, tokens: int, steps: int, tiny: bool, extra: list[str] = ()
):
    """The 80K recipe at this length and kernel; ``extra`` (``--set KEY=VALUE``) overrides last."""
    from longpeft.recipes.schema import load_recipe

    overrides = [
        f"model.name_or_path={base}",
        f"data.source={data}",
        f"data.max_length={tokens}",
        f"target_length={tokens}",
        f"rope.max_position_embeddings={max(tokens, 81920)}",
        f"model.attn_implementation={attention}",
        f"train.max_steps={steps}",
        "train.global_batch_size=1",
        "train.per_device_batch_size=1",
        "train.save_steps=1000000",
        f"output_dir={out}",
    ]
    if tiny:
        # bitsandbytes' CPU 4-bit path computes in fp32; the tiny tokenizer's eos ids are its own
        overrides += ["model.dtype=float32", "model.eos_token_ids=null"]
    return load_recipe(RECIPE, overrides + list(extra))


def measure(args: argparse.Namespace) -> dict:
    """One training run (in this process): peak memory, step times, losses."""
    import torch
    from transformers import TrainerCallback

    from longpeft.recipes.runner import run

    class StepTimer(TrainerCallback):
        """Each step's time, and on CUDA the memory allocated when it begins (weights and optimizer state: what
        stays between steps) and its own allocated and reserved peaks."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.memory: list[dict[str, float]] = []

        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.memory.append({"allocated_at_begin_gib": torch.cuda.memory_allocated() / GiB})
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                stats = torch.cuda.memory_stats()
                self.memory[-1].update(
                    peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
                    pools=pools_by_stream(torch.cuda.memory_snapshot(), torch.cuda.current_stream().cuda_stream),
                    alloc_retries=stats.get("num_alloc_retries", 0),
                    inactive_split_gib=stats.get("inactive_split_bytes.all.current", 0) / GiB,
                )
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    recipe = recipe_for(
        Path(args.base), Path(args.data), Path(args.out), args.measure, args.tokens, args.steps, args.tiny, args.set
    )
    result = run(recipe, callbacks=[timer])
    losses = [
        r["loss"]
        for r in map(json.loads, (result.output_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    timed = timer.times[1:] or timer.times  # the first step warms up kernels and the allocator
    report = {
        "attention": args.measure,
        "step_seconds": timer.times,
        "losses": losses,
        "tokens_per_second": args.tokens / statistics.median(timed),
    }
    resolved = json.loads((result.output_dir / "recipe.resolved.json").read_text())
    report["checkpointing"] = resolved.get("checkpointing")
    report["allocator_config"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if torch.cuda.is_available():  # the peaks of the steps (reset when each begins), and what each step began with
        report.update(
            peak_allocated_gib=max(m["peak_allocated_gib"] for m in timer.memory),
            peak_reserved_gib=max(m["peak_reserved_gib"] for m in timer.memory),
            step_memory=timer.memory,
        )
    return report


def pools_by_stream(segments: list[dict], compute_stream: int) -> dict[str, dict[str, float]]:
    """What the caching allocator holds per CUDA stream, from ``torch.cuda.memory_snapshot()``'s segments (each
    a ``stream`` handle, ``total_size`` and ``allocated_size`` in bytes): reserved and allocated GiB and the number
    of segments, keyed ``compute`` for ``compute_stream`` (the stream the step runs on) and ``stream 0x...`` for
    the others (side streams: a block a side stream allocated serves only that stream's later allocations)."""
    pools: dict[str, dict[str, float]] = {}
    for segment in segments:
        name = "compute" if segment["stream"] == compute_stream else f"stream {segment['stream']:#x}"
        pool = pools.setdefault(name, {"reserved_gib": 0.0, "allocated_gib": 0.0, "segments": 0})
        pool["reserved_gib"] += segment["total_size"] / GiB
        pool["allocated_gib"] += segment["allocated_size"] / GiB
        pool["segments"] += 1
    return pools


def planner(
    base: Path,
    data: Path,
    tokens: int,
    steps: int,
    tiny: bool,
    gpu_memory_gib: float,
    attention: str,
    extra: list[str],
) -> dict:
    """The planner's per-GPU peak and step time for this run (one GPU, one sample per step, this kernel)."""
    import torch

    from longpeft.scale import GPU_PEAK_TFLOPS, estimate, shape_of

    recipe = recipe_for(base, data, base.parent / "plan", attention, tokens, steps, tiny, extra)
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    gpu = next((kind for kind in GPU_PEAK_TFLOPS if kind in name), "h100")
    plan = estimate(recipe, gpus=1, gpu_memory_gib=gpu_memory_gib, gpu=gpu, samples=steps, shape=shape_of(str(base)))
    seconds = plan.hours * 3600 / steps  # one sample of `tokens` per step
    return {
        "gpu": gpu,
        "attention": attention,
        "peak_gib": plan.peak_bytes / GiB,
        "terms_gib": {k: v / GiB for k, v in plan.terms.items()},
        "step_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "utilisation": plan.assumptions["utilisation"],
        "checkpointing": plan.assumptions["checkpointing"],
    }


def sdpa_kernels() -> list[str]:
    """The CUDA kernels that torch's SDPA runs for one causal bf16 forward and backward at Llama-3-8B's head shape
    (which backend it picked: flash, cuDNN, memory-efficient), by the profiler's kernel names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (
        torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(
        n[:120]
        for n in names
        if any(word in n.lower() for word in ("flash", "fmha", "cudnn", "attention", "sdpa", "mem_eff"))
    )


def has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def compare_kernels(tiny: bool) -> dict:
    """HARPE and STRING logits with two attention kernels on the same weights: flash-attn vs SDPA on CUDA (SDPA vs
    eager, and ``flash_attn_installed: false``, on a CUDA machine without flash-attn; SDPA vs eager with
    ``--tiny``)."""
    import torch

    from longpeft.adapters.harpe import apply_head_bases, uniform_bases
    from longpeft.adapters.string import enable_string
    from longpeft.tiny import tiny_model

    if tiny:
        device, dtype, pair, length, shape = "cpu", torch.float32, ("sdpa", "eager"), 200, {}
    else:
        device, dtype, length = "cuda", torch.bfloat16, 8192
        pair = ("sdpa", "flash_attention_2" if has_flash_attn() else "eager")
        shape = dict(
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=4096,
            max_position_embeddings=8192,
        )
    ids = torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    results: dict = {"flash_attn_installed": has_flash_attn()}
    for method in ("harpe", "string"):
        logits = []
        for attention in pair:
            model = tiny_model("llama", seed=0, attn_implementation=attention, **shape).to(device, dtype)
            if method == "harpe":
                apply_head_bases(model, uniform_bases(1e4, 5e6, model.config.num_key_value_heads))
            else:
                enable_string(model, shift=length // 3, local_window=min(128, length // 8))
            with torch.no_grad():
                logits.append(model(ids).logits.float())
            del model
        difference = (logits[0] - logits[1]).abs().max().item()
        results[method] = {
            "kernels": list(pair),
            "tokens": length,
            "max_abs_diff": difference,
            "max_abs_logit": logits[0].abs().max().item(),
            "allclose_atol_rtol_5e-2": bool(torch.allclose(logits[0], logits[1], atol=5e-2, rtol=5e-2)),
        }
    return results


def compare_with_plan(measured: dict, plan: dict, tokens: int, tiny: bool) -> None:
    """Add the planner's errors against one measured run (and the 60 GB target) to ``measured``, in place."""
    if "peak_reserved_gib" in measured:
        measured["planner_peak_error"] = plan["peak_gib"] / measured["peak_reserved_gib"] - 1
        measured["peak_at_most_60_gb"] = measured["peak_reserved_gib"] * GiB <= 60e9
    if "tokens_per_second" in measured and not tiny:
        measured["planner_step_time_error"] = plan["step_seconds"] * measured["tokens_per_second"] / tokens - 1


class Run(NamedTuple):
    """One training run of the check: its report key, attention kernel, recipe overrides, length, steps, and the
    environment variables its process gets (an empty value removes one)."""

    name: str
    attention: str
    overrides: list[str]
    tokens: int
    steps: int
    env: dict[str, str]


def split_env(pairs: list[str]) -> tuple[list[str], dict[str, str]]:
    """``KEY=VALUE`` pairs split into recipe overrides and ``env.NAME=VALUE`` environment variables."""
    overrides, env = [], {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        if key.startswith("env."):
            env[key.removeprefix("env.")] = value
        else:
            overrides.append(pair)
    return overrides, env


def planned_runs(args: argparse.Namespace, attentions: list[str]) -> list[Run]:
    """The runs of this call: one per ``--variant`` when given (``tokens=N`` and ``steps=N`` set its length and
    steps, ``model.attn_implementation=...`` its kernel, ``env.NAME=VALUE`` its process's environment, other
    ``KEY=VALUE`` pairs go to the recipe after ``--set``), else one per attention kernel with ``--set``."""
    common, common_env = split_env(args.set)
    if not args.variant:
        return [Run(attention, attention, common, args.tokens, args.steps, common_env) for attention in attentions]
    runs = []
    for name, *pairs in args.variant:
        overrides, env = split_env(pairs)
        settings = dict(pair.split("=", 1) for pair in overrides)
        tokens, steps = int(settings.pop("tokens", args.tokens)), int(settings.pop("steps", args.steps))
        attention = settings.get("model.attn_implementation", "sdpa")
        runs.append(
            Run(
                name,
                attention,
                common + [f"{k}={v}" for k, v in settings.items()],
                tokens,
                steps,
                {**common_env, **env},
            )
        )
    return runs


def run_environment(env: dict[str, str]) -> dict[str, str]:
    """This process's environment with a run's variables set (an empty value removes the variable)."""
    merged = {**os.environ, **env}
    return {name: value for name, value in merged.items() if not (name in env and value == "")}


def compare_liger() -> dict:
    """Liger's RMSNorm, SwiGLU and RoPE kernels against transformers' on a small Llama-3-like bf16 model on CUDA, as
    ``train.use_liger_kernel`` applies them (no fused loss): max |logit diff| and max |grad diff| of every weight."""
    import importlib.util

    import torch

    from longpeft.tiny import tiny_model

    if not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None:
        return {"ran": False, "reason": "needs CUDA and liger-kernel"}
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    shape = dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=4096,
        max_position_embeddings=8192,
    )
    ids = torch.randint(0, 4000, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    results = []
    for liger in (False, True):
        model = tiny_model("llama", seed=0, attn_implementation="sdpa", **shape).to("cuda", torch.bfloat16)
        if liger:
            _apply_liger_kernel_to_instance(
                model=model,
                rope=True,
                rms_norm=True,
                swiglu=True,
                cross_entropy=False,
                fused_linear_cross_entropy=False,
            )
        logits = model(ids).logits.float()
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
        del model
    (plain, plain_grads), (fused, fused_grads) = results
    grad_diff = max((plain_grads[n] - fused_grads[n]).abs().max().item() for n in plain_grads)
    grad_scale = max(g.abs().max().item() for g in plain_grads.values())
    return {
        "ran": True,
        "tokens": 4096,
        "max_abs_logit_diff": (plain - fused).abs().max().item(),
        "max_abs_logit": plain.abs().max().item(),
        "max_abs_grad_diff": grad_diff,
        "max_abs_grad": grad_scale,
        "allclose_atol_rtol_5e-2": bool(torch.allclose(plain, fused, atol=5e-2, rtol=5e-2)),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (SDPA only): the same code in seconds")
    parser.add_argument("--tokens", type=int, help="tokens per sample (default 81920; --tiny: 1024)")
    parser.add_argument(
        "--steps", type=int, default=3, help="optimizer steps per attention kernel (the first is warm-up)"
    )
    parser.add_argument("--gpu-memory", type=float, help="GiB of the GPU for the planner (default: the device's)")
    parser.add_argument(
        "--work-dir",
        help="where the random base, data and runs go (default: a temporary folder, "
        "removed); kept, the base is written once and later calls reuse it",
    )
    parser.add_argument(
        "--attentions",
        nargs="+",
        choices=["flash_attention_2", "sdpa"],
        help="kernels to train with, each in its own process (default: flash-attn when installed, "
        "and SDPA); one per call keeps each call short",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the training runs and the planner, as `longpeft train --set` "
        "(repeatable), e.g. model.load_in_4bit=false or train.activation_offloading=true; "
        "env.NAME=VALUE sets an environment variable of the training runs' processes only (empty: "
        "removed), e.g. env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    parser.add_argument(
        "--variant",
        action="append",
        nargs="+",
        metavar="NAME [KEY=VALUE ...]",
        help="instead of one run per kernel, a named run with its own overrides (repeatable), e.g. "
        "--variant kept train.keep_attention=auto train.offload_checkpoints=true; tokens=N and "
        "steps=N set its length and steps, env.NAME=VALUE its process's environment",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="start no run that the planner says would end later than this many seconds after the "
        "call began (model load included); skipped runs are reported as such",
    )
    parser.add_argument(
        "--liger-check",
        action="store_true",
        help="also compare Liger's kernels with transformers' on a small bf16 model (CUDA, liger-kernel)",
    )
    parser.add_argument(
        "--no-train",
        dest="train",
        action="store_false",
        help="no training runs (and no random base): only the kernel check and --liger-check",
    )
    parser.add_argument(
        "--no-kernel-check",
        dest="kernel_check",
        action="store_false",
        help="skip the HARPE and STRING kernel comparison",
    )
    parser.add_argument(
        "--report",
        help="also write the report here, updated after each part (a call stopped at its "
        "time limit keeps what finished)",
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one training run in this process
    for internal in ("--base", "--data", "--out"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.tiny else 81920)
    if args.tokens < 64 or args.steps < 1:
        parser.error("--tokens must be >= 64 and --steps >= 1")
    if args.tiny and args.attentions and args.attentions != ["sdpa"]:
        parser.error("--tiny trains with SDPA only (flash-attn needs CUDA)")
    if not args.tiny and "flash_attention_2" in (args.attentions or []) and not has_flash_attn():
        parser.error("--attentions flash_attention_2: flash-attn is not installed (pip install flash-attn)")
    for name, *pairs in args.variant or []:
        bad = [pair for pair in pairs if "=" not in pair or pair.startswith(("=", "env.="))]
        if bad or "=" in name:
            parser.error(f"--variant {name} {' '.join(pairs)}: a name, then KEY=VALUE pairs")
    bad = [pair for pair in args.set if "=" not in pair or pair.startswith(("=", "env.="))]
    if bad:
        parser.error(f"--set {bad[0]}: give KEY=VALUE (a recipe key, or env.NAME for an environment variable)")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    import torch

    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    if not args.tiny and not torch.cuda.is_available():
        message = (
            "scripts/gpu_check.py needs a CUDA GPU and this machine has none; "
            "run it with --tiny for the same code on a tiny model on CPU"
        )
        print(message, file=sys.stderr)
        print(json.dumps({"ok": False, "error": message}))
        return 2

    attentions = args.attentions or (["flash_attention_2", "sdpa"] if not args.tiny and has_flash_attn() else ["sdpa"])
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "ok": False,
        "tiny": args.tiny,
        "steps": args.steps,
        "runs": {},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }

    def save_report() -> None:
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=2) + "\n")

    try:
        base = work / ("base-tiny" if args.tiny else "base-8b")  # a kept base per size
        if args.train and not (base / "config.json").is_file():
            began = time.perf_counter()
            write_base(base, args.tiny)
            report["base_written_seconds"] = time.perf_counter() - began
        memory = args.gpu_memory or (
            torch.cuda.get_device_properties(0).total_memory / GiB if torch.cuda.is_available() else 80.0
        )
        runs, plans = report["runs"], report.setdefault("planner", {})
        if not args.tiny and torch.cuda.is_available():
            report["sdpa_kernels"] = sdpa_kernels()
        sample_tokens = {}  # requested tokens -> the data file's sample length
        for run in planned_runs(args, attentions) if args.train else []:
            data = work / f"train-{run.tokens}.jsonl"
            if run.tokens not in sample_tokens:
                sample_tokens[run.tokens] = write_data(data, base, run.tokens, run.steps)
            elif sum(1 for _ in data.open()) < run.steps:
                write_data(data, base, run.tokens, run.steps)
            report.setdefault("tokens", sample_tokens[run.tokens])
            plans[run.name] = plan = planner(
                base, data, sample_tokens[run.tokens], run.steps, args.tiny, memory, run.attention, run.overrides
            )
            plan["tokens"] = sample_tokens[run.tokens]
            planned_seconds = plan["step_seconds"] * run.steps + 90  # the base's load, about a minute at 8B
            if args.deadline and time.perf_counter() - started + planned_seconds > args.deadline:
                runs[run.name] = {
                    "skipped": f"planned {planned_seconds:.0f} s would pass --deadline {args.deadline:g}"
                }
                save_report()
                continue
            save_report()
            command = [
                sys.executable,
                __file__,
                "--measure",
                run.attention,
                "--base",
                str(base),
                "--data",
                str(data),
                "--out",
                str(work / f"run-{run.name}"),
                "--tokens",
                str(sample_tokens[run.tokens]),
                "--steps",
                str(run.steps),
                *(f"--set={override}" for override in run.overrides),
            ]
            shutil.rmtree(work / f"run-{run.name}", ignore_errors=True)  # a kept work dir: train again, not resume
            proc = subprocess.run(
                command + ["--tiny"] * args.tiny, capture_output=True, text=True, env=run_environment(run.env)
            )
            if proc.returncode != 0:
                runs[run.name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
                print(proc.stderr[-3000:], file=sys.stderr)
            else:
                runs[run.name] = measured = json.loads(proc.stdout.strip().splitlines()[-1])
                measured["tokens"] = sample_tokens[run.tokens]
                if run.env:
                    measured["env"] = run.env
                compare_with_plan(measured, plan, sample_tokens[run.tokens], args.tiny)
                print(f"{run.name}: {json.dumps(measured)}", file=sys.stderr)
            save_report()
        report["kernels"] = compare_kernels(args.tiny) if args.kernel_check else None
        if args.liger_check:
            report["liger"] = compare_liger()
        report["ok"] = all("error" not in r for r in runs.values())
        save_report()
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    for name, measured in report["runs"].items():
        plan = report["planner"][name]
        if "skipped" in measured:
            print(f"{name}: skipped ({measured['skipped']})", file=sys.stderr)
            continue
        print(
            f"{name}: peak {measured.get('peak_reserved_gib', float('nan')):.1f} GiB reserved "
            f"(planner {plan['peak_gib']:.1f}), {measured.get('tokens_per_second', float('nan')):,.0f} tokens/s "
            f"(planner {plan['tokens_per_second']:,.0f} at {plan['utilisation']['matmuls']:.0%} matmuls, "
            f"{plan['utilisation']['attention']:.0%} attention)",
            file=sys.stderr,
        )
    for method, check in (report["kernels"] or {}).items():
        if isinstance(check, dict):
            print(
                f"{method}: {check['kernels'][1]} vs {check['kernels'][0]}: max |logit diff| "
                f"{check['max_abs_diff']:.3g}",
                file=sys.stderr,
            )
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
