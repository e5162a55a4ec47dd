"""Parity of longpeft's Activation Beacon with the authors' code, on random tiny weights (run by hand; not a test).

The authors' model (FlagEmbedding ``research/Long_LLM/activation_beacon/src``: their Llama modeling file and
``Memory``) needs transformers 4.39, so it runs in a second Python environment that you point at:

    python3 -m venv /tmp/venv-authors
    /tmp/venv-authors/bin/pip install torch==2.13.0 transformers==4.39.3 "accelerate<1" numpy safetensors
    git clone https://github.com/FlagOpen/FlagEmbedding   # the authors' source; nothing of it is copied here
    .venv/bin/python scripts/parity_beacon_authors.py \\
        --authors-python /tmp/venv-authors/bin/python \\
        --authors-src FlagEmbedding/research/Long_LLM/activation_beacon/src

For each setting (layout, ratios, sink, beacon projections) the authors' side builds a tiny Llama-shaped model with
their code, gives every beacon weight random values (so that they differ from the projections they start as), saves
it as a checkpoint the way their released models are saved (``config.json`` with the ``beacon_*`` fields and one
safetensors file), and reads token sequences of several lengths (one window to several) in eval mode, keeping the
mean token loss over the whole sequence and the last window's logits; then it decodes greedily after a prompt, and
in train mode takes one training step's loss and the gradient of every beacon weight (through the memory of earlier
windows). Our side writes the stock base (the same weights without the beacon tensors), converts the checkpoint with
``longpeft convert-beacon``'s function, loads it with ``longpeft.load`` and does the same. It prints the largest
differences; the last line is one JSON object.

In training, with any layout but full-coverage + interleave, the authors score no token of the first window
(``modeling_beacon.py``: "skip computing loss in the very first window"); so does longpeft's runner (the beacon
method's ``training.labels`` rule, applied to every batch), and our side here applies the same rule to its labels.

Settings compared (``SETTINGS``): ``attn: full-coverage`` with ``pos: interleave`` (what the released models use)
and ``append``, ``step-expansion`` with ``append``, sinks, beacon o projections, and the adapt-N ratio choice; one
ratio per run otherwise (the authors' step-random draws come from their own generator); float32, eager attention.
``segmentation`` is left out: the authors' code raises a TypeError there (``modeling_beacon.py``, the
``new_full(beacon_size, ...)`` of its segmentation positions), and our positions follow the paper. As a control, our
model with beacons off (full attention over every raw token) is compared with the authors' logits too: parity must
be far below that difference for the comparison to mean anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB, WINDOW = 256, 16
# One authors' model per setting. "positions": the base's max_position_embeddings (adapt-N picks the smallest ratio
# whose positions fit the input plus N; the authors count (positions - window) x ratio + window, longpeft also the
# sink and the last window's beacons: both pick the same ratios at these lengths).
SETTINGS = [
    {"attn": "full-coverage", "pos": "interleave", "ratios": [2], "sink": 0, "params": ["q", "k", "v"]},
    {"attn": "full-coverage", "pos": "interleave", "ratios": [4], "sink": 1, "params": ["q", "k", "v"]},
    {"attn": "full-coverage", "pos": "interleave", "ratios": [8], "sink": 0, "params": ["q", "k", "v", "o"]},
    {"attn": "full-coverage", "pos": "append", "ratios": [4], "sink": 1, "params": ["q", "k", "v"]},
    {"attn": "step-expansion", "pos": "append", "ratios": [2], "sink": 0, "params": ["q", "k", "v"]},
    {"attn": "full-coverage", "pos": "interleave", "ratios": [2, 4, 8], "mix": "adapt-16", "positions": 48, "sink": 0,
     "params": ["q", "k", "v"]},
]
LENGTHS = [WINDOW // 2, WINDOW, 2 * WINDOW + 5, 5 * WINDOW]
NEW_TOKENS = 2 * WINDOW  # greedy decoding after the 2W + 5 prompt: crosses two window boundaries
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, pad_token_id=None, tie_word_embeddings=False, attention_bias=False)


def sequences(seed: int = 0) -> list[list[int]]:
    """The token sequences both sides read: one per length in LENGTHS (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in LENGTHS]


def build_authors_model(src: Path, setting: dict, out: Path | None = None, shape: dict | None = None):
    """Under transformers 4.39: the authors' Llama with Activation Beacon for ``setting`` (keys of ``SETTINGS``, plus
    an optional ``window``), with random beacon weights (so that they differ from the projections they start as);
    saved to ``out / "authors"`` as their released models are, when ``out`` is given. ``shape``: LlamaConfig fields
    (default ``SHAPE``)."""
    import importlib
    import types

    import torch

    package = types.ModuleType("authors_beacon")  # their src/__init__.py imports their training stack; skip it
    package.__path__ = [str(src)]
    sys.modules["authors_beacon"] = package
    configuration = importlib.import_module("authors_beacon.llama.configuration_llama")
    modeling = importlib.import_module("authors_beacon.llama.modeling_llama")
    memory_module = importlib.import_module("authors_beacon.modeling_beacon")

    window = setting.get("window", WINDOW)
    config = configuration.LlamaConfig(
        **(shape or SHAPE), max_position_embeddings=setting.get("positions", 512), beacon_window=window,
        beacon_stride=window, beacon_attn=setting["attn"], beacon_pos=setting["pos"], beacon_ratio=setting["ratios"],
        beacon_ratio_mix=setting.get("mix", "step-random"), beacon_param=setting["params"], beacon_embed_init="eos",
        beacon_sink_size=setting["sink"], beacon_attend_prev=True, beacon_parallel_window=1,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "beacon_" in name:
                parameter.normal_(0.0, config.initializer_range * 2)
    if out is not None:
        model.save_pretrained(out / "authors", safe_serialization=True)
    config.torch_dtype = torch.float32  # their Memory reads the masks' dtype here (save_pretrained leaves a string)
    model.memory = memory_module.Memory(model_config=config, k_seq_dim=2, v_seq_dim=2)
    return model


def load_converted(out: Path, positions: int, shape: dict | None = None, attn_implementation: str = "eager"):
    """Our side: the stock base (the authors' checkpoint in ``out / "authors"`` without its beacon tensors) written to
    ``out / "base"``, the checkpoint converted to ``out / "adapter"``, and both loaded with ``longpeft.load``."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import longpeft
    from longpeft.convert import convert_authors_beacon

    checkpoint = out / "authors"
    weights = load_file(str(checkpoint / "model.safetensors"))
    base = LlamaForCausalLM(LlamaConfig(**(shape or SHAPE), max_position_embeddings=positions))
    stock = {name: tensor for name, tensor in weights.items() if "beacon_" not in name}
    missing, unexpected = base.load_state_dict(stock, strict=False)
    if unexpected or [name for name in missing if "rotary" not in name]:
        raise SystemExit(f"the authors' checkpoint does not fit a stock Llama: missing {missing}, unexpected "
                         f"{unexpected}")
    base.save_pretrained(out / "base")
    convert_authors_beacon(checkpoint, out / "adapter", out / "base")
    return longpeft.load(str(out / "base"), out / "adapter", dtype=torch.float32,
                         attn_implementation=attn_implementation)


def authors_side(src: Path, out: Path, setting: dict) -> None:
    """Under transformers 4.39: build, save and run the authors' model; write ``out/authors.json``."""
    import torch
    from safetensors.torch import save_file

    model = build_authors_model(src, setting, out)
    model.eval()
    results = []
    for ids in sequences():
        model.memory.reset()
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            output = model(input_ids=input_ids, labels=input_ids)
        results.append({"loss": float(output.loss), "last_logits": output.logits[0].tolist()})
    model.memory.reset()
    with torch.no_grad():
        generated = model.generate(torch.tensor([sequences()[-2]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    decoding = {"tokens": generated.sequences[0].tolist(), "logits": torch.cat(generated.logits).tolist()}
    model.train()  # one training step's loss and beacon gradients (through the memory of earlier windows)
    training = []
    for ids in sequences()[-2:]:
        model.memory.reset()
        model.zero_grad(set_to_none=True)
        input_ids = torch.tensor([ids])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
                 for name, p in model.named_parameters() if "beacon_" in name}
        save_file(grads, str(out / f"grads-{len(ids)}.safetensors"))
        training.append({"length": len(ids), "loss": loss.item()})
    (out / "authors.json").write_text(json.dumps({"reads": results, "decoding": decoding, "training": training}))


def our_side(out: Path, setting: dict) -> tuple[list[dict], dict, list[dict]]:
    """With longpeft: base folder, conversion, load, then the authors' reads, decoding and training step again.

    Returns:
        (a row per read length, the decoding comparison, a row per training length).
    """
    import torch

    from longpeft.adapters.beacon import beacons_disabled

    model = load_converted(out, setting.get("positions", 512)).eval()
    authors = json.loads((out / "authors.json").read_text())
    expected, generation = authors["reads"], authors["decoding"]
    rows = []
    for ids, theirs in zip(sequences(), expected, strict=True):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            output = model(input_ids=input_ids, labels=input_ids)
            with beacons_disabled(model):  # the control: full attention over every raw token, no beacon
                stock = model(input_ids=input_ids, labels=input_ids)
        their_logits = torch.tensor(theirs["last_logits"])
        last = slice(len(ids) - their_logits.shape[0], len(ids))
        rows.append({"length": len(ids), "loss_ours": float(output.loss), "loss_authors": theirs["loss"],
                     "loss_abs_diff": abs(float(output.loss) - theirs["loss"]),
                     "last_window_tokens": their_logits.shape[0],
                     "logits_max_abs_diff": float((output.logits[0, last] - their_logits).abs().max()),
                     "control_logits_max_abs_diff": float((stock.logits[0, last] - their_logits).abs().max())})
    prompt = torch.tensor([sequences()[-2]])
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0)
    decoding = {"length": f"{prompt.shape[1]} + {NEW_TOKENS} generated",
                "same_tokens": generated.sequences[0].tolist() == generation["tokens"],
                "logits_max_abs_diff": float((torch.cat(generated.logits)
                                              - torch.tensor(generation["logits"])).abs().max())}
    return rows, decoding, training_parity(model, out, authors["training"])


def training_parity(model, out: Path, expected: list[dict]) -> list[dict]:
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
    model.train()
    rows = []
    for ids, theirs in zip(sequences()[-2:], expected, strict=True):
        model.zero_grad(set_to_none=True)
        input_ids = torch.tensor([ids])
        labels = METHOD.training.labels(config, input_ids)  # what the runner's collator does to every batch
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        their_grads = load_file(str(out / f"grads-{len(ids)}.safetensors"))
        diffs, frozen_their_grad = [], 0.0
        for name, parameter in beacon_parameters(model).items():
            their = their_grads[prefix + name]
            if name in trainable:
                diffs.append(float((parameter.grad - their).abs().max()))
            else:
                frozen_their_grad = max(frozen_their_grad, float(their.abs().max()))
        rows.append({"length": len(ids), "loss_abs_diff": abs(loss.item() - theirs["loss"]),
                     "grad_max_abs_diff": max(diffs),
                     "grad_max_abs": max(float(their_grads[prefix + n].abs().max()) for n in trainable),
                     "frozen_weights_their_grad_max_abs": frozen_their_grad})
    model.eval()
    return rows


def add_authors_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a script that runs the authors' side in their environment (this one, bench_beacon_authors)."""
    parser.add_argument("--authors-python", required=True,
                        help="python of an environment with transformers 4.39 (the authors' code needs it; see above)")
    parser.add_argument("--authors-src", type=Path, required=True,
                        help="the authors' research/Long_LLM/activation_beacon/src folder")
    parser.add_argument("--side", choices=["both", "authors"], default="both", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def authors_side_or_error(args: argparse.Namespace, authors_side) -> int | None:
    """The exit status when this process has nothing more to do: 2 (said on stderr) when ``--authors-src`` is not
    the authors' source folder, 0 once ``authors_side()`` ran (``--side authors``); None on the main side."""
    if not (args.authors_src / "modeling_beacon.py").is_file():
        print(f"--authors-src {args.authors_src}: no modeling_beacon.py; give the authors' activation_beacon/src "
              "folder", file=sys.stderr)
        return 2
    if args.side == "authors":
        authors_side()
        return 0
    return None


def run_authors_side(script: str, args: argparse.Namespace, out: Path, *options: str) -> bool:
    """Run ``script --side authors`` with the authors' python (writing into ``out``); False, said on stderr, if it
    failed."""
    authors = subprocess.run([args.authors_python, script, "--side", "authors",
                              "--authors-python", args.authors_python,
                              "--authors-src", str(args.authors_src), "--out", str(out), *options])
    if authors.returncode != 0:
        print(f"the authors' side failed (exit {authors.returncode}; its traceback is above); does "
              f"{args.authors_python} have transformers 4.39?", file=sys.stderr)
    return authors.returncode == 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_authors_arguments(parser)
    parser.add_argument("--setting", type=json.loads, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    status = authors_side_or_error(args, lambda: authors_side(args.authors_src.resolve(), args.out, args.setting))
    if status is not None:
        return status
    report = []
    for setting in SETTINGS:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder)
            if not run_authors_side(__file__, args, out, "--setting", json.dumps(setting)):
                return 1
            rows, decoding, training = our_side(out, setting)
        for row in rows:
            print(f"{setting['attn']}/{setting['pos']} ratios {setting['ratios']} {setting.get('mix', '')} "
                  f"sink {setting['sink']} params {''.join(setting['params'])} "
                  f"length {row['length']:>3}: loss ours {row['loss_ours']:.6f} authors {row['loss_authors']:.6f} "
                  f"(|diff| {row['loss_abs_diff']:.2e}); last-window logits max |diff| "
                  f"{row['logits_max_abs_diff']:.2e} over {row['last_window_tokens']} tokens (control, beacons off: "
                  f"{row['control_logits_max_abs_diff']:.2e})")
        print(f"  greedy decoding, {decoding['length']}: same tokens {decoding['same_tokens']}, "
              f"logits max |diff| {decoding['logits_max_abs_diff']:.2e}")
        for row in training:
            print(f"  training step, length {row['length']}: loss |diff| {row['loss_abs_diff']:.2e}, beacon gradients "
                  f"max |diff| {row['grad_max_abs_diff']:.2e} (largest gradient {row['grad_max_abs']:.2e}); their "
                  f"gradient of the weights we freeze: {row['frozen_weights_their_grad_max_abs']:.1e}")
        report.append({**setting, "rows": rows, "decoding": decoding, "training": training})
    worst_loss = max(row["loss_abs_diff"] for entry in report for row in entry["rows"])
    worst_logits = max(row["logits_max_abs_diff"] for entry in report for row in entry["rows"])
    worst_decoding = max(entry["decoding"]["logits_max_abs_diff"] for entry in report)
    training = [row for entry in report for row in entry["training"]]
    print(json.dumps({"bench": "parity_beacon_authors", "settings": report, "loss_max_abs_diff": worst_loss,
                      "logits_max_abs_diff": worst_logits, "decoding_logits_max_abs_diff": worst_decoding,
                      "decoding_same_tokens": all(entry["decoding"]["same_tokens"] for entry in report),
                      "training_loss_max_abs_diff": max(row["loss_abs_diff"] for row in training),
                      "training_grad_max_abs_diff": max(row["grad_max_abs_diff"] for row in training),
                      "frozen_weights_their_grad_max_abs": max(row["frozen_weights_their_grad_max_abs"]
                                                               for row in training)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
