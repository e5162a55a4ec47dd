"""Parity of longpeft's Activation Beacon with the authors' code, on random tiny weights (run by hand; not a test).

The authors' models (FlagEmbedding ``research/Long_LLM/activation_beacon/src``: their Llama, Qwen2 and Mistral
modeling files and ``Memory``) need transformers 4.39, so they run in a second Python environment that you point at
(``torch==2.13.0`` first: on the dev machines it is a CPU build from local disk):

    python3 -m venv /work/venv-authors
    /work/venv-authors/bin/pip install torch==2.13.0
    /work/venv-authors/bin/pip install transformers==4.39.3 "accelerate<1" numpy safetensors
    git clone https://github.com/FlagOpen/FlagEmbedding /work/authors-src/FlagEmbedding  # outside this repository
    .venv/bin/python scripts/parity_beacon_authors.py --authors-python /work/venv-authors/bin/python \\
        --authors-src /work/authors-src/FlagEmbedding/research/Long_LLM/activation_beacon/src

For each setting (family, layout, ratios and mix, sink, beacon projections, attention kernel, gradient checkpointing)
the authors' side builds a tiny model with their code, gives every beacon weight random values (so that they differ
from the projections they start as), saves it as their released models are saved (``config.json`` with the
``beacon_*`` fields and one safetensors file), and reads token sequences of several lengths in eval mode, keeping
every token's logits (each window's raw-token logits, as their ``Memory.output`` selects them), the mean loss and
the ratio their code chose; then it decodes greedily after a prompt, and in train mode takes one training step's
loss and the gradient of every beacon weight (through the memory of earlier windows). Our side writes the stock base
(the same weights without the beacon tensors), converts the checkpoint with ``longpeft convert-beacon``'s function
(which records ``layout_rule: authors``), loads it with ``longpeft.load`` and does the same.

Per read the table says how many tokens read a beacon (in memory, or earlier in their window with full-coverage +
interleave) and, as a control, how far our logits move with beacons off (full attention over every raw token):
parity must be far below that for the comparison to mean anything. The adapt-N setting reads one length each side
of both of the authors' ratio boundaries, where longpeft's own rule (shown too) picks a larger ratio. The last line
is one JSON object.

In training, with any layout but full-coverage + interleave, the authors score no token of the first window
(``modeling_beacon.py``: "skip computing loss in the very first window"); so does longpeft's runner (the beacon
method's ``training.labels`` rule, applied to every batch), and our side here applies the same rule to its labels.

Left out: ``segmentation`` (the authors' code raises a TypeError placing its beacons, and our positions follow the
paper), ``step-expansion`` with ``interleave`` (their mask hides window slots 0 and 1 instead of the beacons, a bug;
ours follows the paper, and ``layout_rule: authors`` refuses it), random ratio mixes (their draws come from their
own generator) and bf16 (a 1e-5 bound is a float32 one). Also shown, not a parity row: decoding after a prompt
shorter than the window with a sink, where the authors' decoding differs from their own prefill (their sink is
re-taken from each decoding step and read twice); ours decodes as their prefill reads. Without a sink, decoding after
a prompt shorter than the window is compared with their decoding: with appended beacons and adapt-N their ratio is
chosen when decoding fills the window.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB, WINDOW = 256, 16
TOLERANCE = 1e-5  # every-token logits, all settings
LENGTHS = [WINDOW // 2, WINDOW, 2 * WINDOW + 5, 5 * WINDOW]
ADAPT_LENGTHS = [2 * WINDOW + 5, 64, 65, 128, 129]  # adapt-16 on 48 positions: ratio 2 up to 64 tokens, 4 up to 128
NEW_TOKENS = 2 * WINDOW  # greedy decoding after the 2W + 5 prompt: crosses two window boundaries
# adapt-70 on 48 positions: ratio 2 reaches (48 - 16) x 2 + 16 = 80 tokens, so a prompt of W / 2 = 8 counted with 70
# more (78) takes 2, the full window counted with 70 more (86) takes 4
SHORT_PROMPT_ADAPT = 70
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    tie_word_embeddings=False,
)
SHAPES = {  # config fields per family (Qwen2: q/k/v biases, so beacon biases too; Mistral: no sliding window)
    "llama": {**COMMON, "attention_bias": False},
    "qwen2": {**COMMON, "use_sliding_window": False},
    "mistral": {**COMMON, "sliding_window": None},
}
SHAPE = SHAPES["llama"]
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
QKV, QKVO = ["q", "k", "v"], ["q", "k", "v", "o"]
# One authors' model per setting; "positions": the base's max_position_embeddings (default 512).
SETTINGS = [
    {"attn": "full-coverage", "pos": "interleave", "ratios": [2], "sink": 0, "params": QKV},
    {"attn": "full-coverage", "pos": "interleave", "ratios": [4], "sink": 1, "params": QKV},
    {"attn": "full-coverage", "pos": "interleave", "ratios": [8], "sink": 0, "params": QKVO},
    {"attn": "full-coverage", "pos": "append", "ratios": [4], "sink": 1, "params": QKV},
    {"attn": "step-expansion", "pos": "append", "ratios": [2], "sink": 0, "params": QKV},
    {"attn": "full-coverage", "pos": "interleave", "ratios": [2], "sink": 3, "params": QKV},  # sink > ratio
    {"attn": "full-coverage", "pos": "interleave", "ratios": [0], "sink": 2, "params": QKV},  # ratio 0 with a sink
    {
        "attn": "full-coverage",
        "pos": "interleave",
        "ratios": [2, 4, 8],
        "mix": "adapt-16",
        "positions": 48,
        "sink": 1,
        "params": QKV,
        "lengths": ADAPT_LENGTHS,
    },
    {
        "family": "qwen2",
        "attn": "full-coverage",
        "pos": "interleave",
        "ratios": [2],
        "sink": 1,
        "params": QKV,
        "implementation": "sdpa",
        "checkpointing": True,
    },
    {
        "family": "mistral",
        "attn": "full-coverage",
        "pos": "interleave",
        "ratios": [4],
        "sink": 0,
        "params": QKVO,
        "implementation": "sdpa",
        "checkpointing": True,
    },
    {
        "attn": "full-coverage",
        "pos": "append",
        "ratios": [2],
        "sink": 0,
        "params": QKV,
        "implementation": "sdpa",
        "checkpointing": True,
    },
    {  # appended beacons after a prompt of W / 2: their ratio is chosen when decoding fills the window
        "attn": "full-coverage",
        "pos": "append",
        "ratios": [2, 4, 8],
        "mix": f"adapt-{SHORT_PROMPT_ADAPT}",
        "positions": 48,
        "sink": 0,
        "params": QKV,
        "short_decoding": True,
    },
]


def label(setting: dict) -> str:
    """A short name of a setting for the table."""
    ratios = "/".join(map(str, setting["ratios"])) + (f" {setting['mix']}" if "mix" in setting else "")
    extras = [setting.get("implementation", "eager")] + (["ckpt"] if setting.get("checkpointing") else [])
    return (
        f"{setting.get('family', 'llama')} {setting['attn']}/{setting['pos']} r{ratios} sink {setting['sink']} "
        f"{''.join(setting['params'])} {' '.join(extras)}"
    )


def sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """The token sequences both sides read: one per length (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in lengths]


def lengths_of(setting: dict) -> list[int]:
    return setting.get("lengths", LENGTHS)


def build_authors_model(src: Path, setting: dict, out: Path | None = None, shape: dict | None = None):
    """Under transformers 4.39: the authors' model with Activation Beacon for ``setting`` (keys of ``SETTINGS``, plus
    an optional ``window``), with random beacon weights (so that they differ from the projections they start as);
    saved to ``out / "authors"`` as their released models are, when ``out`` is given. ``shape``: config fields
    (default: the family's in ``SHAPES``)."""
    import importlib
    import types

    import torch

    package = types.ModuleType("authors_beacon")  # their src/__init__.py imports their training stack; skip it
    package.__path__ = [str(src)]
    sys.modules["authors_beacon"] = package
    family = setting.get("family", "llama")
    configuration = importlib.import_module(f"authors_beacon.{family}.configuration_{family}")
    modeling = importlib.import_module(f"authors_beacon.{family}.modeling_{family}")
    memory_module = importlib.import_module("authors_beacon.modeling_beacon")
    config_class, model_class = (
        getattr(module, name) for module, name in zip((configuration, modeling), CLASSES[family], strict=True)
    )
    window = setting.get("window", WINDOW)
    config = config_class(
        **(shape or SHAPES[family]),
        max_position_embeddings=setting.get("positions", 512),
        beacon_window=window,
        beacon_stride=window,
        beacon_attn=setting["attn"],
        beacon_pos=setting["pos"],
        beacon_ratio=setting["ratios"],
        beacon_ratio_mix=setting.get("mix", "step-random"),
        beacon_param=setting["params"],
        beacon_embed_init="eos",
        beacon_sink_size=setting["sink"],
        beacon_attend_prev=True,
        beacon_parallel_window=1,
        attn_implementation=setting.get("implementation", "eager"),
    )
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "beacon_" in name:
                parameter.normal_(0.0, config.initializer_range * 2)
    if out is not None:
        model.save_pretrained(out / "authors", safe_serialization=True)
    config.torch_dtype = torch.float32  # their Memory reads the masks' dtype here (save_pretrained leaves a string)
    model.memory = memory_module.Memory(model_config=config, k_seq_dim=2, v_seq_dim=2)
    return model


def load_converted(
    out: Path, positions: int, shape: dict | None = None, attn_implementation: str = "eager", family: str = "llama"
):
    """Our side: the stock base (the authors' checkpoint in ``out / "authors"`` without its beacon tensors) written to
    ``out / "base"``, the checkpoint converted to ``out / "adapter"``, and both loaded with ``longpeft.load``."""
    import torch
    import transformers
    from safetensors.torch import load_file

    import longpeft
    from longpeft.hub import convert_authors_beacon

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    checkpoint = out / "authors"
    weights = load_file(str(checkpoint / "model.safetensors"))
    base = model_class(config_class(**(shape or SHAPES[family]), max_position_embeddings=positions))
    stock = {name: tensor for name, tensor in weights.items() if "beacon_" not in name}
    missing, unexpected = base.load_state_dict(stock, strict=False)
    if unexpected or [name for name in missing if "rotary" not in name]:
        raise SystemExit(
            f"the authors' checkpoint does not fit a stock {family}: missing {missing}, unexpected {unexpected}"
        )
    base.save_pretrained(out / "base")
    convert_authors_beacon(checkpoint, out / "adapter", out / "base")
    return longpeft.load(
        str(out / "base"), out / "adapter", dtype=torch.float32, attn_implementation=attn_implementation
    )


# ------------------------------------------------------------------------------------------------
# The authors' side (transformers 4.39)
# ------------------------------------------------------------------------------------------------


def authors_read(model, ids: list[int]) -> dict:
    """One read in eval mode with the authors' model: every raw token's logits (each step's, as their
    ``Memory.output`` selects the raw tokens' rows of it), the mean loss, and the ratios their code chose."""
    import torch
    from transformers.utils import ModelOutput

    memory, steps, ratios = model.memory, [], []
    native, choose = model._native_forward, memory.set_compression_ratio

    def forward(**kwargs):
        outputs = native(**kwargs)
        steps.append(memory.output(ModelOutput(logits=outputs.logits))["logits"][0])
        return outputs

    def ratio(**kwargs):
        ratios.append(choose(**kwargs))
        return ratios[-1]

    model._native_forward, memory.set_compression_ratio = forward, ratio
    try:
        memory.reset()
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            loss = float(model(input_ids=input_ids, labels=input_ids).loss)
    finally:
        del model._native_forward, memory.set_compression_ratio  # the class's methods again
    return {"loss": loss, "logits": torch.cat(steps).tolist(), "ratio": ratios[0] if ratios else None}


def authors_decode(model, prompt: list[int], new_tokens: int) -> dict:
    """Greedy decoding after ``prompt``: the tokens and the logits of each new token."""
    import torch

    model.memory.reset()
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return {"tokens": generated.sequences[0].tolist(), "logits": torch.cat(generated.logits).tolist()}


def authors_side(src: Path, out: Path, setting: dict) -> None:
    """Under transformers 4.39: build, save and run the authors' model; write ``out/authors.json``."""
    import torch
    from safetensors.torch import save_file

    model = build_authors_model(src, setting, out)
    model.eval()
    reads = [authors_read(model, ids) for ids in sequences(lengths_of(setting))]
    decoding = authors_decode(model, sequences(LENGTHS)[2], NEW_TOKENS)
    short = None
    if setting["sink"] or setting.get("short_decoding"):  # decoding from a prompt shorter than the window, then
        # their prefill of what it decoded
        short = authors_decode(model, sequences(LENGTHS)[0], NEW_TOKENS)
        short["prefill_logits"] = authors_read(model, short["tokens"])["logits"]
    model.train()  # one training step's loss and beacon gradients (through the memory of earlier windows)
    if setting.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    training = []
    for ids in sequences(lengths_of(setting))[-2:]:
        model.memory.reset()
        model.zero_grad(set_to_none=True)
        input_ids = torch.tensor([ids])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        grads = {
            name: (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
            for name, p in model.named_parameters()
            if "beacon_" in name
        }
        save_file(grads, str(out / f"grads-{len(ids)}.safetensors"))
        training.append({"length": len(ids), "loss": loss.item()})
    (out / "authors.json").write_text(
        json.dumps({"reads": reads, "decoding": decoding, "short_decoding": short, "training": training})
    )


# ------------------------------------------------------------------------------------------------
# Our side
# ------------------------------------------------------------------------------------------------


def tokens_reading_a_beacon(setting: dict, length: int, ratio: int) -> int:
    """Raw tokens of a read whose attention reaches a beacon: every token after the first window (the memory holds
    the beacons of earlier windows), and with full-coverage + interleave those of the first window after its first
    beacon; none at ratio 0."""
    window = setting.get("window", WINDOW)
    if not ratio:
        return 0
    later = max(0, length - window)
    first = min(length, window)
    in_window = max(0, first - ratio) if (setting["attn"], setting["pos"]) == ("full-coverage", "interleave") else 0
    return later + in_window


def our_reads(model, setting: dict, expected: list[dict]) -> list[dict]:
    """Our reads of the same sequences: a row per length."""
    import dataclasses

    import torch

    from longpeft.adapters.beacon import BeaconCache, backbone_of, beacons_disabled
    from longpeft.adapters.beacon.layout import choose_ratio
    from longpeft.family import cache_keyword

    settings = backbone_of(model).beacon_settings
    positions = model.config.max_position_embeddings
    rows = []
    for ids, theirs in zip(sequences(lengths_of(setting)), expected, strict=True):
        input_ids = torch.tensor([ids])
        cache = BeaconCache()
        with torch.no_grad():
            output = model(input_ids=input_ids, labels=input_ids, **{cache_keyword(): cache})
            with beacons_disabled(model):  # the control: full attention over every raw token, no beacon
                stock = model(input_ids=input_ids, labels=input_ids)
            backbone_of(model).beacon_settings = dataclasses.replace(settings, layout_rule="longpeft")
            own_rule_logits = model(input_ids=input_ids).logits  # what the setting changes
            backbone_of(model).beacon_settings = settings
        their_logits = torch.tensor(theirs["logits"])
        ratio = cache.state.chosen_ratio
        own_rule = choose_ratio(
            settings.inference_ratios,
            settings.inference_ratio_mix,
            settings.window,
            positions,
            len(ids),
            None,
            settings.sink,
        )
        rows.append(
            {
                "length": len(ids),
                "ratio_ours": ratio,
                "ratio_authors": theirs["ratio"],
                "ratio_longpeft_rule": own_rule,
                "tokens_reading_a_beacon": tokens_reading_a_beacon(setting, len(ids), ratio),
                "logits_rows": their_logits.shape[0],
                "logits_max_abs_diff": float((output.logits[0] - their_logits).abs().max()),
                "loss_abs_diff": abs(float(output.loss) - theirs["loss"]),
                "control_logits_max_abs_diff": float((stock.logits[0] - their_logits).abs().max()),
                "longpeft_rule_logits_max_abs_diff": float((own_rule_logits[0] - their_logits).abs().max()),
            }
        )
    return rows


def our_decoding(model, theirs: dict) -> dict:
    """Greedy decoding after the same prompt as theirs."""
    import torch

    prompt = torch.tensor([sequences(LENGTHS)[2]])
    with torch.no_grad():
        generated = model.generate(
            prompt,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return {
        "length": f"{prompt.shape[1]} + {NEW_TOKENS} generated",
        "same_tokens": generated.sequences[0].tolist() == theirs["tokens"],
        "logits_max_abs_diff": float((torch.cat(generated.logits) - torch.tensor(theirs["logits"])).abs().max()),
    }


def short_prompt_decoding(model, theirs: dict) -> dict:
    """The authors' decoding after a prompt shorter than the window against their own prefill of the same tokens,
    and ours, fed the same tokens one at a time after the prompt, against that prefill."""
    import torch

    from longpeft.adapters.beacon import BeaconCache
    from longpeft.family import cache_keyword

    tokens, prompt = theirs["tokens"], len(sequences(LENGTHS)[0])
    prefill = torch.tensor(theirs["prefill_logits"])[prompt - 1 : -1]  # the rows that score the decoded tokens
    cache, ours = BeaconCache(), []
    with torch.no_grad():
        ours.append(model(torch.tensor([tokens[:prompt]]), **{cache_keyword(): cache}).logits[0, -1])
        for index in range(prompt, len(tokens) - 1):
            ours.append(model(torch.tensor([[tokens[index]]]), **{cache_keyword(): cache}).logits[0, -1])
    return {
        "length": f"{prompt} + {len(tokens) - prompt} decoded",
        "authors_decode_vs_their_prefill": float((torch.tensor(theirs["logits"]) - prefill).abs().max()),
        "ours_vs_their_prefill": float((torch.stack(ours) - prefill).abs().max()),
        "ours_vs_their_decoding": float((torch.stack(ours) - torch.tensor(theirs["logits"])).abs().max()),
        "ratio_ours": cache.state.chosen_ratio,
    }


def training_parity(model, out: Path, setting: dict, expected: list[dict]) -> list[dict]:
    """One training step on our side: its loss and the gradients of every beacon weight, against the authors'.
    The weights ours keeps frozen (the last layer's beacon q and o) must get no gradient there either."""
    import torch
    from safetensors.torch import load_file

    from longpeft.adapters import config_of
    from longpeft.adapters.beacon import METHOD, beacon_parameters, trainable_beacon_parameters

    config = config_of("beacon", model.longpeft_spec.methods["beacon"])
    prefix = "model."
    trainable = trainable_beacon_parameters(model)
    for parameter in trainable.values():
        parameter.requires_grad_(True)
    if setting.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    for ids, theirs in zip(sequences(lengths_of(setting))[-2:], expected, strict=True):
        model.zero_grad(set_to_none=True)
        input_ids = torch.tensor([ids])
        labels = METHOD.training_labels(config, input_ids)  # what the runner's collator does to every batch
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        their_grads = load_file(str(out / f"grads-{len(ids)}.safetensors"))
        diffs, frozen_their_grad = [], 0.0
        for name, parameter in beacon_parameters(model).items():
            their = their_grads[prefix + name]
            if name in trainable:  # no gradient at all at ratio 0 (no beacon is read), on both sides
                grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                diffs.append(float((grad - their).abs().max()))
            else:
                frozen_their_grad = max(frozen_their_grad, float(their.abs().max()))
        rows.append(
            {
                "length": len(ids),
                "loss_abs_diff": abs(loss.item() - theirs["loss"]),
                "grad_max_abs_diff": max(diffs),
                "grad_max_abs": max(float(their_grads[prefix + n].abs().max()) for n in trainable),
                "frozen_weights_their_grad_max_abs": frozen_their_grad,
            }
        )
    model.eval()
    return rows


def our_side(out: Path, setting: dict) -> dict:
    """With longpeft: base folder, conversion, load, then the authors' reads, decoding and training step again."""
    model = load_converted(
        out,
        setting.get("positions", 512),
        attn_implementation=setting.get("implementation", "eager"),
        family=setting.get("family", "llama"),
    ).eval()
    authors = json.loads((out / "authors.json").read_text())
    result = {
        "rows": our_reads(model, setting, authors["reads"]),
        "decoding": our_decoding(model, authors["decoding"]),
    }
    if authors["short_decoding"] is not None:
        result["short_decoding"] = short_prompt_decoding(model, authors["short_decoding"])
    result["training"] = training_parity(model, out, setting, authors["training"])
    return result


# ------------------------------------------------------------------------------------------------
# Running both
# ------------------------------------------------------------------------------------------------


def add_authors_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a script that runs the authors' side in their environment (this one, bench_beacon_authors)."""
    parser.add_argument(
        "--authors-python",
        required=True,
        help="python of an environment with transformers 4.39 (the authors' code needs it; see above)",
    )
    parser.add_argument(
        "--authors-src", type=Path, required=True, help="the authors' research/Long_LLM/activation_beacon/src folder"
    )
    parser.add_argument("--side", choices=["both", "authors"], default="both", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def authors_side_or_error(args: argparse.Namespace, authors_side) -> int | None:
    """The exit status when this process has nothing more to do: 2 (said on stderr) when ``--authors-src`` is not
    the authors' source folder, 0 once ``authors_side()`` ran (``--side authors``); None on the main side."""
    if not (args.authors_src / "modeling_beacon.py").is_file():
        print(
            f"--authors-src {args.authors_src}: no modeling_beacon.py; give the authors' activation_beacon/src folder",
            file=sys.stderr,
        )
        return 2
    if args.side == "authors":
        authors_side()
        return 0
    return None


def run_authors_side(script: str, args: argparse.Namespace, out: Path, *options: str) -> bool:
    """Run ``script --side authors`` with the authors' python (writing into ``out``); False, said on stderr, if it
    failed."""
    authors = subprocess.run(
        [
            args.authors_python,
            script,
            "--side",
            "authors",
            "--authors-python",
            args.authors_python,
            "--authors-src",
            str(args.authors_src),
            "--out",
            str(out),
            *options,
        ]
    )
    if authors.returncode != 0:
        print(
            f"the authors' side failed (exit {authors.returncode}; its traceback is above); does "
            f"{args.authors_python} have transformers 4.39?",
            file=sys.stderr,
        )
    return authors.returncode == 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_authors_arguments(parser)
    parser.add_argument("--setting", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--only", type=int, nargs="+", help="run these settings only (indices into SETTINGS)")
    return parser.parse_args(argv)


def print_setting(setting: dict, result: dict) -> None:
    """The table rows of one setting and its decoding and training lines."""
    for row in result["rows"]:
        ratios = f"{row['ratio_ours']}/{row['ratio_authors'] if row['ratio_authors'] is not None else '-'}"
        if "mix" in setting:
            ratios += f" ({row['ratio_longpeft_rule']})"
        print(
            f"| {label(setting):<58} | {row['length']:>4} | {ratios:>9} | {row['tokens_reading_a_beacon']:>4} | "
            f"{row['logits_max_abs_diff']:.1e} | {row['loss_abs_diff']:.1e} | "
            f"{row['longpeft_rule_logits_max_abs_diff']:.1e} | {row['control_logits_max_abs_diff']:.1e} |"
        )
    decoding = result["decoding"]
    print(
        f"|   greedy decoding {decoding['length']}: same tokens {decoding['same_tokens']}, logits max |diff| "
        f"{decoding['logits_max_abs_diff']:.1e}"
    )
    for row in result["training"]:
        print(
            f"|   training step, length {row['length']}: loss |diff| {row['loss_abs_diff']:.1e}, beacon gradients "
            f"max |diff| {row['grad_max_abs_diff']:.1e} (largest {row['grad_max_abs']:.1e}); their gradient of "
            f"the weights we freeze {row['frozen_weights_their_grad_max_abs']:.1e}"
        )
    if "short_decoding" in result and not setting["sink"]:
        short = result["short_decoding"]
        print(
            f"|   decoding {short['length']} (a prompt shorter than the window): ours vs their decoding "
            f"{short['ours_vs_their_decoding']:.1e} (our ratio {short['ratio_ours']})"
        )
    elif "short_decoding" in result:
        short = result["short_decoding"]
        print(
            f"|   not parity: decoding {short['length']} (a sink, a prompt shorter than the window): their decoding "
            f"vs their own prefill {short['authors_decode_vs_their_prefill']:.1e}; ours vs their prefill "
            f"{short['ours_vs_their_prefill']:.1e}"
        )


def main() -> int:
    args = parse_args()
    status = authors_side_or_error(args, lambda: authors_side(args.authors_src.resolve(), args.out, args.setting))
    if status is not None:
        return status
    chosen = [SETTINGS[index] for index in args.only] if args.only else SETTINGS
    print(
        "| setting                                                    |  len | ratio o/a | beac | logits  | loss    "
        "| own rule | control |"
    )
    print(
        "(ratio: ours / the authors' (longpeft's own rule); beac: tokens that read a beacon; logits: every token's "
        "max |diff|; own rule: the same with layout_rule longpeft; control: ours with beacons off, against theirs)"
    )
    report = []
    for setting in chosen:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder)
            if not run_authors_side(__file__, args, out, "--setting", json.dumps(setting)):
                return 1
            result = our_side(out, setting)
        print_setting(setting, result)
        report.append({**setting, **result})
    rows = [row for entry in report for row in entry["rows"]]
    training = [row for entry in report for row in entry["training"]]
    summary = {
        "logits_max_abs_diff": max(row["logits_max_abs_diff"] for row in rows),
        "loss_max_abs_diff": max(row["loss_abs_diff"] for row in rows),
        "decoding_logits_max_abs_diff": max(
            [entry["decoding"]["logits_max_abs_diff"] for entry in report]
            + [
                entry["short_decoding"]["ours_vs_their_decoding"]
                for entry in report
                if "short_decoding" in entry and not entry["sink"]
            ]
        ),
        "decoding_same_tokens": all(entry["decoding"]["same_tokens"] for entry in report),
        "training_loss_max_abs_diff": max(row["loss_abs_diff"] for row in training),
        "training_grad_max_abs_diff": max(row["grad_max_abs_diff"] for row in training),
        "frozen_weights_their_grad_max_abs": max(row["frozen_weights_their_grad_max_abs"] for row in training),
        "same_ratios": all(row["ratio_authors"] in (None, row["ratio_ours"]) for row in rows),
        "rows_reading_a_beacon": sum(row["tokens_reading_a_beacon"] > 0 for row in rows),
        "rows": len(rows),
    }
    summary["within_tolerance"] = (
        summary["logits_max_abs_diff"] <= TOLERANCE
        and summary["same_ratios"]
        and summary["decoding_logits_max_abs_diff"] <= TOLERANCE
    )
    print(
        f"every-token logits within {TOLERANCE:.0e} on all settings: {summary['within_tolerance']} (worst "
        f"{summary['logits_max_abs_diff']:.1e}); {summary['rows_reading_a_beacon']} of {summary['rows']} rows read "
        "a beacon"
    )
    print(json.dumps({"bench": "parity_beacon_authors", **summary, "settings": report}))
    return 0 if summary["within_tolerance"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
