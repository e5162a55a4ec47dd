"""Every method extending the same real base, at an equal training budget: the methods table.

The packaged toy base (``longpeft:toy-base``: W = 256 tokens, retrieves inside W, fails beyond) is
extended to 4W and 8W by each method, every variant trained on the same number of tokens of retrieval
documents (``data.source: retrieval``), then scored on passkey, single-needle NIAH (depths 0..1),
RULER-lite (six tasks) and perplexity by length, with and without STRING on top (no training), over
several seeds (PoSE has no UtK variant: both bring their own collator, and recipes refuse the
combination; HARPE and Activation Beacon have no STRING row: STRING needs one RoPE base for all
heads and a plain KV cache). Run by hand (hours on 2 CPU cores; every finished run is kept, so a killed run resumes):

    python scripts/repro_methods.py --out runs/repro --seeds 0 1 --targets 4 8

Writes ``OUT/methods_4W_8W.md`` (named by the targets: mean +- spread over seeds, one row per method
and STRING setting, with the paper claim each row tests), ``OUT/methods_4W_8W.png`` (NIAH accuracy
against length, one line per method) and ``OUT/methods_4W_8W.json`` (every score of every run).
``--variants`` picks a subset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

W = 256  # the toy base's trained window
TASK_LABELS = {"passkey": "passkey", "niah_single": "NIAH", "ruler": "RULER-lite", "ppl": "ppl"}


@dataclass(frozen=True)
class Variant:
    """One row of the table: how its recipe differs from ``toy-extend-cpu`` at a target length."""

    name: str
    claim: str
    overrides: Callable[[int], list[str]]  # target length -> recipe overrides
    train_window: Callable[[int], int] = lambda target: target  # data.max_length
    longest_document: Callable[[int], int] | None = None  # default: the window (PoSE's content skip: the target)
    trained: bool = True
    string: bool = True  # STRING on top at inference (refused with HARPE's per-head bases)


def rope_theta(target: int) -> float:
    """The RoPE base for a target length: 2e6 at 4W (the demo's 200x), growing with the target."""
    return 2e6 * target / (4 * W)


def rope(target: int) -> list[str]:
    return ["method=rope", f"rope.rope_theta={rope_theta(target):g}"]


def pose(target: int) -> list[str]:
    return rope(target) + ["method=pose", "pose.n_chunks=2", f"pose.target_length={target}"]


def pose_content(skip: str) -> Callable[[int], list[str]]:
    return lambda target: pose(target) + [f"pose.content_skip={skip}"]


def harpe(selection: str) -> Callable[[int], list[str]]:
    def overrides(target: int) -> list[str]:
        theta = rope_theta(target)
        extra = [f"harpe.stride={theta / 8:g}"] if selection == "peak_valley" else []
        return [
            "method=harpe",
            f"harpe.selection={selection}",
            f"harpe.b_min={theta / 4:g}",
            f"harpe.b_max={theta:g}",
            *extra,
        ]

    return overrides


def utk(base: Callable[[int], list[str]]) -> Callable[[int], list[str]]:
    return lambda target: base(target) + ["data.utk.probability=0.8", "lora.embeddings=full"]


def qlora(target: int) -> list[str]:
    return rope(target) + ["model.load_in_4bit=true"]


def beacon(target: int) -> list[str]:
    """Activation Beacon on the unchanged base: windows of 96 raw tokens (probe lengths are multiples of W,
    so the question stays raw), ratios as small as the base's 256 positions allow at the target; the released
    recipes' full-coverage attention with interleaved beacons."""
    ratios = [8, 16] if target <= 4 * W else [16, 32]
    return [
        "method=beacon",
        "finetune=method",
        "rope.rope_theta=10000",
        f"rope.max_position_embeddings={W}",
        "beacon.window=96",
        f"beacon.ratios={ratios}",
        "beacon.sink=1",
        "beacon.inference_ratio_mix=adapt-16",
    ]


def beacon_step(target: int) -> list[str]:
    """The same, with the paper's stepwise expansion: raw tokens do not see their window's beacons, and their
    positions stay consecutive (with full coverage each interleaved beacon takes a position between them)."""
    return beacon(target) + ["beacon.attn=step-expansion", "beacon.attend_prev=false"]


CLAIMS = {
    "rope": "RoPE base + LoRA (the 80K-overnight recipe): extends retrieval to the trained length",
    "qlora": "QLoRA 4-bit loses little against 16/32-bit LoRA",
    "pose": "PoSE: training in W with skip-wise positions comes close to training at full length",
    "pose-content": "PoSE's content skip (W-token windows drawn from documents up to the target) ~ the window's "
    "first tokens (the paper's Table 4)",
    "harpe-uniform": "HARPE: per-head bases >= one shared base at equal budget",
    "harpe-peak-valley": "HARPE peak-valley selection >= uniform bases",
    "utk": "UtK augmentation helps retrieval at equal budget",
    "embeddings": "control for UtK: its rows train the whole input embedding, as here without UtK",
    "beacon": "Activation Beacon: condensed memory reaches past the base's positions without new positions",
    "beacon-step": "Activation Beacon, stepwise expansion (the paper's best) >= full coverage (the released recipes')",
}
VARIANTS = [
    Variant("base", "the base fails beyond W; STRING alone cannot reach past W", lambda t: [], trained=False),
    Variant("rope", CLAIMS["rope"], rope),
    Variant("rope+embeddings", CLAIMS["embeddings"], lambda t: rope(t) + ["lora.embeddings=full"]),
    Variant("rope+utk", CLAIMS["utk"], utk(rope)),
    Variant("qlora", CLAIMS["qlora"], qlora),
    Variant("qlora+utk", CLAIMS["utk"], utk(qlora)),
    Variant("pose", CLAIMS["pose"], pose, train_window=lambda target: W),
    Variant(
        "pose+uniform",
        CLAIMS["pose-content"],
        pose_content("uniform"),
        train_window=lambda target: W,
        longest_document=lambda target: target,
    ),
    Variant(
        "pose+aligned",
        CLAIMS["pose-content"],
        pose_content("aligned"),
        train_window=lambda target: W,
        longest_document=lambda target: target,
    ),
    Variant("harpe-uniform", CLAIMS["harpe-uniform"], harpe("uniform"), string=False),
    Variant("harpe-uniform+utk", CLAIMS["utk"], utk(harpe("uniform")), string=False),
    Variant("harpe-peak-valley", CLAIMS["harpe-peak-valley"], harpe("peak_valley"), string=False),
    Variant("harpe-peak-valley+utk", CLAIMS["utk"], utk(harpe("peak_valley")), string=False),
    Variant("beacon", CLAIMS["beacon"], beacon, string=False),  # STRING needs a plain KV cache
    Variant("beacon-step", CLAIMS["beacon-step"], beacon_step, string=False),
]
STRING_CLAIM = "STRING raises retrieval inside the trained length (no training)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/repro")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--targets", type=int, nargs="+", default=[4, 8], help="target lengths as multiples of W")
    p.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], help="default: all")
    p.add_argument(
        "--tokens-per-w",
        type=int,
        default=160_000,
        help="training tokens per window multiple of the target (4W: 640K tokens for every method)",
    )
    p.add_argument("--samples", type=int, default=2, help="probes per (length, depth) cell; 5 depths")
    args = p.parse_args(argv)
    if any(t < 2 for t in args.targets) or args.tokens_per_w < 1 or args.samples < 1:
        p.error("--targets must be >= 2, --tokens-per-w and --samples >= 1")
    return args


def variant_recipe(variant: Variant, target: int, seed: int, tokens_per_w: int, folder: Path) -> Any:
    """The validated recipe that trains ``variant`` to ``target`` x W with ``tokens_per_w`` tokens per W."""
    from longpeft.recipes.schema import load_recipe

    length = target * W
    window = variant.train_window(length)
    longest = variant.longest_document(length) if variant.longest_document else window
    low = max(W // 2, longest // 4)
    trained_per_document = sum(min(n, window) for n in range(low, longest)) / (longest - low)  # lengths low..longest-1
    n_documents = round(tokens_per_w * target / trained_per_document)  # equal trained tokens for every method
    overrides = [
        f"output_dir={folder}",
        f"target_length={length}",
        f"rope.max_position_embeddings={length}",
        f"data.max_length={window}",
        f"data.retrieval.min_tokens={low}",
        f"data.retrieval.max_tokens={longest - 1}",
        f"data.retrieval.n_documents={n_documents}",
        f"data.retrieval.seed={100 + seed}",
        f"train.seed={seed}",
        "train.save_steps=32",
    ] + variant.overrides(length)  # the variant's own settings win
    return load_recipe("toy-extend-cpu", overrides)


def train(variant: Variant, target: int, seed: int, args: argparse.Namespace, folder: Path) -> Path:
    """Train one variant (resumes an interrupted run; a finished one is reused); returns the adapter folder."""
    from longpeft.recipes.checkpoints import latest_checkpoint
    from longpeft.recipes.runner import run

    if (folder / "adapter" / "longpeft.json").is_file():
        return folder / "adapter"
    recipe = variant_recipe(variant, target, seed, args.tokens_per_w, folder)
    return run(recipe, resume=latest_checkpoint(folder) is not None).adapter_dir


def perplexity_by_length(model: Any, tokenizer: Any, lengths: list[int], n_docs: int = 4) -> dict[str, float]:
    """Perplexity of held-out retrieval documents of each length (one window per document)."""
    import math

    from longpeft.eval.perplexity import sliding_window_perplexity
    from longpeft.synth_data.retrieval_docs import RetrievalDocuments

    docs = RetrievalDocuments(tokenizer, seed=999)
    result = {}
    for n in lengths:
        nll = [
            sliding_window_perplexity(model, tokenizer, input_ids=docs.document(n), window=n, stride=n)[
                "nll_per_token"
            ]
            for _ in range(n_docs)
        ]
        result[str(n)] = math.exp(statistics.fmean(nll))
    return result


def score(
    model: Any, tokenizer: Any, target: int, string: dict[str, int] | None, samples: int
) -> dict[str, dict[str, float]]:
    """``{task: {length: score}}`` for passkey, NIAH (W .. target), RULER-lite (at the target) and ppl."""
    from longpeft.eval.tasks import evaluate, string_enabled

    lengths = sorted({W, 2 * W, target // 2, target})
    common = dict(seed=7, chat=False, batch_size=8, string=string)
    out = {}
    for task in ("passkey", "niah_single"):
        out[task] = evaluate(
            task, model, tokenizer, lengths=lengths, depths=(0.0, 0.25, 0.5, 0.75, 1.0), n_samples=samples, **common
        )["by_length"]
    out["ruler"] = evaluate("ruler", model, tokenizer, lengths=[target], n_samples=samples, **common)["by_length"]
    with string_enabled(model, string):
        out["ppl"] = perplexity_by_length(model, tokenizer, lengths)
    return out


def run_one(variant: Variant, target: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train (if needed) and score one variant x target x seed, with and without STRING; cached in results.json."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longpeft import load
    from longpeft.base_config import TOY_BASE, model_location
    from longpeft.eval.demo_report import demo_string_settings

    folder = Path(args.out) / variant.name / f"{target}W" / f"seed{seed}"
    cached = folder / "results.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    began = time.time()
    length = target * W
    if variant.trained:
        adapter = train(variant, target, seed, args, folder)
        model, trained_length = load(None, adapter).eval(), length
    else:
        model, trained_length = AutoModelForCausalLM.from_pretrained(model_location(TOY_BASE)).eval(), W
    tokenizer = AutoTokenizer.from_pretrained(model_location(TOY_BASE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lengths beyond the base's positions are the point here
        result = {
            "variant": variant.name,
            "target": length,
            "seed": seed,
            "plain": score(model, tokenizer, length, None, args.samples),
            "string": score(model, tokenizer, length, demo_string_settings(trained_length), args.samples)
            if variant.string
            else None,
        }
    result["seconds"] = round(time.time() - began)
    folder.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result, indent=2) + "\n")
    return result


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and half-range over seeds."""
    return statistics.fmean(values), (max(values) - min(values)) / 2


def mean_spread_cell(values: list[float]) -> str:
    mean, spread = mean_spread(values)
    return f"{mean:.2f}±{spread:.2f}" if len(values) > 1 else f"{mean:.2f}"


def table(results: list[dict[str, Any]], target: int) -> str:
    """Markdown: one row per (variant, STRING), NIAH/passkey at W..target, RULER at target, ppl at target."""
    rows = [r for r in results if r["target"] == target * W]
    lengths = sorted({int(n) for r in rows for n in r["plain"]["niah_single"]})
    columns = (
        [("passkey", n) for n in lengths]
        + [("niah_single", n) for n in lengths]
        + [("ruler", target * W), ("ppl", target * W)]
    )
    head = [f"{TASK_LABELS[t]} {n // W}W" for t, n in columns]
    lines = [
        f"| method (to {target}W = {target * W}) | STRING | " + " | ".join(head) + " | claim tested |",
        "|---|---|" + "---:|" * len(columns) + "---|",
    ]
    by_variant = {v.name: v for v in VARIANTS}
    for name in dict.fromkeys(r["variant"] for r in rows):
        runs = [r for r in rows if r["variant"] == name]
        for mode in ("plain", "string") if runs[0]["string"] is not None else ("plain",):
            cells = [mean_spread_cell([r[mode][t][str(n)] for r in runs]) for t, n in columns]
            claim = by_variant[name].claim if mode == "plain" else STRING_CLAIM
            lines.append(f"| {name} | {'on' if mode == 'string' else 'off'} | " + " | ".join(cells) + f" | {claim} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted({r["target"] for r in results})
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        rows = [r for r in results if r["target"] == target]
        for k, name in enumerate(dict.fromkeys(r["variant"] for r in rows)):
            runs = [r for r in rows if r["variant"] == name]
            lengths = sorted(int(n) for n in runs[0]["plain"]["niah_single"])
            means, spread = zip(*(mean_spread([r["plain"]["niah_single"][str(n)] for r in runs]) for n in lengths))
            # Equal scores overlap: styles and markers tell the lines apart.
            ax.errorbar(
                lengths,
                means,
                yerr=spread,
                marker="os^vDP*X"[k % 8],
                linestyle=["-", "--", "-.", ":"][k % 4],
                markersize=8 - (k % 4),
                capsize=3,
                label=name,
            )
        ax.axvline(W, color="grey", linestyle=":", label="base window W")
        ax.set(
            title=f"extended to {target // W}W = {target} tokens",
            xlabel="prompt length (tokens)",
            ylabel="single-needle NIAH accuracy",
            ylim=(-0.05, 1.05),
        )
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    jobs = [(v, t, s) for t in args.targets for v in chosen for s in (args.seeds if v.trained else args.seeds[:1])]
    results = []
    for k, (variant, target, seed) in enumerate(jobs, 1):
        print(f"[{k}/{len(jobs)}] {variant.name} to {target}W, seed {seed}", file=sys.stderr, flush=True)
        results.append(run_one(variant, target, seed, args))
    stem = "methods_" + "_".join(f"{t}W" for t in args.targets)  # one report per set of targets
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    command = "python scripts/repro_methods.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = [
        f"# Methods on the toy base (W = {W}), equal training budget\n",
        f"`{command}`\n",
        f"Seeds {args.seeds}; {args.tokens_per_w:,} training tokens per W of target for every method; "
        f"{args.samples} probes per (length, depth) cell, 5 depths; mean ± half-range over seeds.\n",
    ]
    report += [table(results, t) + "\n" for t in args.targets]
    (out / f"{stem}.md").write_text("\n".join(report))
    plot(results, out / f"{stem}.png")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
