"""Run longpeft's CLI on >= 150 bad inputs and count how each ends (tests/test_file_errors.py runs it as a test).

Each case calls ``longpeft.cli.main(argv)`` in this process, some under a simulated fault (a library's write
raising its own full-disk or permission error; a Hub on 127.0.0.1, tests/fake_hub.py, that answers with the wrong
JSON shape, never answers, or stalls its files), and is classified:

- ``clear``: exit status 2 (3 for a synth run that built nothing), no traceback, a message on stderr, and for a
  simulated full disk no output folder left behind;
- ``unnamed``: as clear, but the message does not name the file or folder at fault (the cases that say which);
- ``exit 0``: the command ran to the end (for these inputs: the bad value was accepted silently);
- ``hung``: still running after ``CASE_LIMIT`` seconds (given up, in a thread of its own);
- ``other``: anything else (a traceback, an exception escaping ``main``, a wrong exit status, a partial output).

Usage::

    python scripts/probe_bad_inputs.py                 # this checkout
    PYTHONPATH=/path/to/old/checkout python scripts/probe_bad_inputs.py   # another version, same cases

The last line is one JSON object with the counts.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fake Hub the tests use

from fake_hub import FakeHub, pointed_at, silent_hub  # noqa: E402


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def make_adapter(root: Path) -> Path:
    """A real tiny adapter (trained 1 step) to damage in the merge/export/push cases."""
    from longpeft.cli import main

    data = write(
        root / "chat.jsonl",
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"The pass key is {k}. What is it?"},
                        {"role": "assistant", "content": f"It is {k}."},
                    ]
                }
            )
            + "\n"
            for k in range(10000, 10008)
        ),
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(
            [
                "train",
                "tiny-cpu",
                "--set",
                f"output_dir={root / 'run'}",
                "--set",
                f"data.source={data}",
                "--set",
                "data.max_length=256",
                "--set",
                "train.max_steps=1",
                "--set",
                "train.global_batch_size=1",
                "--set",
                "train.per_device_batch_size=1",
                "--set",
                "lora.r=2",
            ]
        )
    return root / "run" / "adapter"


def adapter_variant(root: Path, adapter: Path, name: str, damage) -> str:
    import shutil

    copy = root / "variants" / name
    shutil.copytree(adapter, copy)
    damage(copy)
    return str(copy)


def cases(root: Path, adapter: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of every bad input."""
    out = []
    recipe_sets = [
        "train.learning_rate=.inf",
        "train.learning_rate=.nan",
        "train.learning_rate=-1",
        "train.learning_rate=0",
        "train.learning_rate=abc",
        "rope.rope_theta=.inf",
        "rope.rope_theta=1e300",
        "rope.rope_theta=0.5",
        "rope.rope_theta=-3",
        "rope.rope_theta=x",
        "rope.factor=.inf",
        "lora.r=0",
        "lora.r=-1",
        "lora.r=a",
        "lora.alpha=-2",
        "lora.dropout=1.5",
        "data.max_length=0",
        "data.max_length=-5",
        "data.max_length=z",
        "train.max_steps=0",
        "train.max_steps=-2",
        "train.global_batch_size=0",
        "foo.bar=1",
        "train.bogus=1",
        "lora.rank=3",
        "train.max_steps=[1",
        "train.seed={",
        "trl.bogus=1",
        "trl.learning_rate=1",
        "method=nope",
        "method=harpe",
        "model.dtype=bogus",
        "lora.embeddings=half",
        "lora.embeddings=token_indices",
        "data.format=csv",
        "train.max_grad_norm=.inf",
        "target_length=-1",
        "=5",
        "noequals",
        "rope.rope_type=wavy",
    ]
    out += [(f"plan --set {s}", ["plan", "tiny-cpu", "--set", s]) for s in recipe_sets]
    out += [
        (f"train --set {s}", ["train", "tiny-cpu", "--set", s, "--set", f"output_dir={root / 'never'}"])
        for s in recipe_sets[:10]
    ]
    # plan refuses what train refuses (optimizer values SFTConfig would take, a batch the GPUs do not divide)
    parity_sets = [
        "train.adam_beta1=5",
        "train.adam_beta2=1",
        "train.optim=notanoptimizer",
        "rope.rope_theta=1.0001",
        "rope.rope_theta=9999",
    ]
    for command in ("plan", "train"):
        out += [
            (f"{command} --set {s}", [command, "tiny-cpu", "--set", s, "--set", f"output_dir={root / 'never'}"])
            for s in parity_sets
        ]
    out += [
        ("plan --gpus 16, global batch 4", ["plan", "tiny-cpu", "--gpus", "16"]),
        (
            "train --launch ddp --gpus 16, global batch 4",
            ["train", "tiny-cpu", "--launch", "ddp", "--gpus", "16", "--print-command"],
        ),
    ]
    out += [
        (f"plan {flag} {value}", ["plan", "tiny-cpu", "--gpus", "2", flag, value])
        for flag in ("--mfu", "--gpu-memory", "--inter-node-gbps")
        for value in ("nan", "inf")
    ]
    bad_yaml = write(root / "recipes" / "bad.yaml", "name: [unclosed\n")
    list_yaml = write(root / "recipes" / "list.yaml", "- a\n- b\n")
    empty_yaml = write(root / "recipes" / "empty.yaml", "")
    binary = root / "recipes" / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    out += [(f"plan {p.name}", ["plan", str(p)]) for p in (bad_yaml, list_yaml, empty_yaml, binary)]
    out += [
        ("plan missing recipe", ["plan", "no-such-recipe"]),
        ("train missing recipe", ["train", str(root / "x.yaml")]),
    ]

    base = ["train", "tiny-cpu", "--set", "data.max_length=256", "--set", "train.max_steps=1"]
    data_files = {
        "missing": root / "nope.jsonl",
        "empty": write(root / "data" / "empty.jsonl", ""),
        "malformed": write(root / "data" / "malformed.jsonl", '{"messages": [\n'),
        "null messages": write(root / "data" / "null.jsonl", '{"messages": null}\n'),
        "no assistant": write(
            root / "data" / "noassist.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
        ),
        "bad role": write(
            root / "data" / "role.jsonl", json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n"
        ),
        "txt as messages": write(root / "data" / "doc.txt", "some text"),
        "wrong column": write(root / "data" / "col.jsonl", json.dumps({"conversation": []}) + "\n"),
        "folder without data": (root / "data" / "emptydir"),
    }
    (root / "data" / "emptydir").mkdir(parents=True, exist_ok=True)
    bad_late = write(
        root / "data" / "late.jsonl",
        "".join(
            json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
            for _ in range(150)
        )
        + json.dumps({"messages": [{"role": "user", "content": None}]})
        + "\n",
    )
    data_files["bad row 151"] = bad_late
    for name, path in data_files.items():
        out.append(
            (
                f"train data {name}",
                [
                    *base,
                    "--set",
                    f"data.source={path}",
                    "--set",
                    f"output_dir={root / 'runs' / name.replace(' ', '_')}",
                ],
            )
        )
    out.append(
        (
            "train eos outside vocab",
            [
                *base,
                "--set",
                f"data.source={bad_late}",
                "--set",
                "model.name_or_path=" + str(adapter.parent / "base"),
                "--set",
                "model.eos_token_ids=[99999]",
                "--set",
                f"output_dir={root / 'runs' / 'eos'}",
            ],
        )
    )
    out.append(
        (
            "train length beyond positions",
            [*base, "--set", "data.max_length=4096", "--set", f"output_dir={root / 'runs' / 'len'}"],
        )
    )
    out.append(
        (
            "train missing base path",
            [*base, "--set", f"model.name_or_path={root / 'no-base'}", "--set", f"output_dir={root / 'runs' / 'nb'}"],
        )
    )
    out.append(
        ("train resume without checkpoint", [*base, "--resume", "--set", f"output_dir={root / 'runs' / 'fresh'}"])
    )

    variants = {
        "spec list": lambda d: write(d / "longpeft.json", "[]"),
        "spec null": lambda d: write(d / "longpeft.json", "null"),
        "spec string": lambda d: write(d / "longpeft.json", '"x"'),
        "spec invalid json": lambda d: write(d / "longpeft.json", "{"),
        "spec truncated": lambda d: write(d / "longpeft.json", (d / "longpeft.json").read_text()[:40]),
        "spec version string": lambda d: write(
            d / "longpeft.json", json.dumps({**json.loads((d / "longpeft.json").read_text()), "format_version": "2"})
        ),
        "spec version 99": lambda d: write(
            d / "longpeft.json", json.dumps({**json.loads((d / "longpeft.json").read_text()), "format_version": 99})
        ),
        "spec huge vocab": lambda d: write(
            d / "longpeft.json", json.dumps({**json.loads((d / "longpeft.json").read_text()), "vocab_size": 10**12})
        ),
        "spec negative vocab": lambda d: write(
            d / "longpeft.json", json.dumps({**json.loads((d / "longpeft.json").read_text()), "vocab_size": -3})
        ),
        "spec base_shape string": lambda d: write(
            d / "longpeft.json", json.dumps({**json.loads((d / "longpeft.json").read_text()), "base_shape": "x"})
        ),
        "spec unknown field": lambda d: write(
            d / "longpeft.json", json.dumps({**json.loads((d / "longpeft.json").read_text()), "zzz": 1})
        ),
        "spec missing": lambda d: (d / "longpeft.json").unlink(),
        "weights missing": lambda d: (d / "adapter_model.safetensors").unlink(),
        "weights garbage": lambda d: (d / "adapter_model.safetensors").write_bytes(b"garbage" * 10),
        "weights truncated": lambda d: (d / "adapter_model.safetensors").write_bytes(
            (d / "adapter_model.safetensors").read_bytes()[:100]
        ),
        "config missing": lambda d: (d / "adapter_config.json").unlink(),
        "config garbage": lambda d: write(d / "adapter_config.json", "{oops"),
        "base gone": lambda d: write(
            d / "longpeft.json",
            json.dumps({**json.loads((d / "longpeft.json").read_text()), "base_model": "/no/such/base"}),
        ),
    }
    for name, damage in variants.items():
        folder = adapter_variant(root, adapter, name.replace(" ", "_"), damage)
        base_flag = [] if name == "base gone" else ["--base", str(adapter.parent / "base")]  # copies lose ../base
        for command in ("merge", "export"):
            out.append(
                (
                    f"{command} {name}",
                    [
                        command,
                        folder,
                        "--out",
                        str(root / "merged" / f"{command}-{name.replace(' ', '_')}"),
                        *base_flag,
                    ],
                )
            )
    out.append(("merge out = adapter", ["merge", str(adapter), "--out", str(adapter)]))
    out.append(("merge out = base", ["merge", str(adapter), "--out", str(adapter.parent / "base")]))
    out.append(("merge out non-empty", ["merge", str(adapter), "--out", str(root / "data")]))
    out.append(("merge out is a file", ["merge", str(adapter), "--out", str(root / "chat.jsonl")]))
    out.append(("merge dtype bogus", ["merge", str(adapter), "--out", str(root / "m-d"), "--dtype", "bogus"]))
    out.append(("merge missing adapter", ["merge", str(root / "nowhere"), "--out", str(root / "m-n")]))
    out.append(
        ("merge without a trained method", ["merge", str(adapter), "--out", str(root / "m-w"), "--without", "rope"])
    )
    out.append(
        (
            "train string with harpe",
            [
                "train",
                "tiny-harpe-cpu",
                "--set",
                "string.shift=200",
                "--set",
                "string.local_window=8",
                "--set",
                f"output_dir={root / 'never'}",
            ],
        )
    )
    out.append(("push dry-run non-empty", ["push", str(adapter), "--repo", "a/b", "--dry-run", str(root / "data")]))
    out.append(
        ("push missing source", ["push", str(root / "nowhere"), "--repo", "a/b", "--dry-run", str(root / "p1")])
    )
    out.append(("push not an adapter", ["push", str(root / "data"), "--repo", "a/b", "--dry-run", str(root / "p2")]))

    model = str(adapter.parent / "base")
    evals = [
        ["eval", "passkey", "--model", str(root / "no-model"), "--out", str(root / "e1")],
        ["eval", "passkey", "--model", model, "--max-new-tokens", "0", "--out", str(root / "e2")],
        ["eval", "passkey", "--model", model, "--string", "--string-window", "0", "--out", str(root / "e3")],
        [
            "eval",
            "passkey",
            "--model",
            model,
            "--string",
            "--string-shift",
            "5000",
            "--lengths",
            "256",
            "--out",
            str(root / "e4"),
        ],
        ["eval", "passkey", "--model", model, "--lengths", "0", "--out", str(root / "e5")],
        ["eval", "passkey", "--model", model, "--adapter", str(root / "no-adapter"), "--out", str(root / "e6")],
        ["eval", "bogus-task", "--model", model, "--out", str(root / "e7")],
        [
            "eval",
            "passkey",
            "--model",
            model,
            "--adapter",
            adapter_variant(root, adapter, "eval_spec_list", variants["spec list"]),
            "--out",
            str(root / "e8"),
        ],
        ["eval", "passkey", "--model", model, "--string-window", "64", "--out", str(root / "e9")],
        ["eval", "perplexity", "--model", model, "--out", str(root / "e10")],
    ]
    out += [(" ".join(a[:2]) + f" #{i}", a) for i, a in enumerate(evals)]

    synth_cfg_bad = write(root / "synth" / "bad.yaml", "contexts: [\n")
    synth_cfg_unknown = write(root / "synth" / "unknown.yaml", "bogus_key: 1\n")
    synth = [
        ["synth", "--out", str(root / "s1"), "--config", str(root / "synth" / "missing.yaml")],
        ["synth", "--out", str(root / "s2"), "--config", str(synth_cfg_bad)],
        ["synth", "--out", str(root / "s3"), "--config", str(synth_cfg_unknown)],
        ["synth", "--out", str(root / "s4"), "--min-tokens", "9000", "--max-tokens", "100"],
        ["synth", "--out", str(root / "s5"), "--contexts", "0"],
        ["synth", "--out", str(root / "s6"), "--set", "contexts=[1"],
        ["synth", "--out", str(root / "s7"), "--source", str(root / "no-docs")],
        ["synth", "--out", str(root / "chat.jsonl"), "--contexts", "1", "--min-tokens", "512", "--max-tokens", "1024"],
    ]
    out += [(f"synth #{i}", a) for i, a in enumerate(synth)]
    out.append(("demo out is a file", ["demo", "--out", str(root / "chat.jsonl")]))
    out.append(("demo out foreign folder", ["demo", "--out", str(root / "data")]))
    return out


def broken_file_cases(root: Path, adapter: Path) -> list[tuple[str, list[str], None, None, str]]:
    """Weights, torch files and JSON that lie or are broken, in every command that reads them: (name, argv, no
    fault, no output to check, what the message must name)."""
    import torch
    from safetensors.torch import load_file

    def lying_rank(d: Path) -> None:
        config = json.loads((d / "adapter_config.json").read_text())
        write(d / "adapter_config.json", json.dumps({**config, "r": config["r"] + 2}))

    def pickled(d: Path) -> None:
        weights = d / "adapter_model.safetensors"
        torch.save({**load_file(weights), "payload": print}, d / "adapter_model.bin")
        weights.unlink()

    model = str(adapter.parent / "base")
    out = []
    for name, damage, file in (
        ("lying rank", lying_rank, "adapter_model.safetensors"),
        ("pickle payload", pickled, "adapter_model.bin"),
        (
            "weights header too large",
            lambda d: (d / "adapter_model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}"),
            "adapter_model.safetensors",
        ),
    ):
        folder = adapter_variant(root, adapter, name.replace(" ", "_"), damage)
        out += [
            (
                f"{command} {name}",
                [command, folder, "--out", str(root / "merged" / f"{command}-{name}"), "--base", model],
                None,
                None,
                f"{folder}/{file}",
            )
            for command in ("merge", "export")
        ]
        out.append(
            (
                f"eval --adapter {name}",
                [
                    "eval",
                    "passkey",
                    "--model",
                    model,
                    "--adapter",
                    folder,
                    "--lengths",
                    "512",
                    "--out",
                    str(root / "ev" / name),
                ],
                None,
                None,
                f"{folder}/{file}",
            )
        )
    for name in ("weights garbage", "weights truncated", "weights missing"):
        folder = str(root / "variants" / name.replace(" ", "_"))
        out.append(
            (
                f"eval --adapter {name}",
                [
                    "eval",
                    "passkey",
                    "--model",
                    model,
                    "--adapter",
                    folder,
                    "--lengths",
                    "512",
                    "--out",
                    str(root / "ev" / name),
                ],
                None,
                None,
                "adapter_model.safetensors",
            )
        )
    # a relative path of the form owner/name: a local folder lacking a file, a folder partly there
    out.append(
        (
            "merge variants/weights_missing (relative)",
            ["merge", "variants/weights_missing", "--out", str(root / "merged" / "rel"), "--base", model],
            None,
            None,
            "adapter_model.safetensors is missing",
        )
    )
    out.append(
        (
            "merge variants/does_not_exist (relative)",
            ["merge", "variants/does_not_exist", "--out", str(root / "merged" / "rel2")],
            None,
            None,
            "variants/does_not_exist: no such folder",
        )
    )
    # convert-beacon: the authors' config.json and index broken, their tensors cut short
    authors = make_authors_checkpoint(root / "authors", Path(model))
    for name, damage in (
        ("config garbage", lambda d: write(d / "config.json", "{oops")),
        ("config a list", lambda d: write(d / "config.json", "[]")),
        (
            "beacon_window not a number",
            lambda d: write(
                d / "config.json", json.dumps({**json.loads((d / "config.json").read_text()), "beacon_window": "wide"})
            ),
        ),
        (
            "weights truncated",
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-50]),
        ),
        ("weights garbage", lambda d: (d / "model.safetensors").write_bytes(b"garbage" * 9)),
    ):
        copy = root / "authors-variants" / name.replace(" ", "_")
        shutil.copytree(authors, copy)
        damage(copy)
        file = "config.json" if "config" in name or "beacon_" in name else "model.safetensors"
        out.append(
            (
                f"convert-beacon {name}",
                [
                    "convert-beacon",
                    str(copy),
                    "--base",
                    model,
                    "--out",
                    str(root / "converted" / name.replace(" ", "_")),
                ],
                None,
                None,
                f"{copy}/{file}",
            )
        )
    # resume from a checkpoint whose optimizer file carries a pickle payload
    run = root / "pickled-run"
    shutil.copytree(adapter.parent, run, ignore=shutil.ignore_patterns("adapter", "base"))
    last = max((run / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    torch.save({"state": {}, "param_groups": [], "payload": print}, last / "optimizer.pt")
    out.append(
        (
            "train resume pickle checkpoint",
            [*TRAIN, "--set", f"data.source={root / 'chat.jsonl'}", "--set", f"output_dir={run}", "--resume"],
            None,
            None,
            f"{last}: a file there is not a plain tensor file",
        )
    )
    return out


TRAIN = [
    "train",
    "tiny-cpu",
    "--set",
    "data.max_length=256",
    "--set",
    "train.max_steps=1",
    "--set",
    "train.global_batch_size=1",
    "--set",
    "train.per_device_batch_size=1",
    "--set",
    "lora.r=2",
]


def make_authors_checkpoint(folder: Path, base: Path) -> Path:
    """An Activation Beacon model as its authors release it (one file of base and beacon tensors, config.json with
    their beacon_* settings), built on ``base``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from longpeft.adapters.beacon import BeaconConfig, apply_beacon

    model = AutoModelForCausalLM.from_pretrained(base)
    config = BeaconConfig(window=8, ratios=[2], sink=1, params=["q", "k", "v", "o"])
    apply_beacon(model, config.settings())
    folder.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    settings = json.loads(model.config.to_json_string())
    settings.pop("beacon", None)
    settings.update(
        beacon_window=8,
        beacon_stride=8,
        beacon_attn=config.attn,
        beacon_pos=config.pos,
        beacon_ratio=[2],
        beacon_ratio_mix="step-random",
        beacon_param=config.params,
        beacon_sink_size=1,
        beacon_attend_prev=True,
        beacon_embed_init="eos",
        beacon_parallel_window=1,
    )
    write(folder / "config.json", json.dumps(settings))
    return folder


# ---- faults: a library's write on a full disk or an unwritable folder, a Hub answering the wrong shape -------


@contextlib.contextmanager
def replaced(owner: object, name: str, replacement: object) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, old)


def failing(error: BaseException, only: str | tuple[str, ...] = ()) -> Callable:
    """A writer that leaves a torn file and raises ``error`` (for paths containing one of ``only``, when given;
    others are written)."""
    only = (only,) if isinstance(only, str) else only

    def write_then_fail(*args, real=None, **kwargs):
        target = next((a for a in args if isinstance(a, (str, Path))), kwargs.get("filename") or kwargs.get("f"))
        if only and not any(part in str(target) for part in only):
            return real(*args, **kwargs)
        if isinstance(target, (str, Path)) and Path(target).parent.is_dir():
            Path(target).write_bytes(b"\x00" * 16)
        raise error

    return write_then_fail


def with_real(fake: Callable, real: Callable) -> Callable:
    return lambda *args, **kwargs: fake(*args, real=real, **kwargs)


SAFETENSORS_FULL = (
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
)
SAFETENSORS_DENIED = (
    'Error while serializing: IoError(Os { code: 13, kind: PermissionDenied, message: "Permission denied" })'
)
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"


def fault_cases(root: Path, adapter: Path) -> list[tuple[str, list[str], Callable, Path, str | None]]:
    """(name, argv, a context that injects the fault, the output that must not be left behind, what the message
    must name: the folder that could not be written)."""
    import datasets
    import matplotlib.figure
    import peft.peft_model
    import safetensors.torch
    import torch
    import transformers.modeling_utils
    from safetensors import SafetensorError

    model = str(adapter.parent / "base")
    saving = transformers.modeling_utils

    def safetensors_fault(message: str, only: str = "") -> Callable:
        return lambda: replaced(
            saving, "safe_save_file", with_real(failing(SafetensorError(message), only), safetensors.torch.save_file)
        )

    out = []
    for command in ("merge", "export"):
        for name, message in (("full disk", SAFETENSORS_FULL), ("unwritable", SAFETENSORS_DENIED)):
            target = root / "faults" / f"{command}-{name.replace(' ', '_')}"
            out.append(
                (
                    f"{command} {name} (safetensors)",
                    [command, str(adapter), "--out", str(target)],
                    safetensors_fault(message),
                    target,
                )
            )
        target = root / "faults" / f"{command}-json"
        out.append(
            (
                f"{command} full disk (json)",
                [command, str(adapter), "--out", str(target)],
                lambda: replaced(Path, "write_text", failing(OSError(errno.ENOSPC, "No space left on device"))),
                target,
            )
        )
    authors = root / "authors"
    target = root / "faults" / "converted"
    out.append(
        (
            "convert-beacon full disk (safetensors)",
            ["convert-beacon", str(authors), "--base", model, "--out", str(target)],
            lambda: replaced(__import__("longpeft.hub").hub, "save_file", failing(SafetensorError(SAFETENSORS_FULL))),
            target,
        )
    )
    data = ["--set", f"data.source={root / 'chat.jsonl'}", "--set", f"model.name_or_path={model}"]
    run = root / "faults" / "train-ckpt"
    out.append(
        (
            "train full disk (torch.save checkpoint)",
            [*TRAIN, *data, "--set", f"output_dir={run}"],
            lambda: replaced(torch, "save", with_real(failing(RuntimeError(TORCH_FULL), "checkpoint-"), torch.save)),
            run / "adapter",
        )
    )
    run = root / "faults" / "train-adapter"
    out.append(
        (
            "train full disk (adapter save)",
            [*TRAIN, *data, "--set", f"output_dir={run}"],
            lambda: replaced(
                peft.peft_model,
                "safe_save_file",
                with_real(
                    failing(SafetensorError(SAFETENSORS_FULL), (".adapter.partial", f"{run}/adapter/")),
                    safetensors.torch.save_file,
                ),
            ),
            run / "adapter",
        )
    )
    target = root / "faults" / "synth"
    out.append(
        (
            "synth full disk (datasets)",
            ["synth", "--out", str(target), "--contexts", "1", "--min-tokens", "512", "--max-tokens", "1024"],
            lambda: replaced(
                datasets.Dataset, "save_to_disk", failing(OSError(errno.ENOSPC, "No space left on device"))
            ),
            target / "stats.json",
        )
    )
    target = root / "faults" / "eval"
    out.append(
        (
            "eval full disk (matplotlib)",
            ["eval", "passkey", "--model", model, "--lengths", "512", "--out", str(target)],
            lambda: replaced(
                matplotlib.figure.Figure, "savefig", failing(OSError(errno.ENOSPC, "No space left on device"))
            ),
            target / "passkey.json",
        )
    )
    for name, answer in (
        ("a list", []),
        ("a string", "x"),
        ("siblings of numbers", {"sha": "0" * 40, "siblings": [1, 2]}),
    ):
        target = root / "faults" / f"hub-{name.replace(' ', '_')}"
        out.append(
            (
                f"merge Hub answers {name}",
                ["merge", "owner/adapter", "--out", str(target)],
                lambda answer=answer: wrong_shape_hub(answer),
                target,
            )
        )
    names = {"train full disk (torch.save checkpoint)": str(root / "faults" / "train-ckpt" / "checkpoints")}
    return [
        (
            name,
            argv,
            fault,
            left,
            None
            if "Hub" in name
            else names.get(name, str(left).removesuffix("/stats.json").removesuffix("/passkey.json")),
        )
        for name, argv, fault, left in out
    ]


@contextlib.contextmanager
def wrong_shape_hub(answer: object) -> Iterator[None]:
    """A Hub on 127.0.0.1 whose answers have the wrong JSON shape (tests/fake_hub.py), in place of the offline Hub."""
    with FakeHub("answer", answer) as hub, pointed_at(hub.endpoint):
        yield


@contextlib.contextmanager
def misbehaving_hub(kind: str) -> Iterator[None]:
    """A Hub on 127.0.0.1 that never answers (``silent``) or stalls its files (a :class:`FakeHub` mode), asked with
    a short :data:`HUB_WAIT`."""
    previous = os.environ.get("LONGPEFT_HUB_TIMEOUT")
    os.environ["LONGPEFT_HUB_TIMEOUT"] = str(HUB_WAIT)
    try:
        if kind == "silent":
            with silent_hub() as endpoint, pointed_at(endpoint):
                yield
        else:
            with FakeHub(kind) as hub, pointed_at(hub.endpoint):
                yield
    finally:
        if previous is None:
            os.environ.pop("LONGPEFT_HUB_TIMEOUT", None)
        else:
            os.environ["LONGPEFT_HUB_TIMEOUT"] = previous


HUB_WAIT = 2  # LONGPEFT_HUB_TIMEOUT of the Hub cases, seconds
CASE_LIMIT = 60  # seconds: a case still running then is counted as hung


def hub_cases(root: Path) -> list[tuple[str, list[str], Callable | None, None, str]]:
    """A silent or stalling Hub under every command that loads a model or tokenizer by Hub id, and local paths that
    do not exist under the same commands: (name, argv, the Hub, no output to check, what the message must name)."""

    def argv(command: str, source: str, out: str) -> list[str]:
        if command == "synth --tokenizer":
            return [
                "synth",
                "--out",
                str(root / out),
                "--tokenizer",
                source,
                "--contexts",
                "1",
                "--min-tokens",
                "512",
                "--max-tokens",
                "1024",
                "--no-progress",
            ]
        return [
            command.split()[0],
            "tiny-cpu",
            *(["--build"] if "build" in command else []),
            "--set",
            f"model.name_or_path={source}",
            "--set",
            f"output_dir={root / out}",
        ]

    (root / "models").mkdir(exist_ok=True)
    out = []
    for command in ("train", "synth --tokenizer", "plan --build"):
        for kind in ("silent", "stall", "stall_body"):
            out.append(
                (
                    f"{command}: Hub {kind}",
                    argv(command, "owner/name", f"hub-{kind}"),
                    lambda kind=kind: misbehaving_hub(kind),
                    None,
                    "owner/name",
                )
            )
        for missing in (str(root / "no-model"), "models/no-model"):
            out.append(
                (
                    f"{command}: missing {'relative ' if missing[0] != '/' else ''}path",
                    argv(command, missing, "hub-missing"),
                    lambda: misbehaving_hub("stall"),
                    None,
                    f"{missing}: no such folder",
                )
            )
    out.append(
        (
            "train: Hub dataset silent",
            ["train", "tiny-cpu", "--set", "data.source=owner/data", "--set", f"output_dir={root / 'hub-data'}"],
            lambda: misbehaving_hub("silent"),
            None,
            "data.source owner/data",
        )
    )
    out.append(
        (
            "train: missing relative data.source",
            ["train", "tiny-cpu", "--set", "data.source=models/chats", "--set", f"output_dir={root / 'hub-data'}"],
            lambda: misbehaving_hub("stall"),
            None,
            "data.source models/chats does not exist",
        )
    )
    return out


def remote_code_base(root: Path, adapter: Path) -> Path:
    """A copy of the tiny base whose config.json names a model type transformers has no class for, and modeling code
    of its own for it (``auto_map``)."""
    folder = root / "bases" / "remote-code"
    if not folder.exists():
        shutil.copytree(adapter.parent / "base", folder)
        config = json.loads((folder / "config.json").read_text())
        auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
        write(folder / "config.json", json.dumps({**config, "auto_map": auto_map, "model_type": "custom_lm"}))
    return folder


def tied_adapter_without_record(root: Path) -> tuple[Path, Path]:
    """(base, adapter): a LoRA adapter with a trained embedding on a tied tiny base, written as longpeft writes it
    (the tied head left out), then its record of the tied names (``longpeft.tied``) removed."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    from longpeft.adapter_weights import leave_out_tied_copies
    from longpeft.spec import ContextSpec
    from longpeft.tiny import tiny_model

    base, adapter = root / "bases" / "tied", root / "adapters" / "tied-no-record"
    tiny_model("llama-tied", vocab_size=400).save_pretrained(base)
    lora = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.embed_tokens"], ensure_weight_tying=True)
    model = get_peft_model(tiny_model("llama-tied", vocab_size=400), lora)
    model.save_pretrained(adapter)
    leave_out_tied_copies(model, adapter)
    ContextSpec.from_base(model.config, "rope", base_model=str(base)).save(adapter)
    weights = adapter / "adapter_model.safetensors"
    save_file(load_file(weights), str(weights), metadata={"format": "pt"})
    return base, adapter


def validation_cases(root: Path, adapter: Path) -> list[tuple[str, list[str], Callable | None, None, str]]:
    """What train refuses after reading the recipe against its base, in plan and train alike (the one validation
    before any weight loads), library errors of the user's input, and Hub answers of another shape: (name, argv, a
    Hub or none, no output to check, what the message must name)."""
    out = []
    checked = [
        ("tiny-cpu", ["train.keep_attention=99"], "train.keep_attention"),
        ("tiny-cpu", ["train.checkpoint_layers=99"], "train.checkpoint_layers"),
        ("tiny-cpu", ["lora.target_modules=[nope]"], "lora.target_modules"),
        ("tiny-cpu", ["lora.target_modules=[mlp]"], "lora.target_modules"),
        ("tiny-cpu", ["rope.rope_type=linear"], "rope.factor"),
        ("tiny-cpu", ["rope.max_position_embeddings=1000000000000"], "rope.max_position_embeddings"),
        ("tiny-cpu", ["data.max_length=1000000000"], "data.max_length"),
        ("tiny-cpu", ["model.eos_token_ids=[99999]"], "model.eos_token_ids"),
        ("tiny-cpu", ["data.demo.n_conversation=3"], "data.demo.n_conversation"),
        ("tiny-beacon-cpu", ["beacon.keep_start=64", "beacon.sink=0"], "beacon.keep_start"),
        ("tiny-harpe-cpu", ["train.use_liger_kernel=true"], "train.use_liger_kernel"),
    ]
    no_template = root / "bases" / "no-chat-template"
    shutil.copytree(adapter.parent / "base", no_template)
    (no_template / "chat_template.jinja").unlink()
    remote = remote_code_base(root, adapter)
    checked += [
        ("tiny-cpu", [f"model.name_or_path={no_template}"], "chat template"),
        ("tiny-cpu", [f"model.name_or_path={remote}"], "model.trust_remote_code"),
    ]
    for command in ("plan", "train"):
        for recipe, sets, names in checked:
            never = root / f"never-{len(out)}"  # its own: a run that trained would make the next ones refuse
            argv = [command, recipe, "--set", f"output_dir={never}", *(a for x in sets for a in ("--set", x))]
            out.append((f"{command} {recipe} --set {' '.join(sets)}"[:60], argv, None, None, names))
    out.append(
        (
            "merge onto a base with its own code",
            ["merge", str(adapter), "--base", str(remote), "--out", str(root / "m1")],
        )
        + (None, None, "ships its own modeling code")
    )
    base, tied = tied_adapter_without_record(root)
    out.append(
        ("merge: tied adapter, record removed", ["merge", str(tied), "--out", str(root / "m2")], None, None, str(tied))
    )
    for name, mode, kwargs in (
        ("empty file listing", "files", {"files": {}}),
        ("revision without a sha", "answer", {"answer": {"id": 3, "sha": None, "siblings": {}}}),
    ):
        hub = lambda mode=mode, kwargs=kwargs: _hub_of(mode, kwargs)  # noqa: E731
        out.append(
            (f"merge someone/a: Hub {name}", ["merge", "someone/a", "--out", str(root / "m3")], hub, None, "someone/a")
        )
        plan = ["plan", "tiny-cpu", "--set", "model.name_or_path=someone/a"]
        out.append((f"plan, base someone/a: Hub {name}", plan, hub, None, "someone/a"))
    return out


@contextlib.contextmanager
def _hub_of(mode: str, kwargs: dict) -> Iterator[None]:
    with FakeHub(mode, **kwargs) as hub, pointed_at(hub.endpoint):
        yield


def classify(
    argv: list[str], fault: Callable | None = None, leftover: Path | None = None, names: str | None = None
) -> tuple[str, int | None, str]:
    from longpeft.cli import main

    err, std = io.StringIO(), io.StringIO()
    result: dict[str, int | None] = {}

    def run() -> None:
        try:
            result["code"] = main(argv)
        except SystemExit as exit_:
            result["code"] = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # noqa: BLE001 - an escaped exception is what we count
            traceback.print_exc()
            result["code"] = None

    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        with fault() if fault is not None else contextlib.nullcontext():
            case = threading.Thread(target=run, daemon=True)  # a hung case is given up, not waited for
            case.start()
            case.join(CASE_LIMIT)
    if case.is_alive():
        return "hung", None, f"{err.getvalue()}\nstill running after {CASE_LIMIT} s"
    code = result["code"]
    text = err.getvalue()
    if leftover is not None and leftover.exists():
        return "other", code, f"{text}\nleft behind: {leftover}"
    if names is not None and code in (2, 3) and names not in text:
        return "unnamed", code, f"{text}\nthe message does not name {names}"
    if code in (2, 3) and "Traceback" not in text and text.strip():
        return "clear", code, text
    if code == 0:
        return "exit 0", code, text
    return "other", code, text


def run_all(show: Callable[[str], None] = lambda line: None) -> tuple[dict[str, int], list[str]]:
    """Run every case; returns the counts (``cases`` and one per class: ``clear``, ``unnamed``, ``exit 0``, ``hung``,
    ``other``) and a line per case that is not clear. ``show`` gets a line per case as it ends."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapter = make_adapter(root)
        previous = Path.cwd()
        os.chdir(root)  # the relative-path cases
        try:
            all_cases = (
                [(name, argv, None, None, None) for name, argv in cases(root, adapter)]
                + broken_file_cases(root, adapter)
                + fault_cases(root, adapter)
                + hub_cases(root)
                + validation_cases(root, adapter)
            )
            counts = {"cases": len(all_cases), "clear": 0, "unnamed": 0, "exit 0": 0, "hung": 0, "other": 0}
            failures = []
            for name, argv, fault, leftover, names in all_cases:
                start = time.monotonic()
                kind, code, text = classify(argv, fault, leftover, names)
                counts[kind] += 1
                lines = [t for t in text.strip().splitlines() if t != "(run with --debug for the traceback)"]
                last = (lines or [""])[-1][:150]
                line = f"{kind:<9} rc={code!s:<4} {time.monotonic() - start:5.1f} s {name:<40} {last}"
                show(line)
                if kind != "clear":
                    failures.append(f"{line}\n{text[-3000:]}")
        finally:
            os.chdir(previous)
    return counts, failures


def main() -> None:
    from longpeft import __file__ as where

    counts, _ = run_all(lambda line: print(line, flush=True))
    print(f"\nlongpeft at {Path(where).parent}: {counts['cases']} bad inputs")
    print(json.dumps({"bench": "probe_bad_inputs", **counts}))


if __name__ == "__main__":
    main()
