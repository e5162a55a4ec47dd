"""``span_at``, the positions an input occupies (what the adaptive ratio and the random mixes keep inside the base's
positions), against the position ids the beacon forward really gives, and against a brute-force count.

The forward's positions: the stock decoder stack is replaced by a recorder, so the scheduler, the window layouts,
the cache's bookkeeping and the parallel groups run as in a real forward (commits included: the cache's layers
hold nothing, its state counts the memory) and hand it the position ids the rotary module would get
(``test_beacon_layout.test_window_span_is_the_largest_position_the_forward_uses`` reads them at the rotary module
of a real model). The brute-force count walks the windows with the rules of the paper's table written out again
(``brute_span``), token by token.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_beacon_layout import authors_choice  # tests/test_beacon_layout.py
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama import modeling_llama

from longpeft.adapters.beacon import BeaconConfig, apply_beacon
from longpeft.adapters.beacon.layout import choose_ratio, span_at, window_span
from longpeft.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = 8
SCHEMES = [  # attn, pos, attend_prev
    ("full-coverage", "interleave", True),
    ("full-coverage", "append", True),
    ("step-expansion", "append", True),
    ("step-expansion", "append", False),
    ("step-expansion", "interleave", False),
    ("segmentation", "append", True),
    ("segmentation", "append", False),
]
# each side of the window borders of up to five windows, and of borders of ratios 2 and 4 inside the first
LENGTHS = (1, 3, 4, 7, 8, 9, 15, 16, 17, 23, 24, 25, 33)


def brute_span(
    window: int, ratio: int, sink: int, length: int, training: bool, attn: str, pos: str, attend_prev: bool, rule: str
) -> int:
    """The largest position + 1 of ``length`` tokens, every window at ``ratio``, from the rules: the memory sits at
    ``0..M-1``; a window's raw token ``i`` and beacon ``j`` (beacon ``j`` condenses raw tokens up to
    ``(j + 1) ratio - 1``) follow it. Full coverage: each slot one position further, in slot order (interleaved: a
    beacon right after raw ``(j + 1) ratio - 1``; appended: all after raw ``window - 1``). Stepwise expansion and
    segmentation: raw ``i`` at ``i``, beacon ``j`` right after the last raw token it reads, ``(j + 1) ratio``, and
    after the earlier beacons it reads when appended with ``attend_prev`` (``+ j``). A beacon exists once the raw
    token it follows has arrived; training gives the window that ends the input none. A full window leaves its
    beacons (ratio 0: its raw tokens) in memory, window 0 also its sink (the authors' rule: at ratio 0 again)."""
    memory, furthest, begin, index = 0, 0, 0, 0
    while begin < length:
        n = min(window, length - begin)
        last = begin + n == length
        beacons = (
            []
            if not ratio or (training and last)
            else [j for j in range(window // ratio) if ((j + 1) * ratio if pos == "interleave" else window) <= n]
        )
        slot = 0
        for i in range(n):
            furthest = max(furthest, memory + (slot if attn == "full-coverage" else i) + 1)
            slot += 1
            if pos == "interleave" and beacons and (i + 1) % ratio == 0 and (i + 1) // ratio - 1 in beacons:
                furthest = max(furthest, memory + (slot if attn == "full-coverage" else i + 1) + 1)
                slot += 1
        if pos == "append":
            for j in beacons:
                step = slot if attn == "full-coverage" else (j + 1) * ratio + (j if attend_prev else 0)
                furthest = max(furthest, memory + step + 1)
                slot += 1
        if not last:
            first = sink if index == 0 and (ratio or rule == "authors") else 0
            memory += first + (n if not ratio else window // ratio)
        begin, index = begin + n, index + 1
    return furthest


@pytest.fixture(scope="module")
def recorded():
    """``(backbone, calls)``: a tiny Llama with beacons whose stock decoder stack only records, per run, the
    largest position id and the keys its attention mask covers."""
    model = tiny_model("llama", attn_implementation="sdpa", num_hidden_layers=1)
    apply_beacon(model, BeaconConfig(window=WINDOW, ratios=[2]).settings())
    calls: list[tuple[int, int]] = []

    def record(self, inputs_embeds, attention_mask, position_ids, **kwargs):
        calls.append((int(position_ids.max()), attention_mask.shape[-1]))
        return BaseModelOutputWithPast(last_hidden_state=torch.zeros_like(inputs_embeds))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_llama.LlamaModel, "forward", record)
        yield model.model, calls


def forward_span(recorded, settings, length: int, training: bool) -> tuple[int, int]:
    """(largest position id + 1, most keys one run reads) of a forward of ``length`` tokens under ``settings``."""
    backbone, calls = recorded
    backbone.beacon_settings = settings
    backbone.train(training)
    calls.clear()
    with torch.no_grad():
        backbone(input_ids=torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(length)))
    return max(p for p, _ in calls) + 1, max(k for _, k in calls)


def settings_grid(scheme, sinks=(0, 1, 3), **extra):
    """``(ratio, sink, rule, settings)`` of every ratio 0/2/4/8 and sink, under longpeft's layout rule and, where the
    scheme allows it, under the authors' with the largest sink (longer than ratio 2: their sink then holds a beacon;
    stored twice at ratio 0); one window per run; ``extra``: more settings."""
    attn, pos, attend_prev = scheme
    for ratio, sink, rule in itertools.product((0, 2, 4, 8), sinks, ("longpeft", "authors")):
        authors_allowed = attn != "segmentation" and (attn, pos) != ("step-expansion", "interleave")
        if rule == "authors" and not (authors_allowed and sink == max(sinks)):
            continue
        config = BeaconConfig(
            window=WINDOW,
            ratios=[ratio],
            attn=attn,
            pos=pos,
            attend_prev=attend_prev,
            sink=sink,
            layout_rule=rule,
            parallel_windows=1,
            **extra,
        )
        yield ratio, sink, rule, config.settings()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda scheme: "/".join(map(str, scheme)))
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_span_at_is_the_largest_position_the_forward_gives(recorded, scheme, training):
    """Every length around the window borders, ratios 0/2/4/8, sinks 0/1/3, both layout rules: the forward's
    largest position + 1 (one window per run; at inference also with parallel windows), the brute-force count and
    ``span_at`` agree, and so do the keys one run reads and ``span_at(keys=True)``. Appended beacons come with a
    window's last raw token: a window that is not full holds none."""
    for ratio, sink, rule, settings in settings_grid(scheme):
        for length in LENGTHS:
            where = (ratio, sink, rule, length)
            positions, keys = forward_span(recorded, settings, length, training)
            assert positions == brute_span(WINDOW, ratio, sink, length, training, *scheme, rule), where
            assert positions == span_at(WINDOW, sink, ratio, length, training, rule, scheme=scheme), where
            assert keys == span_at(WINDOW, sink, ratio, length, training, rule, scheme=scheme, keys=True), where
            assert positions == window_span(settings, length, 256, training)
            if not training and length >= 2 * WINDOW:  # a group of full windows in one run
                parallel = dataclasses.replace(settings, parallel_windows=4)
                assert forward_span(recorded, parallel, length, training)[0] == positions, where


@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[1], SCHEMES[4]], ids=lambda scheme: "/".join(map(str, scheme)))
def test_span_at_counts_the_kept_start_and_end(recorded, scheme):
    """keep_start / keep_end (inference): the kept start raw before the windows, windows from keep_end on raw
    after the condensed ones' beacons, including keep_end at the start (every window raw: the authors' rule then
    stores its sink twice). Lengths each side of the borders of windows that start after the kept start; three
    layouts (what a window itself reaches, the first test checks for every one)."""
    for keep in [(3, None), (3, 3), (3, 19), (0, 0), (0, 16)]:
        sinks = (0,) if keep[0] else (0, 3)  # the kept start is the sink
        for ratio, sink, rule, settings in settings_grid(scheme, sinks, keep_start=keep[0], keep_end=keep[1]):
            for length in (2, 3, 4, 10, 11, 12, 16, 17, 19, 20, 26, 33):
                positions, keys = forward_span(recorded, settings, length, False)
                where = (ratio, sink, rule, keep, length)
                assert positions == span_at(WINDOW, sink, ratio, length, False, rule, keep, scheme), where
                assert keys == span_at(WINDOW, sink, ratio, length, False, rule, keep, scheme, keys=True), where


@pytest.mark.parametrize(
    "scheme,sink,halved",
    [
        # (first, last prompt tokens, ratio) where the adaptive ratio is half the one the recipes' layout takes (full
        # coverage, interleaved beacons: W / r beacons in every full window and those their raw tokens brought in the
        # last): appended beacons are not there before their window is full, stepwise expansion's take raw positions
        (("full-coverage", "append", True), 0, [(13996, 14335, 2), (28468, 28671, 4)]),
        (("step-expansion", "interleave", False), 1, [(13312, 14335, 2), (27648, 28671, 4)]),
        (("full-coverage", "append", True), 1, []),  # sink 1 moves the borders off the lengths where the counts differ
    ],
    ids=["append-sink0", "step-expansion-interleave-sink1", "append-sink1"],
)
def test_adapt_1024_on_llama3_8b_takes_the_smallest_ratio_that_fits(scheme, sink, halved):
    """Llama-3-8B (window 1024, 8,192 positions, ratios 2/4/8), adapt-1024, one length each side of the borders:
    the ratio is the smallest whose brute-force span of the prompt plus 1,024 tokens fits; ``layout_rule: authors``
    keeps the authors' count whatever the layout."""
    window, positions, ratios = 1024, 8192, (2, 4, 8)
    borders = (13312, 13996, 14336, 28468, 28672) if sink == 0 else (13312, 13996, 14336, 27648, 28672)
    for length in sorted({b + side for b in borders for side in (-1, 0)}):
        fits = [
            r for r in ratios if brute_span(window, r, sink, length + 1024, False, *scheme, "longpeft") <= positions
        ]
        ours = choose_ratio(ratios, "adapt-1024", window, positions, length, None, sink=sink, scheme=scheme)
        assert ours == min(fits, default=max(ratios)), length
        authors = choose_ratio(
            ratios, "adapt-1024", window, positions, length, None, sink=sink, rule="authors", scheme=scheme
        )
        assert authors == authors_choice(ratios, window, positions, length + 1024), length
        recipes = choose_ratio(ratios, "adapt-1024", window, positions, length, None, sink=sink)
        half = [ratio for first, last, ratio in halved if first <= length <= last]
        assert (ours, recipes) == ((half[0], 2 * half[0]) if half else (recipes, recipes)), length


@pytest.mark.parametrize("zero_rule", ["any", "authors"])
def test_every_mix_of_the_fitting_ratios_stays_inside_the_positions(recorded, monkeypatch, zero_rule):
    """Training with ratios 0 and 2 mixed per window (step-random): every sequence of draws among the ratios
    ``fitting_ratios`` offers at each window (forced through the scheduler, one run per sequence) keeps the forward's
    largest position inside the base's positions. A raw window leaves more in memory than a condensed one, so ratio 0
    mixed with 2 reaches further than either alone (17 tokens: 20 positions, where 0 alone takes 17 and 2 alone 16)."""
    from longpeft.adapters.beacon import scheduler
    from longpeft.adapters.beacon.layout import fitting_ratios

    backbone, _ = recorded
    picks: list[int] = []

    def forced(
        ratios,
        mix,
        window,
        max_positions,
        length,
        chosen,
        sink=0,
        training=False,
        rule="longpeft",
        keep=(0, None),
        scheme=None,
    ):
        offered = fitting_ratios(ratios, window, sink, max_positions, length, training, keep, rule, scheme)
        return offered[picks.pop(0) % len(offered)] if picks else offered[0]

    monkeypatch.setattr(scheduler, "choose_ratio", forced)
    monkeypatch.setattr(backbone.config, "max_position_embeddings", backbone.config.max_position_embeddings)
    unchecked = fitting_ratios((0, 2), WINDOW, 0, 18, 17, True)
    assert unchecked == (2,)  # 0 alone fits (17 positions), 2 alone fits (16), but 0 then 2 would take 20
    for sink, length in itertools.product((0, 1, 3), (17, 24, 25, 33)):
        settings = BeaconConfig(
            window=WINDOW,
            ratios=[0, 2],
            ratio_mix="step-random",
            sink=sink,
            zero_ratio_rule=zero_rule,
            parallel_windows=1,
        ).settings()
        for positions in range(length - 2, length + sink + WINDOW // 2 + 2):
            if span_at(WINDOW, sink, 2, length, True) > positions:
                continue  # no ratio fits: the largest is taken, and the sample is too long for the base
            backbone.config.max_position_embeddings = positions
            draws = -(-length // WINDOW) - 1  # the window that ends the input draws too, but holds no beacons
            for sequence in itertools.product((0, 1), repeat=draws):
                picks[:] = sequence
                reached, _ = forward_span(recorded, settings, length, True)
                assert reached <= positions, (sink, length, positions, sequence, zero_rule)
