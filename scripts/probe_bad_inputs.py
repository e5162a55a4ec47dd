"""Run longpeft's CLI on >= 100 bad inputs and count how each ends (run by hand; not a test).

Each case calls ``longpeft.cli.main(argv)`` in this process and is classified:

- ``clear``: exit status 2 (3 for a synth run that built nothing), no traceback, a message on stderr;
- ``exit 0``: the command ran to the end (for these inputs: the bad value was accepted silently);
- ``other``: anything else (a traceback, an exception escaping ``main``, a wrong exit status).

Usage::

    python scripts/probe_bad_inputs.py                 # this checkout
    PYTHONPATH=/path/to/old/checkout python scripts/probe_bad_inputs.py   # another version, same cases

The last line is one JSON object with the counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def make_adapter(root: Path) -> Path:
    """A real tiny adapter (trained 1 step) to damage in the merge/export/push cases."""
    from longpeft.cli import main

    data = write(root / "chat.jsonl", "".join(json.dumps({"messages": [
        {"role": "user", "content": f"The pass key is {k}. What is it?"},
        {"role": "assistant", "content": f"It is {k}."}]}) + "\n" for k in range(10000, 10008)))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["train", "tiny-cpu", "--set", f"output_dir={root / 'run'}", "--set", f"data.source={data}",
              "--set", "data.max_length=256", "--set", "train.max_steps=1", "--set", "train.global_batch_size=1",
              "--set", "train.per_device_batch_size=1", "--set", "lora.r=2"])
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
        "train.learning_rate=.inf", "train.learning_rate=.nan", "train.learning_rate=-1", "train.learning_rate=0",
        "train.learning_rate=abc", "rope.rope_theta=.inf", "rope.rope_theta=1e300", "rope.rope_theta=0.5",
        "rope.rope_theta=-3", "rope.rope_theta=x", "rope.factor=.inf", "lora.r=0", "lora.r=-1", "lora.r=a",
        "lora.alpha=-2", "lora.dropout=1.5", "data.max_length=0", "data.max_length=-5", "data.max_length=z",
        "train.max_steps=0", "train.max_steps=-2", "train.global_batch_size=0", "foo.bar=1", "train.bogus=1",
        "lora.rank=3", "train.max_steps=[1", "train.seed={", "trl.bogus=1", "trl.learning_rate=1",
        "method=nope", "method=harpe", "model.dtype=bogus", "lora.embeddings=half",
        "lora.embeddings=token_indices", "data.format=csv", "train.max_grad_norm=.inf", "target_length=-1",
        "=5", "noequals", "rope.rope_type=wavy",
    ]
    out += [(f"plan --set {s}", ["plan", "tiny-cpu", "--set", s]) for s in recipe_sets]
    out += [(f"train --set {s}", ["train", "tiny-cpu", "--set", s, "--set", f"output_dir={root / 'never'}"])
            for s in recipe_sets[:10]]
    bad_yaml = write(root / "recipes" / "bad.yaml", "name: [unclosed\n")
    list_yaml = write(root / "recipes" / "list.yaml", "- a\n- b\n")
    empty_yaml = write(root / "recipes" / "empty.yaml", "")
    binary = root / "recipes" / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    out += [(f"plan {p.name}", ["plan", str(p)]) for p in (bad_yaml, list_yaml, empty_yaml, binary)]
    out += [("plan missing recipe", ["plan", "no-such-recipe"]),
            ("train missing recipe", ["train", str(root / "x.yaml")])]

    base = ["train", "tiny-cpu", "--set", "data.max_length=256", "--set", "train.max_steps=1"]
    data_files = {
        "missing": root / "nope.jsonl",
        "empty": write(root / "data" / "empty.jsonl", ""),
        "malformed": write(root / "data" / "malformed.jsonl", '{"messages": [\n'),
        "null messages": write(root / "data" / "null.jsonl", '{"messages": null}\n'),
        "no assistant": write(root / "data" / "noassist.jsonl",
                              json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"),
        "bad role": write(root / "data" / "role.jsonl",
                          json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n"),
        "txt as messages": write(root / "data" / "doc.txt", "some text"),
        "wrong column": write(root / "data" / "col.jsonl", json.dumps({"conversation": []}) + "\n"),
        "folder without data": (root / "data" / "emptydir"),
    }
    (root / "data" / "emptydir").mkdir(parents=True, exist_ok=True)
    bad_late = write(root / "data" / "late.jsonl", "".join(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
        for _ in range(150)) + json.dumps({"messages": [{"role": "user", "content": None}]}) + "\n")
    data_files["bad row 151"] = bad_late
    for name, path in data_files.items():
        out.append((f"train data {name}", [*base, "--set", f"data.source={path}",
                                           "--set", f"output_dir={root / 'runs' / name.replace(' ', '_')}"]))
    out.append(("train eos outside vocab", [*base, "--set", f"data.source={bad_late}",
                                            "--set", "model.name_or_path=" + str(adapter.parent / "base"),
                                            "--set", "model.eos_token_ids=[99999]",
                                            "--set", f"output_dir={root / 'runs' / 'eos'}"]))
    out.append(("train length beyond positions", [*base, "--set", "data.max_length=4096",
                                                  "--set", f"output_dir={root / 'runs' / 'len'}"]))
    out.append(("train missing base path", [*base, "--set", f"model.name_or_path={root / 'no-base'}",
                                            "--set", f"output_dir={root / 'runs' / 'nb'}"]))
    out.append(("train resume without checkpoint",
                [*base, "--resume", "--set", f"output_dir={root / 'runs' / 'fresh'}"]))

    variants = {
        "spec list": lambda d: write(d / "longpeft.json", "[]"),
        "spec null": lambda d: write(d / "longpeft.json", "null"),
        "spec string": lambda d: write(d / "longpeft.json", '"x"'),
        "spec invalid json": lambda d: write(d / "longpeft.json", "{"),
        "spec truncated": lambda d: write(d / "longpeft.json", (d / "longpeft.json").read_text()[:40]),
        "spec version string": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "format_version": "2"})),
        "spec version 99": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "format_version": 99})),
        "spec huge vocab": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "vocab_size": 10**12})),
        "spec negative vocab": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "vocab_size": -3})),
        "spec base_shape string": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "base_shape": "x"})),
        "spec unknown field": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "zzz": 1})),
        "spec missing": lambda d: (d / "longpeft.json").unlink(),
        "weights missing": lambda d: (d / "adapter_model.safetensors").unlink(),
        "weights garbage": lambda d: (d / "adapter_model.safetensors").write_bytes(b"garbage" * 10),
        "weights truncated": lambda d: (d / "adapter_model.safetensors").write_bytes(
            (d / "adapter_model.safetensors").read_bytes()[:100]),
        "config missing": lambda d: (d / "adapter_config.json").unlink(),
        "config garbage": lambda d: write(d / "adapter_config.json", "{oops"),
        "base gone": lambda d: write(d / "longpeft.json", json.dumps(
            {**json.loads((d / "longpeft.json").read_text()), "base_model": "/no/such/base"})),
    }
    for name, damage in variants.items():
        folder = adapter_variant(root, adapter, name.replace(" ", "_"), damage)
        for command in ("merge", "export"):
            out.append((f"{command} {name}",
                        [command, folder, "--out", str(root / "merged" / f"{command}-{name.replace(' ', '_')}")]))
    out.append(("merge out = adapter", ["merge", str(adapter), "--out", str(adapter)]))
    out.append(("merge out = base", ["merge", str(adapter), "--out", str(adapter.parent / "base")]))
    out.append(("merge out non-empty", ["merge", str(adapter), "--out", str(root / "data")]))
    out.append(("merge out is a file", ["merge", str(adapter), "--out", str(root / "chat.jsonl")]))
    out.append(("merge dtype bogus", ["merge", str(adapter), "--out", str(root / "m-d"), "--dtype", "bogus"]))
    out.append(("merge missing adapter", ["merge", str(root / "nowhere"), "--out", str(root / "m-n")]))
    out.append(("merge without a trained method",
                ["merge", str(adapter), "--out", str(root / "m-w"), "--without", "rope"]))
    out.append(("train string with harpe", ["train", "tiny-harpe-cpu", "--set", "string.shift=200", "--set",
                                            "string.local_window=8", "--set", f"output_dir={root / 'never'}"]))
    out.append(("push dry-run non-empty", ["push", str(adapter), "--repo", "a/b", "--dry-run", str(root / "data")]))
    out.append(("push missing source",
                ["push", str(root / "nowhere"), "--repo", "a/b", "--dry-run", str(root / "p1")]))
    out.append(("push not an adapter", ["push", str(root / "data"), "--repo", "a/b", "--dry-run", str(root / "p2")]))

    model = str(adapter.parent / "base")
    evals = [
        ["eval", "passkey", "--model", str(root / "no-model"), "--out", str(root / "e1")],
        ["eval", "passkey", "--model", model, "--max-new-tokens", "0", "--out", str(root / "e2")],
        ["eval", "passkey", "--model", model, "--string", "--string-window", "0", "--out", str(root / "e3")],
        ["eval", "passkey", "--model", model, "--string", "--string-shift", "5000", "--lengths", "256",
         "--out", str(root / "e4")],
        ["eval", "passkey", "--model", model, "--lengths", "0", "--out", str(root / "e5")],
        ["eval", "passkey", "--model", model, "--adapter", str(root / "no-adapter"), "--out", str(root / "e6")],
        ["eval", "bogus-task", "--model", model, "--out", str(root / "e7")],
        ["eval", "passkey", "--model", model,
         "--adapter", adapter_variant(root, adapter, "eval_spec_list", variants["spec list"]),
         "--out", str(root / "e8")],
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


def classify(argv: list[str]) -> tuple[str, int | None, str]:
    from longpeft.cli import main

    err, std = io.StringIO(), io.StringIO()
    code: int | None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # noqa: BLE001 - an escaped exception is what we count
            traceback.print_exc()
            code = None
    text = err.getvalue()
    if code in (2, 3) and "Traceback" not in text and text.strip():
        return "clear", code, text
    if code == 0:
        return "exit 0", code, text
    return "other", code, text


def main() -> None:
    from longpeft import __file__ as where

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapter = make_adapter(root)
        all_cases = cases(root, adapter)
        counts = {"clear": 0, "exit 0": 0, "other": 0}
        for name, argv in all_cases:
            kind, code, text = classify(argv)
            counts[kind] += 1
            last = (text.strip().splitlines() or [""])[-1][:150]
            print(f"{kind:<9} rc={code!s:<4} {name:<40} {last}", flush=True)
    print(f"\nlongpeft at {Path(where).parent}: {len(all_cases)} bad inputs")
    print(json.dumps({"bench": "probe_bad_inputs", "cases": len(all_cases), **counts}))


if __name__ == "__main__":
    main()
