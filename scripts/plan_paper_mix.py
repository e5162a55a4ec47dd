"""The planner on the training mix of "Extending Llama-3's Context Ten-Fold Overnight", built offline.

The paper (part 1 of the shared paper notes) trains Llama-3-8B-Instruct to 80K with QLoRA in "8 hours on one
8xA800 (80G) machine", for 1 epoch at batch size 8, on 20.5K samples:

- 3.5K synthetic long-context QA conversations (GPT-4), "the length of context is between 64K to 80K";
- 5K instances "randomly chosen from RedPajama" (no length given);
- 12K LongAlpaca instruction samples, "16K length at maximum" (no distribution given).

This script writes those samples as one JSONL file of conversations (the layout ``longpeft synth`` gives the
recipe: plain text as a request and the text as the answer), at lengths drawn (seeded) from the assumptions
below, and plans the bundled recipe ``llama3-8b-instruct-80k-qlora`` on it with ``longpeft plan``'s own code
(:func:`longpeft.recipes.plan_data.count_sample_lengths`, :func:`longpeft.scale.estimate`) for 8 x A800 and
8 x H100. No constant of the planner is set here: the hours are what the planner says.

Assumptions where the paper is silent (printed, and in docs/plan-paper-mix.md):

- K = 1,024 tokens, as the recipe's data.max_length (81,920 = 80K) reads it; the synthetic conversations'
  lengths are uniform in [64K, 80K] (the paper gives the context's range, and its QA turns fit inside 80K);
- RedPajama: log-uniform in [1,024, 8,192] tokens: the same authors' Activation Beacon paper samples RedPajama
  between 1,024 and 8,192 tokens, "the majority ... less than 4K" (log-uniform puts 2/3 below 4,096);
- LongAlpaca: uniform in [1,024, 16,384] tokens: at most 16K (the paper), at least 1,024 (the lower bound the same
  authors use for their LongAlpaca samples in the Activation Beacon paper);
- the lengths are tokens of the rendered conversation: the Llama-3 tokenizer is not needed (nor downloaded): each
  sample's text is written at exactly ``CHARS_PER_TOKEN`` characters per intended token, and the planner, which
  finds no tokenizer (this script hides the Hugging Face cache from itself so that it never does), estimates
  lengths at that rate, so it plans the intended lengths; the script checks that it does.

Three times per GPU: with every GPU equally loaded (a bound no order reaches); in the order the bundled recipe
trains in, batches grouped by length (``train.group_by_length``, as the authors' released training command passes
``--group_by_length``, FlagEmbedding's Long_LLM/longllm_qlora README), where each step of 8 samples on 8 GPUs
still waits for its longest; and in random order (the Trainer's default, ``train.group_by_length: false``).
Since the unstated lengths move the result, the script also plans the mix with RedPajama and LongAlpaca all at
their shortest (1,024 tokens) and all at their longest (8,192 and 16,384), from the same counts.

    python scripts/plan_paper_mix.py                  # ~1.5 GB of JSONL in a temporary folder, a few minutes
    python scripts/plan_paper_mix.py --out runs/paper-mix --keep

The last line printed is one JSON object with the hours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = "llama3-8b-instruct-80k-qlora"
K = 1024
PAPER_HOURS_8XA800 = 8.0
SYNTHETIC, REDPAJAMA, LONGALPACA = 3_500, 5_000, 12_000
SYNTHETIC_RANGE = (64 * K, 80 * K)  # uniform
REDPAJAMA_RANGE = (1 * K, 8 * K)  # log-uniform
LONGALPACA_RANGE = (1 * K, 16 * K)  # uniform
# the request longpeft synth puts before a plain text (mix.DEFAULT_PLAIN_PROMPT)
PLAIN_PROMPT = "Write a passage of text."
ANSWER_TOKENS = 64  # each synthetic QA answer; the rest of a conversation is its context and questions
QA_TURNS = 4  # questions per synthetic conversation


def intended_lengths(seed: int) -> dict[str, list[int]]:
    """Token lengths per part, drawn from the assumptions of the module docstring."""
    rng = random.Random(seed)
    low, high = REDPAJAMA_RANGE
    return {
        "synthetic long QA": [rng.randint(*SYNTHETIC_RANGE) for _ in range(SYNTHETIC)],
        "RedPajama": [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(REDPAJAMA)],
        "LongAlpaca": [rng.randint(*LONGALPACA_RANGE) for _ in range(LONGALPACA)],
    }


_WORDS = "the river city report market north south garden harbor station council record".split()
_BLOCK = " ".join(random.Random(0).choice(_WORDS) for _ in range(200_000))  # over a million characters


def filler(chars: int, rng: random.Random) -> str:
    """English-looking text of exactly ``chars`` characters (a slice of one long random text)."""
    repeats = -(-chars // len(_BLOCK))
    block = _BLOCK * (repeats + 1)
    start = rng.randrange(len(_BLOCK))
    return block[start : start + chars]


def conversation(part: str, tokens: int, chars_per_token: float, rng: random.Random) -> list[dict[str, str]]:
    """A conversation of ``tokens`` tokens at ``chars_per_token`` characters each (its turns' contents)."""
    chars = round(tokens * chars_per_token)
    if part == "RedPajama":
        return [
            {"role": "user", "content": PLAIN_PROMPT},
            {"role": "assistant", "content": filler(chars - len(PLAIN_PROMPT), rng)},
        ]
    if part == "LongAlpaca":
        answer = chars // 4
        return [
            {"role": "user", "content": filler(chars - answer, rng)},
            {"role": "assistant", "content": filler(answer, rng)},
        ]
    answer = round(ANSWER_TOKENS * chars_per_token)
    question = filler(round(16 * chars_per_token), rng)
    context = filler(chars - QA_TURNS * (answer + len(question)), rng)
    messages = [{"role": "user", "content": context + question}, {"role": "assistant", "content": filler(answer, rng)}]
    for _ in range(QA_TURNS - 1):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": filler(answer, rng)}]
    return messages


def write_mix(path: Path, lengths: dict[str, list[int]], chars_per_token: float, seed: int) -> None:
    """The mix as one shuffled JSONL file of ``messages`` rows."""
    rng = random.Random(seed + 1)
    rows = [(part, n) for part, ns in lengths.items() for n in ns]
    rng.shuffle(rows)
    with path.open("w", encoding="utf-8") as handle:
        for index, (part, n) in enumerate(rows):
            handle.write(json.dumps({"messages": conversation(part, n, chars_per_token, rng), "task": part}) + "\n")
            if index % 2000 == 0:
                print(f"  writing {path.name}: {index:,} / {len(rows):,} rows", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the JSONL file (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the JSONL file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # Hide the Hugging Face cache: the planner then estimates lengths at CHARS_PER_TOKEN on every machine (see above).
    hidden_cache = tempfile.mkdtemp(prefix="empty-hf-cache-")
    os.environ.update(HF_HUB_CACHE=hidden_cache, HF_HUB_OFFLINE="1")
    from longpeft.recipes.plan_data import CHARS_PER_TOKEN, count_sample_lengths
    from longpeft.recipes.schema import load_recipe
    from longpeft.scale import estimate
    from longpeft.scale.lengths import SampleLengths

    folder = args.out or Path(tempfile.mkdtemp(prefix="paper-mix-"))
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "paper-mix.jsonl"
    lengths = intended_lengths(args.seed)
    print("the paper's mix, as built here:")
    for part, ns in lengths.items():
        print(
            f"  {part:<18} {len(ns):>6,} samples, {min(ns):>6,} .. {max(ns):>6,} tokens, "
            f"mean {sum(ns) / len(ns):>8,.0f}"
        )
    try:
        write_mix(data, lengths, CHARS_PER_TOKEN, args.seed)
        recipe = load_recipe(RECIPE, [f"data.source={data}"])
        counted = count_sample_lengths(recipe)
        intended = sorted(n for ns in lengths.values() for n in ns)
        if sorted(counted.lengths) != intended:
            raise SystemExit(
                "the planner's counted lengths differ from the intended ones: is a Llama-3 tokenizer "
                "reachable after all?"
            )
        plans = {
            gpu: estimate(recipe, gpus=8, gpu_memory_gib=80, gpu=gpu, sample_lengths=counted)
            for gpu in ("a800", "h100")
        }
        shuffled = load_recipe(RECIPE, [f"data.source={data}", "train.group_by_length=false"])
        random_order = {
            gpu: estimate(shuffled, gpus=8, gpu_memory_gib=80, gpu=gpu, sample_lengths=counted).assumptions[
                "hours_in_order"
            ]
            for gpu in plans
        }
        for gpu, plan in plans.items():
            print(
                f"\nwhat `longpeft plan {RECIPE} --set data.source={data.name} --gpus 8 --gpu {gpu}` prints:\n"
                f"{plan.table()}"
            )
        bounds = {}
        for bound, (redpajama, longalpaca) in {"shortest": (K, K), "longest": (8 * K, 16 * K)}.items():
            varied = SampleLengths(
                lengths=tuple(lengths["synthetic long QA"] + [redpajama] * REDPAJAMA + [longalpaca] * LONGALPACA),
                source=bound,
                counted_with="-",
            )
            bounds[bound] = {gpu: estimate(recipe, gpus=8, gpu=gpu, sample_lengths=varied).hours for gpu in plans}
        assumed = {
            gpu: estimate(recipe, gpus=8, gpu=gpu, samples=SYNTHETIC + REDPAJAMA + LONGALPACA).hours for gpu in plans
        }
    finally:
        shutil.rmtree(hidden_cache, ignore_errors=True)
        if not args.keep:
            data.unlink(missing_ok=True)
            if args.out is None:
                shutil.rmtree(folder, ignore_errors=True)
    grouped = {gpu: plan.assumptions["hours_in_order"] for gpu, plan in plans.items()}
    rows = {
        "the mix as built, every GPU equally loaded": {gpu: plan.hours for gpu, plan in plans.items()},
        "the mix as built, grouped by length (the recipe's order)": grouped,
        "the mix as built, in random order": random_order,
        "RedPajama and LongAlpaca all at 1,024 tokens, equally loaded": bounds["shortest"],
        "RedPajama at 8,192, LongAlpaca at 16,384 tokens, equally loaded": bounds["longest"],
        "every sample at 81,920 tokens (the planner without the data)": assumed,
    }
    print(f"\n{'hours on 8 GPUs':<66} {'A800':>7} {'H100':>7}")
    for name, hours in rows.items():
        print(f"{name:<66} {hours['a800']:>7.1f} {hours['h100']:>7.1f}")
    print(
        f"{'the paper (8 x A800, unsloth, flash-attn 2, --group_by_length)':<66} {PAPER_HOURS_8XA800:>7.1f} {'-':>7}"
    )
    print(
        json.dumps(
            {
                "script": "plan_paper_mix",
                "recipe": RECIPE,
                "samples": len(intended),
                "tokens": plans["a800"].tokens,
                "hours_8xa800": round(plans["a800"].hours, 2),
                "hours_8xh100": round(plans["h100"].hours, 2),
                "hours_grouped_8xa800": round(grouped["a800"], 2),
                "hours_grouped_8xh100": round(grouped["h100"], 2),
                "hours_random_order_8xa800": round(random_order["a800"], 2),
                "hours_random_order_8xh100": round(random_order["h100"], 2),
                "hours_bounds_8xa800": [round(bounds["shortest"]["a800"], 2), round(bounds["longest"]["a800"], 2)],
                "hours_bounds_8xh100": [round(bounds["shortest"]["h100"], 2), round(bounds["longest"]["h100"], 2)],
                "hours_without_data_8xa800": round(assumed["a800"], 2),
                "paper_hours_8xa800": PAPER_HOURS_8XA800,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
