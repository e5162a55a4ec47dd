"""The ``sequence`` ratio mix and the authors' training rule for ratio 0, against an independent reference: a
re-statement of the authors' per-window ratio choice (``Memory.set_compression_ratio`` and the window loop of
``Memory._step`` in FlagEmbedding research/Long_LLM/activation_beacon/src/modeling_beacon.py), written here from
their semantics. The model side is observed where it acts: the ratio each window's layout is built with, the
candidates a random draw chooses among, and the memory the windows leave behind."""

from __future__ import annotations

import itertools

import pytest
import torch

from longpeft.adapters.beacon import BeaconConfig, apply_beacon, scheduler
from longpeft.tiny import tiny_model

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

WINDOW = 8


def authors_window_ratios(ratios, mix, window, length, training, draw=None):
    """Per window of a ``length``-token input: ``(ratio, candidates)`` as the authors choose them, with ``(None, ())``
    for the window that ends a training input (no choice is made there; it gets no beacons).

    Their rule: with more than one listed ratio, ratio 0 is a candidate of a training window only when no earlier
    window took 0 and the next window is full (window start + stride + window <= length); ``sequence`` cycles through
    the first window's candidates in the listed order; ``instance-random`` keeps its first draw; ``step-random``
    draws (``draw(window_index, candidates)``) at every window.
    """
    out, history, fixed, cycle = [], [], None, None
    for index, start in enumerate(range(0, length, window)):
        if training and start + window >= length:
            out.append((None, ()))
            break
        if len(ratios) == 1:
            out.append((ratios[0], tuple(ratios)))
            history.append(ratios[0])
            continue
        candidates = tuple(
            r for r in ratios if not (r == 0 and training and (0 in history or start + 2 * window > length))
        )
        if mix == "sequence":
            cycle = cycle or itertools.cycle(candidates)
            ratio = next(cycle)
        elif mix == "instance-random":
            fixed = fixed if fixed is not None else draw(index, candidates)
            ratio = fixed
        else:
            ratio = draw(index, candidates)
        out.append((ratio, candidates))
        history.append(ratio)
    return out


def beacon_model(positions=256, **settings):
    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=positions)
    apply_beacon(model, BeaconConfig(window=WINDOW, sink=1, **settings).settings())
    return model


@pytest.fixture
def run_windows(monkeypatch):
    """``run(model, length, training, seed)``: one forward over ``length`` tokens; returns the ratio each window's
    layout was built with, the candidates of each ``choose_ratio`` call, and the memory entries left in the cache."""
    layouts, draws = [], []
    real_layout, real_choose = scheduler.window_layout, scheduler.choose_ratio
    monkeypatch.setattr(
        scheduler,
        "window_layout",
        lambda window, ratio, *rest: layouts.append(ratio) or real_layout(window, ratio, *rest),
    )
    monkeypatch.setattr(
        scheduler,
        "choose_ratio",
        lambda ratios, *rest, **kw: draws.append(tuple(ratios)) or real_choose(ratios, *rest, **kw),
    )

    def run(model, length, training, seed=0):
        layouts.clear()
        draws.clear()
        ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))
        model.train(training)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model(ids)
        return list(layouts), list(draws), out.past_key_values.state.memory_length

    return run


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(
    ("ratios", "length"),
    [
        ((2, 4, 8), 5 * WINDOW + 3),
        ((8, 2), 6 * WINDOW),
        ((0, 2, 4), 6 * WINDOW + 1),  # 0 in the cycle (a full window follows the first), so it comes back
        ((2, 0, 4), WINDOW + 5),  # training: no full window after the first, so 0 leaves the cycle
        ((4,), 3 * WINDOW + 2),
    ],
)
def test_sequence_mix_cycles_like_the_authors(ratios, length, training, run_windows):
    model = beacon_model(
        ratio_mix="sequence", inference_ratios=list(ratios), inference_ratio_mix="sequence", ratios=list(ratios)
    )
    layouts, _, memory = run_windows(model, length, training)
    reference = authors_window_ratios(ratios, "sequence", WINDOW, length, training)
    assert layouts == [0 if ratio is None else ratio for ratio, _ in reference]
    # the committed windows (all but the last) left sink + their beacons (or, at ratio 0, their raw tokens)
    committed = [ratio for ratio, _ in reference[:-1]]
    assert memory == 1 + sum(WINDOW if ratio == 0 else WINDOW // ratio for ratio in committed) - (committed[:1] == [0])


def test_sequence_mix_takes_only_ratios_that_keep_the_input_inside_the_positions(run_windows, monkeypatch):
    """120 tokens on 64 positions with windows of 8 and sink 1: ratio 2 would reach position 64 (see
    test_beacon_layout), so the cycle is 4, 8, 4, ... where the authors' would be 2, 4, 8, 2, ..."""
    seen = []
    model = beacon_model(positions=64, ratios=[2, 4, 8], ratio_mix="sequence")
    rotary = model.model.rotary_emb
    real_forward = rotary.forward
    monkeypatch.setattr(
        rotary,
        "forward",
        lambda x, position_ids: seen.append(int(position_ids.max())) or real_forward(x, position_ids),
    )
    layouts, _, _ = run_windows(model, 120, True)
    assert layouts == [4, 8] * 7 + [0] and max(seen) < 64


@pytest.mark.parametrize("mix", ["step-random", "instance-random"])
def test_training_takes_ratio_zero_by_the_authors_rule(mix, run_windows):
    """Over many inputs and random draws, each window's candidates are the reference's, given the ratios the earlier
    windows really took; ratio 0 is drawn, at most once per input, never in the window before the last."""
    length = 5 * WINDOW + 3  # six windows, the last one without beacons
    model = beacon_model(ratios=[0, 2, 4], ratio_mix=mix)
    zero_counts = []
    for seed in range(16):
        layouts, draws, memory = run_windows(model, length, True, seed)
        reference = authors_window_ratios((0, 2, 4), mix, WINDOW, length, True, lambda i, c, taken=layouts: taken[i])
        expected = [candidates for ratio, candidates in reference if ratio is not None]
        if mix == "instance-random":
            assert draws[0] == expected[0]  # later windows keep the first draw
        else:
            assert draws[:-1] == expected  # the last window draws too, then gets no beacons
        assert layouts == [0 if ratio is None else ratio for ratio, _ in reference]
        assert memory == 1 + sum(WINDOW if r == 0 else WINDOW // r for r in layouts[:-1]) - (layouts[0] == 0)
        zero_counts.append(layouts[:-1].count(0))
        assert layouts[-2] != 0 or mix == "instance-random"
    assert 0 < sum(zero_counts)
    assert max(zero_counts) == (1 if mix == "step-random" else 5)  # instance-random keeps a first-window 0


def test_any_rule_draws_ratio_zero_like_any_other_ratio(run_windows):
    model = beacon_model(ratios=[0, 2, 4], zero_ratio_rule="any")
    counts, candidates = [], set()
    for seed in range(12):
        layouts, draws, _ = run_windows(model, 5 * WINDOW + 3, True, seed)
        counts.append(layouts[:-1].count(0))
        candidates |= set(draws)
    assert candidates == {(0, 2, 4)} and max(counts) >= 2


def test_inference_ignores_the_training_rule_for_ratio_zero(run_windows):
    """At inference 0 stays a candidate of every window (the authors' filter is for training only)."""
    model = beacon_model(ratios=[0, 2], inference_ratios=[0, 2], inference_ratio_mix="sequence")
    layouts, _, memory = run_windows(model, 4 * WINDOW, False)
    assert layouts == [0, 2, 0, 2] and memory == WINDOW + WINDOW // 2 + WINDOW
