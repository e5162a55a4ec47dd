"""The authors' ``config.json``: their ``beacon_*`` keys read into a :class:`~.config.BeaconConfig`, and their RoPE
settings compared with the stock base's. A refusal names the file, the key, the value it holds and what it must hold
(:data:`AUTHORS_KEYS`), or the keys of a combination the authors' rule cannot reproduce."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...base_config import rope_parameters_from_json, rope_parameters_of
from ...errors import ConfigError, DataError
from .config import RATIO_MIX, BeaconConfig

# What each key of the authors' config must hold; the defaults are those of their training arguments (src/args.py)
AUTHORS_KEYS = {
    "beacon_window": "a whole number of tokens >= 1, at most the base's positions",
    "beacon_stride": "the same number as beacon_window (longpeft supports stride == window)",
    "beacon_ratio": "a non-empty list of whole numbers, each 0 or a divisor of beacon_window",
    "beacon_ratio_mix": "one of step-random, instance-random, sequence or adapt-N (N a whole number of tokens)",
    "beacon_attn": "one of full-coverage, step-expansion",
    "beacon_pos": "one of interleave, append",
    "beacon_param": "a non-empty list of q, k, v, o, each at most once",
    "beacon_sink_size": "a whole number >= 0, below beacon_window",
    "beacon_attend_prev": "true or false",
}


def _refuse(source: str, key: str, value: Any, why: str = "") -> DataError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return DataError(
        f"{source}: {key} is {shown}{why}; it must be {AUTHORS_KEYS[key]}: edit {key} there (the authors' "
        "released config.json has it right)"
    )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ratios(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_whole(ratio) and ratio >= 0 for ratio in value)


def _projections(value: Any) -> bool:
    listed = isinstance(value, list) and bool(value) and all(p in ("q", "k", "v", "o") for p in value)
    return listed and len(set(value)) == len(value)


def rope_settings(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The RoPE settings a config.json states, as transformers 5 reads them (:func:`rope_parameters_from_json`:
    ``rope_type``, ``rope_theta``, ``factor``, ...; no ``rope_theta``: 10000, the authors' config classes' too)."""
    for name in ("rope_scaling", "rope_parameters"):
        stated = config.get(name)
        if stated is not None and not isinstance(stated, dict):
            raise DataError(f"{source}: {name} is {stated!r}; it must be null or an object: edit {name}")
    settings = rope_parameters_from_json(config)
    settings.pop("type", None)
    return settings


def _rope_key(config: dict[str, Any], setting: str) -> str:
    """The key of ``config`` that states a RoPE ``setting`` of :func:`rope_settings` (``rope_scaling.type``,
    ``rope_theta``, ``rope_parameters.factor``, ...)."""
    scaling = config.get("rope_scaling")
    if not scaling and "rope_parameters" in config:
        return f"rope_parameters.{setting}"
    if setting in ("rope_theta", "partial_rotary_factor"):
        return setting
    if setting == "rope_type" and "rope_type" not in (scaling or {}):
        return "rope_scaling.type"
    return f"rope_scaling.{setting}"


def _same(first: Any, second: Any) -> bool:
    numbers = (int, float)
    if isinstance(first, numbers) and isinstance(second, numbers) and not isinstance(first, bool):
        return not isinstance(second, bool) and math.isclose(first, second, rel_tol=1e-9, abs_tol=0.0)
    return first == second


def _differs(file: str, key: str, theirs: Any, ours: Any, base: str, why: str) -> ConfigError:
    return ConfigError(
        f"{file}: {key} is {theirs!r} there and {ours!r} in the base {base}: {why}; give the stock base it was built "
        f"on (--base), or set {key} in {file} to the base's if that is the base it was built on"
    )


def check_built_on(
    config: dict[str, Any], base_config: Any, beacon: BeaconConfig, source: str, base: str, file: str
) -> None:
    """Refuse, naming the key in ``file`` (the checkpoint's config.json), a checkpoint that is not built on the stock
    base ``base`` (``base_config``, a transformers config): its shape, any RoPE setting (:func:`rope_settings`
    against the base's ``rope_parameters``), and ``max_position_embeddings`` when the converted ``beacon`` lists more
    than one ratio (their ratio choice counts it) or a window longer than the base's positions."""
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not _same(config.get(key), getattr(base_config, key, None)):
            raise ConfigError(
                f"{source} is not built on {base}: {key} is {config.get(key)!r} in {file} and "
                f"{getattr(base_config, key, None)!r} in the base; give the matching stock base with --base"
            )
    theirs, ours = rope_settings(config, file), rope_parameters_of(base_config)
    ours.pop("type", None)
    why = "the beacon weights were trained with the checkpoint's RoPE, which the converted adapter would not use"
    for setting in sorted(set(theirs) | set(ours), key=lambda name: (name != "rope_type", name != "rope_theta", name)):
        if not _same(theirs.get(setting), ours.get(setting)):
            raise _differs(file, _rope_key(config, setting), theirs.get(setting), ours.get(setting), base, why)
    positions = getattr(base_config, "max_position_embeddings", None)
    stated = config.get("max_position_embeddings", positions)
    several = len(set(beacon.ratios)) > 1 or len(set(beacon.inference_ratios or beacon.ratios)) > 1
    if several and not _same(stated, positions):
        ratios = sorted(set(beacon.ratios))
        why = f"the authors' ratio choice among {ratios} counts it, and the converted adapter would count the base's"
        raise _differs(file, "max_position_embeddings", stated, positions, base, why)
    if positions is not None and beacon.window > positions:
        raise _refuse(file, "beacon_window", beacon.window, f" (the base {base} has {positions} positions)")


def config_from_authors(config: dict[str, Any], source: str = "config.json") -> BeaconConfig:
    """Our ``beacon`` section from the ``beacon_*`` keys of an authors' config.json (``source`` names it in errors),
    with ``layout_rule: authors``, so that the converted model reads as their code does. ``beacon_embed_init`` is
    read as their code reads it (``bos``, else ``eos``); ``beacon_parallel_window`` (how many windows a forward runs,
    not what they compute) is not read.

    Raises:
        DataError: naming the key: not a beacon checkpoint, a key holding what their code cannot use
            (:data:`AUTHORS_KEYS`), a layout the authors' rule cannot reproduce, or a scaled RoPE.
    """
    if "beacon_window" not in config:
        raise DataError(f"{source} has no beacon_window: not an Activation Beacon checkpoint")

    def read(key: str, default: Any, valid: Callable[[Any], bool], why: str = "") -> Any:
        value = config.get(key, default)
        if not valid(value):
            raise _refuse(source, key, value, why)
        return value

    window = read("beacon_window", None, lambda value: _whole(value) and value >= 1)
    read("beacon_stride", window, lambda value: value == window and _whole(value))
    ratios = read("beacon_ratio", [2, 4, 8], _ratios)
    bad = [ratio for ratio in ratios if ratio and (ratio > window or window % ratio)]
    if bad:
        raise _refuse(source, "beacon_ratio", ratios, f" ({bad[0]} does not divide beacon_window {window})")
    mix = read(
        "beacon_ratio_mix", "step-random", lambda value: isinstance(value, str) and bool(RATIO_MIX.match(value))
    )
    fails = " (the authors' code fails placing its beacons there: a TypeError, so no model of theirs runs it)"
    read("beacon_attn", "full-coverage", lambda value: value != "segmentation", fails)
    attn = read("beacon_attn", "full-coverage", lambda value: value in ("full-coverage", "step-expansion"))
    pos = read("beacon_pos", "interleave", lambda value: value in ("interleave", "append"))
    if (attn, pos) == ("step-expansion", "interleave"):
        raise DataError(
            f"{source}: beacon_attn step-expansion with beacon_pos interleave: the authors' mask there hides window "
            "slots 0 and 1 instead of the beacons (a bug in their indexing), which longpeft does not reproduce; "
            "the released models use beacon_attn full-coverage"
        )
    attend_prev = read("beacon_attend_prev", True, lambda value: isinstance(value, bool))
    sink = read("beacon_sink_size", 0, lambda value: _whole(value) and 0 <= value < window)
    params = read("beacon_param", ["q", "k", "v"], _projections)
    factor = rope_settings(config, source).get("factor")
    if factor is not None and not _same(factor, 1):
        raise DataError(
            f"{source}: {_rope_key(config, 'factor')} is {factor!r}: the authors' adapt-N counts "
            f"max_position_embeddings x {factor} positions there, which longpeft does not reproduce; no released "
            f"Activation Beacon model scales its RoPE (remove the scaling from {source} if the model was trained "
            "without it)"
        )
    return BeaconConfig(
        window=window,
        ratios=ratios,
        ratio_mix=mix,
        # their code reads one mix in both modes; a random one becomes adapt-1024 at inference
        inference_ratio_mix=mix if mix.startswith("adapt-") or mix == "sequence" else "adapt-1024",
        attn=attn,
        pos=pos,
        params=params,
        sink=sink,
        # full-coverage's mask is plain causal: their code reads beacon_attend_prev only with the other schemes
        attend_prev=None if attn == "full-coverage" else attend_prev,
        embed_init="bos" if config.get("beacon_embed_init") == "bos" else "eos",
        layout_rule="authors",
    ).resolved()
