"""The ``beacon`` section of recipes and of ``longpeft.json``, and its pure settings logic (no torch)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from ...config import StrictModel
from ...errors import ConfigError
from ...family import IGNORE_INDEX
from ..registry import ResolveContext

if TYPE_CHECKING:
    import torch

    from .layout import BeaconSettings

RATIO_MIX = re.compile(r"^(step-random|instance-random|sequence|adapt-\d+)$")  # ratio_mix's values
DEFAULT_LORA_RANK = 32
# The settings only inference reads: a model with beacons may change them (``set_inference_settings``).
INFERENCE_SETTINGS = ("inference_ratios", "inference_ratio_mix", "parallel_windows", "keep_start", "keep_end")


def _check_ratios(ratios: list[int], window: int, key: str) -> None:
    if not ratios:
        raise ValueError(f"{key} must list at least one ratio (0 = keep the window's raw K/V)")
    for ratio in ratios:
        if ratio < 0 or (ratio and (ratio > window or window % ratio)):
            raise ValueError(
                f"{key}: ratio {ratio} must be 0 or divide window {window} (each window of {window} raw tokens "
                f"gets window / ratio beacons); choose ratios that divide the window"
            )


def resolve_attend_prev(attn: str, pos: str, attend_prev: bool | None) -> bool:
    """``attend_prev`` implied or allowed by the scheme (full-coverage: always; step-expansion + interleave: never)."""
    if attn == "full-coverage":
        if attend_prev is False:
            raise ValueError("attend_prev: false is impossible with attn: full-coverage (its mask is plain causal)")
        return True
    if attn == "step-expansion" and pos == "interleave":
        if attend_prev:
            raise ValueError("attend_prev: true is not possible with attn: step-expansion and pos: interleave")
        return False
    return True if attend_prev is None else attend_prev


class BeaconConfig(StrictModel):
    """Activation Beacon settings (Zhang et al., "Soaring from 4K to 400K"; docs/beacon.md describes each).

    ``window``: raw tokens per window. ``ratios``: the condensing ratios of training windows (window / ratio beacons;
    0 keeps the raw K/V), picked by ``ratio_mix`` (``step-random``, ``instance-random``, ``sequence``, ``adapt-N``);
    ``inference_ratios`` / ``inference_ratio_mix``: the same in eval mode (default: the training ratios,
    ``adapt-1024``); ``zero_ratio_rule``: which training windows may take ratio 0. ``attn``: which raw tokens a beacon
    condenses; ``pos``: beacons ``interleave``d or ``append``ed; ``attend_prev``: beacons see their window's earlier
    beacons (implied by the scheme when unset). ``params``: projections with beacon weights; ``sink``: first-window raw
    tokens kept in memory for good; ``embed_init``: the row (eos or bos) the beacon embedding starts as;
    ``projection``: ``full`` copies or ``lora`` deltas (``lora_rank``, scaled by ``lora_alpha / lora_rank``).
    ``layout_rule``: whose rules choose the adapt-N ratio and lay out the sink (``longpeft`` or ``authors``).
    Inference only: ``parallel_windows``, the full windows a prefill runs per forward; ``keep_start`` / ``keep_end``:
    the first tokens, and those from index ``keep_end`` on, stay uncondensed. Each setting is declared here only;
    :meth:`settings` gives them to the modeling code (``layout.BeaconSettings``)."""

    window: int = Field(default=1024, ge=1)
    ratios: list[int] = Field(default_factory=lambda: [2, 4, 8])
    ratio_mix: str = "step-random"
    zero_ratio_rule: Literal["authors", "any"] = "authors"
    inference_ratios: list[int] | None = None
    inference_ratio_mix: str = "adapt-1024"
    attn: Literal["full-coverage", "step-expansion", "segmentation"] = "full-coverage"
    pos: Literal["interleave", "append"] = "interleave"
    params: list[Literal["q", "k", "v", "o"]] = Field(default_factory=lambda: ["q", "k", "v"])
    sink: int = Field(default=0, ge=0)
    attend_prev: bool | None = None
    embed_init: Literal["eos", "bos"] = "eos"
    projection: Literal["full", "lora"] = "full"
    lora_rank: int | None = Field(default=None, gt=0)
    lora_alpha: float | None = Field(default=None, gt=0)
    layout_rule: Literal["longpeft", "authors"] = "longpeft"
    parallel_windows: int = Field(default=4, ge=1)
    keep_start: int = Field(default=0, ge=0)
    keep_end: int | None = Field(default=None, ge=0)

    @field_validator("ratio_mix", "inference_ratio_mix")
    @classmethod
    def _mix(cls, value: str) -> str:
        if not RATIO_MIX.match(value):
            raise ValueError(
                f"{value!r} is not step-random, instance-random, sequence or adapt-N (N: tokens still to come)"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> BeaconConfig:
        _check_ratios(self.ratios, self.window, "ratios")
        if self.inference_ratios is not None:
            _check_ratios(self.inference_ratios, self.window, "inference_ratios")
        if len(set(self.params)) != len(self.params) or not self.params:
            raise ValueError(f"params must name each of q, k, v, o at most once and at least one, got {self.params}")
        if self.sink >= self.window:
            raise ValueError(f"sink ({self.sink}) must be smaller than window ({self.window})")
        if self.attn == "segmentation" and self.pos == "interleave":
            raise ValueError(
                "attn: segmentation with pos: interleave is not implemented (nor in the authors' code); "
                "use pos: append"
            )
        resolve_attend_prev(self.attn, self.pos, self.attend_prev)
        if self.layout_rule == "authors" and self.attn == "segmentation":
            raise ValueError(
                "layout_rule: authors cannot reproduce attn: segmentation: the authors' code fails there (a "
                "TypeError placing its beacons); use layout_rule: longpeft (beacons after the tokens they "
                "read, as the paper says)"
            )
        if self.layout_rule == "authors" and (self.attn, self.pos) == ("step-expansion", "interleave"):
            raise ValueError(
                "layout_rule: authors cannot reproduce attn: step-expansion with pos: interleave: the "
                "authors' mask there hides window slots 0 and 1 instead of the beacons (a bug in their "
                "indexing); use layout_rule: longpeft (raw tokens never see the window's beacons, as the "
                "paper says)"
            )
        # keep_start / keep_end as the authors allow them: the kept start is the sink, no window is cut
        if self.keep_start and self.sink:
            raise ValueError(f"keep_start ({self.keep_start}) keeps the first tokens in memory already; set sink: 0")
        condensed = 0 if self.keep_end is None else self.keep_end - self.keep_start
        if condensed < 0 or condensed % self.window:
            nearest = self.keep_start + self.window * max(0, round(condensed / self.window))
            raise ValueError(
                f"keep_end ({self.keep_end}) must be keep_start ({self.keep_start}) plus a whole number of windows "
                f"of {self.window} tokens, so that no window is cut (e.g. keep_end: {nearest})"
            )
        if self.projection == "full" and (self.lora_rank is not None or self.lora_alpha is not None):
            raise ValueError(
                "lora_rank and lora_alpha are settings of projection: lora; remove them or set projection: lora"
            )
        return self

    def resolved(self) -> BeaconConfig:
        """This config with every implied value written out (what ``longpeft.json`` records)."""
        lora = self.projection == "lora"
        rank = self.lora_rank or (DEFAULT_LORA_RANK if lora else None)
        return self.model_copy(
            update={
                "inference_ratios": list(self.inference_ratios if self.inference_ratios is not None else self.ratios),
                "attend_prev": resolve_attend_prev(self.attn, self.pos, self.attend_prev),
                "lora_rank": rank,
                "lora_alpha": (self.lora_alpha or float(rank)) if lora else None,
            }
        )

    def settings(self) -> BeaconSettings:
        """The runtime settings (:class:`~.layout.BeaconSettings`, of the modeling code)."""
        from .layout import BeaconSettings

        return BeaconSettings.from_dict(self.resolved().model_dump())


def resolve(config: BeaconConfig, context: ResolveContext) -> BeaconConfig:
    """Write out the implied settings (inference ratios, attend_prev, LoRA rank and alpha); a training run
    (``context.trained_length``) refuses ``keep_start`` / ``keep_end``, which only inference reads."""
    if context.trained_length and (config.keep_start or config.keep_end is not None):
        raise ConfigError(
            "beacon.keep_start / beacon.keep_end are inference settings (the authors' options to leave the start or "
            "the end of a prompt uncondensed), and training condenses every window; remove them from the recipe "
            "and set them on the trained model (longpeft.adapters.beacon.set_inference_settings)"
        )
    return config.resolved()


def describe(config: BeaconConfig) -> list[str]:
    """Model-card sentence: windows, ratios, layout, projections, and the ratio at inference."""
    ratios = ", ".join(map(str, config.ratios))
    authors = (
        ", counted as in the authors' code, whose sink layout it keeps too" if config.layout_rule == "authors" else ""
    )
    return [
        f"Activation Beacon: windows of {config.window} tokens condensed at ratios {ratios} ({config.attn}, "
        f"{config.pos}, beacon projections {'/'.join(config.params)} as {config.projection}, sink {config.sink}); "
        f"at inference the ratio adapts to the input ({config.inference_ratio_mix}){authors}."
    ]


def planned_parameters(config: BeaconConfig, shape) -> tuple[int, int]:
    """(trainable, frozen) beacon parameters on a base of ``shape`` (a ``ModelShape``): per layer a copy or a
    low-rank delta of each projection in ``params``, and one embedding row; the last layer's q and o twins stay
    frozen (see ``patch.trainable_beacon_parameters``). Biases are not counted."""
    config = config.resolved()
    full = config.projection == "full"
    per_projection = {}
    for name in config.params:
        in_features, out_features = shape.projection_shape(f"{name}_proj")
        per_projection[name] = in_features * out_features if full else config.lora_rank * (in_features + out_features)
    frozen = sum(per_projection.get(name, 0) for name in ("q", "o"))
    return shape.layers * sum(per_projection.values()) - frozen + shape.hidden, frozen


def training_labels(config: BeaconConfig, labels: torch.Tensor) -> torch.Tensor:
    """``labels [batch, seq]`` without the first window's targets (tokens 1..window), as the authors train every
    layout but full-coverage + interleave: there the first window's tokens read no beacon, so they teach the beacons
    nothing (``modeling_beacon.py``: "skip computing loss in the very first window")."""
    if (config.attn, config.pos) == ("full-coverage", "interleave"):
        return labels
    labels = labels.clone()
    labels[:, : config.window + 1] = IGNORE_INDEX
    return labels
