"""``longpeft convert-beacon`` over generated authors' checkpoints: their config.json with every ``beacon_*`` key
drawn from the values their code runs with (and the layouts the authors' rule reproduces), RoPE settings and
positions equal to the base's, then at most one key given a value that is wrong for it alone (another type, out of
range, a nonsense string, a nested object; another RoPE base or scaling; other positions where the ratio choice
counts them). The only outcomes: a conversion whose longpeft.json records the drawn settings, or exit 2 with one
error line naming the key that was spoiled (never a traceback, never pydantic's text)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from longpeft.cli import main

POSITIONS = 256  # the tiny base's max_position_embeddings
PROJECTIONS = ("q", "k", "v", "o")
MIX = re.compile(r"^(step-random|instance-random|sequence|adapt-\d+)$")
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**40), 2**40),
    st.text(max_size=12),
    st.lists(st.integers(-4, 4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def divides(ratio, window: int) -> bool:
    """A ratio the authors' code takes for ``window``: 0, or a whole divisor of the window."""
    return whole(ratio) and (ratio == 0 or (0 < ratio <= window and window % ratio == 0))


@st.composite
def valid_beacon_keys(draw) -> dict:
    """The authors' beacon keys with values their code runs with, in layouts longpeft reproduces."""
    window = draw(st.sampled_from([8, 16, 32]))
    attn = draw(st.sampled_from(["full-coverage", "step-expansion"]))
    pos = "append" if attn == "step-expansion" else draw(st.sampled_from(["interleave", "append"]))
    divisors = [r for r in (0, 1, 2, 4, 8, 16) if r == 0 or window % r == 0]
    keys = {
        "beacon_window": window,
        "beacon_stride": window,
        "beacon_ratio": draw(st.lists(st.sampled_from(divisors), min_size=1, max_size=4)),
        "beacon_ratio_mix": draw(
            st.one_of(
                st.sampled_from(["step-random", "instance-random", "sequence"]),
                st.integers(0, 4096).map(lambda n: f"adapt-{n}"),
            )
        ),
        "beacon_attn": attn,
        "beacon_pos": pos,
        "beacon_param": draw(st.permutations(PROJECTIONS).flatmap(lambda p: st.integers(1, 4).map(lambda n: p[:n]))),
        "beacon_sink_size": draw(st.integers(0, window - 1)),
        "beacon_attend_prev": draw(st.booleans()),
        "beacon_embed_init": draw(st.sampled_from(["eos", "bos"])),
        "beacon_parallel_window": draw(st.integers(1, 4)),
    }
    keys["beacon_param"] = list(keys["beacon_param"])
    return keys


def spoiled_value(key: str, keys: dict, base: dict):
    """A strategy of values wrong for ``key`` whatever the other keys hold (``keys``: the valid ones)."""
    window = keys["beacon_window"]
    if key == "beacon_window":  # a multiple of 16 past the positions keeps every drawn ratio a divisor
        return JUNK.filter(lambda v: not whole(v) or v < 1) | st.integers(17, 40).map(lambda n: 16 * n)
    if key == "beacon_stride":
        return JUNK.filter(lambda v: v != window or not whole(v))
    if key == "beacon_ratio":
        return st.one_of(
            JUNK.filter(lambda v: not (isinstance(v, list) and v and all(whole(r) and r >= 0 for r in v))),
            st.just([]),
            st.sampled_from([3, window + 1, -2, 2.0, "2", True]).map(lambda bad: [*keys["beacon_ratio"], bad]),
        ).filter(lambda v: not (isinstance(v, list) and v and all(divides(r, window) for r in v)))
    if key == "beacon_ratio_mix":
        return JUNK.filter(lambda v: not (isinstance(v, str) and MIX.match(v))) | st.sampled_from(
            ["adapt", "adapt-x", "adapt-1.5", "Sequence", "random"]
        )
    if key == "beacon_attn":
        valid = ("full-coverage", "step-expansion")
        return JUNK.filter(lambda v: v not in valid) | st.sampled_from(["segmentation", "Full-coverage", ""])
    if key == "beacon_pos":
        return JUNK.filter(lambda v: v not in ("interleave", "append")) | st.sampled_from(["prepend", "Interleave"])
    if key == "beacon_param":
        return st.one_of(
            JUNK.filter(lambda v: not (isinstance(v, list) and v and set(v) <= set(PROJECTIONS))),
            st.just([]),
            st.just(["q", "q"]),
            st.sampled_from(["x", "gate", 1, None]).map(lambda bad: [*keys["beacon_param"], bad]),
        )
    if key == "beacon_sink_size":
        return JUNK.filter(lambda v: not (whole(v) and 0 <= v < window)) | st.integers(window, 4 * window)
    if key == "beacon_attend_prev":
        return JUNK.filter(lambda v: not isinstance(v, bool))
    if key == "rope_parameters.rope_theta":
        theta = base["rope_parameters"]["rope_theta"]
        return st.floats(2.0, 1e9).filter(lambda v: abs(v - theta) > 1e-3 * theta) | JUNK.filter(
            lambda v: not (isinstance(v, (int, float)) and v == theta)
        )
    if key == "rope_parameters.factor":
        return st.floats(1.5, 64.0)
    if key == "max_position_embeddings":
        return st.integers(1, 2**20).filter(lambda v: v != POSITIONS) | JUNK.filter(lambda v: v != POSITIONS)
    raise AssertionError(key)


SPOILABLE = (
    "beacon_window",
    "beacon_stride",
    "beacon_ratio",
    "beacon_ratio_mix",
    "beacon_attn",
    "beacon_pos",
    "beacon_param",
    "beacon_sink_size",
    "beacon_attend_prev",
    "rope_parameters.rope_theta",
    "rope_parameters.factor",
    "max_position_embeddings",
)


@pytest.fixture(scope="module")
def base(tiny_base_dirs):
    folder = tiny_base_dirs("llama")
    return folder, json.loads((folder / "config.json").read_text())


def convert(authors: Path, base_dir: Path, out: Path) -> tuple[int, str]:
    """``longpeft convert-beacon`` as a user runs it: its exit status and what it printed on stderr."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = main(["convert-beacon", str(authors), "--base", str(base_dir), "--out", str(out)])
    return status, stderr.getvalue()


def write_checkpoint(folder: Path, config: dict, params: list, base_config: dict) -> None:
    """An authors' checkpoint as the converter reads it: config.json and the beacon tensors of ``params``."""
    hidden, layers = base_config["hidden_size"], base_config["num_hidden_layers"]
    heads, kv_heads = base_config["num_attention_heads"], base_config["num_key_value_heads"]
    head_dim = base_config.get("head_dim") or hidden // heads
    shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden)}
    shapes["o"] = (hidden, heads * head_dim)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.self_attn.beacon_{p}_proj.weight": torch.randn(shapes[p], generator=generator)
        for i in range(layers)
        for p in params
        if p in shapes
    }
    tensors["model.beacon_embed_tokens.weight"] = torch.randn(1, hidden, generator=generator)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))


def spoil(config: dict, key: str, value) -> None:
    if key.startswith("rope_parameters."):
        config["rope_parameters"] = {**config["rope_parameters"], key.split(".", 1)[1]: value}
    else:
        config[key] = value
        if key == "beacon_window":
            config.pop("beacon_stride")  # the stride follows the window (their default)


@pytest.mark.property
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_convert_beacon_converts_or_names_the_key_it_cannot_use(base, data):
    base_dir, base_config = base
    keys = data.draw(valid_beacon_keys(), label="valid keys")
    spoiled = data.draw(st.none() | st.sampled_from(SPOILABLE), label="spoiled key")
    config = {**base_config, **keys, "auto_map": {"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}}
    config.pop("beacon", None)
    several_ratios = len(set(keys["beacon_ratio"])) > 1
    if spoiled is not None:
        value = data.draw(spoiled_value(spoiled, keys, base_config), label="its value")
        spoil(config, spoiled, value)
    params = config["beacon_param"] if isinstance(config["beacon_param"], list) else keys["beacon_param"]
    params = [p for p in params if p in PROJECTIONS] or keys["beacon_param"]
    with tempfile.TemporaryDirectory() as folder:
        authors, out = Path(folder) / "authors", Path(folder) / "ours"
        write_checkpoint(authors, config, params, base_config)
        status, stderr = convert(authors, base_dir, out)
        errors = [line for line in stderr.splitlines() if "error:" in line]
        converts = spoiled is None or (spoiled == "max_position_embeddings" and not several_ratios)
        if converts:
            assert status == 0, stderr
            recorded = json.loads((out / "longpeft.json").read_text())["methods"]["beacon"]
            assert (recorded["window"], recorded["ratios"], recorded["params"], recorded["sink"]) == (
                keys["beacon_window"],
                keys["beacon_ratio"],
                keys["beacon_param"],
                keys["beacon_sink_size"],
            )
            assert (recorded["attn"], recorded["pos"], recorded["layout_rule"]) == (
                keys["beacon_attn"],
                keys["beacon_pos"],
                "authors",
            )
        else:
            assert status == 2, stderr
            assert len(errors) == 1 and spoiled in errors[0], stderr
            assert "Traceback" not in stderr and "validation error" not in errors[0]
            assert not out.exists()


@pytest.mark.parametrize(
    ("rope", "key"),
    [
        ({"rope_theta": 10000.0, "rope_scaling": None}, None),  # the tiny base's RoPE, as transformers 4 writes it
        ({}, None),  # no rope_theta: their config classes' 10000, the base's
        ({"rope_theta": 500000.0, "rope_scaling": None}, "rope_theta"),
        ({"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 1.0}}, "rope_scaling.type"),
        ({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.factor"),
        ({"rope_theta": 10000.0, "rope_scaling": "linear"}, "rope_scaling"),
    ],
)
def test_convert_beacon_compares_a_transformers_4_config_s_rope_with_the_base_s(base, tmp_path, rope, key):
    """The authors' checkpoints are written by transformers 4.39 (``rope_theta``, ``rope_scaling``): each RoPE setting
    that differs from the base's is refused naming the key to edit; the base's own converts."""
    base_dir, base_config = base
    config = {k: v for k, v in base_config.items() if k != "rope_parameters"}
    config.update(rope, beacon_window=8, beacon_ratio=[2, 4], beacon_param=["q", "k", "v"])
    write_checkpoint(tmp_path / "authors", config, ["q", "k", "v"], base_config)
    status, stderr = convert(tmp_path / "authors", base_dir, tmp_path / "ours")
    if key is None:
        assert status == 0, stderr
    else:
        error = next(line for line in stderr.splitlines() if "error:" in line)
        assert status == 2 and f"config.json: {key} is " in error, stderr


def test_convert_beacon_refuses_beacon_weights_that_beacon_param_does_not_list(base, tmp_path):
    base_dir, base_config = base
    config = {**base_config, "beacon_window": 8, "beacon_ratio": [2], "beacon_param": ["q", "k"]}
    write_checkpoint(tmp_path / "authors", config, ["q", "k", "v"], base_config)
    status, stderr = convert(tmp_path / "authors", base_dir, tmp_path / "ours")
    assert status == 2 and "beacon_param is ['q', 'k'], and" in stderr and "of the v projections too" in stderr
