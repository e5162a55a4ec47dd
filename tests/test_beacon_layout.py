"""Golden masks and positions of one window (W = 4 raw tokens, ratio 2, so 2 beacons), every attention
scheme x position mode, written by hand from the paper and the research note's table A.2 (not
produced by the implementation): slot order, which slots each slot attends to, position offsets
(position minus the memory length M). Then one step's full mask with memory and padding."""

from __future__ import annotations

import pytest
import torch

from longpeft.adapters.beacon import BeaconConfig
from longpeft.adapters.beacon.layout import attention_mask_for, choose_ratio, key_keep, step_visibility, window_layout

T = torch.tensor
CAUSAL6 = T(
    [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]
)

# (attn, pos, attend_prev): (is_beacon per slot, offsets, visible[q, k])
GOLDEN = {
    # r0 r1 b0 r2 r3 b1: plain causal; every slot takes its own position
    ("full-coverage", "interleave", True): ([0, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5], CAUSAL6),
    # r0 r1 r2 r3 b0 b1: plain causal, beacons after the window
    ("full-coverage", "append", True): ([0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 4, 5], CAUSAL6),
    # b0 sees r0 r1 (one span), b1 sees r0..r3 (two spans) and b0; a beacon sits after the last
    # raw token it sees and after the earlier beacons it sees: b0 at pos(r1)+1, b1 at pos(r3)+2
    ("step-expansion", "append", True): (
        [0, 0, 0, 0, 1, 1],
        [0, 1, 2, 3, 2, 5],
        T(
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 0, 0, 1, 0],
                [1, 1, 1, 1, 1, 1],
            ]
        ),
    ),
    ("step-expansion", "append", False): (
        [0, 0, 0, 0, 1, 1],
        [0, 1, 2, 3, 2, 4],
        T(
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 0, 0, 1, 0],
                [1, 1, 1, 1, 0, 1],
            ]
        ),
    ),
    # r0 r1 b0 r2 r3 b1: raw tokens never see this window's beacons and keep consecutive positions;
    # a beacon takes the position of the next raw token
    ("step-expansion", "interleave", False): (
        [0, 0, 1, 0, 0, 1],
        [0, 1, 2, 2, 3, 4],
        T(
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 0, 1, 0, 0],
                [1, 1, 0, 1, 1, 0],
                [1, 1, 0, 1, 1, 1],
            ]
        ),
    ),
    # b0 sees r0 r1, b1 sees r2 r3 only
    ("segmentation", "append", True): (
        [0, 0, 0, 0, 1, 1],
        [0, 1, 2, 3, 2, 5],
        T(
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 0, 0, 1, 0],
                [0, 0, 1, 1, 1, 1],
            ]
        ),
    ),
    ("segmentation", "append", False): (
        [0, 0, 0, 0, 1, 1],
        [0, 1, 2, 3, 2, 4],
        T(
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 0, 0, 1, 0],
                [0, 0, 1, 1, 0, 1],
            ]
        ),
    ),
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_window_layout_matches_the_hand_written_table(key):
    is_beacon, offsets, visible = GOLDEN[key]
    layout = window_layout(4, 2, *key)
    assert layout.is_beacon.tolist() == [bool(b) for b in is_beacon]
    assert layout.offsets.tolist() == offsets
    assert torch.equal(layout.visible, visible.bool())


def test_ratio_zero_is_a_plain_causal_window_and_partial_windows_are_prefixes():
    layout = window_layout(4, 0, "step-expansion", "append", True)
    assert layout.is_beacon.tolist() == [False] * 4 and layout.offsets.tolist() == [0, 1, 2, 3]
    assert torch.equal(layout.visible, CAUSAL6[:4, :4].bool())
    interleave = window_layout(4, 2, "full-coverage", "interleave", True)
    append = window_layout(4, 2, "full-coverage", "append", True)
    # 3 raw tokens: r0 r1 b0 r2 interleaved; append inserts beacons only into a full window
    assert [interleave.slots_for(n) for n in range(5)] == [0, 1, 3, 4, 6]
    assert [append.slots_for(n) for n in range(5)] == [0, 1, 2, 3, 6]


def test_one_step_mask_with_memory_and_padding():
    layout = window_layout(4, 2, "full-coverage", "interleave", True)
    memory_keep = T([[1, 0]]).bool()  # M = 2, the second memory entry is padding
    window_keep = T([[0, 1, 1, 1, 1]]).bool()  # r0 is padding
    keys = key_keep(2, 5, memory_keep, window_keep)
    assert keys.long().tolist() == [[1, 0, 0, 1, 1, 1, 1]]
    # slots r2, r3 (3 and 4) fed after r0 r1 b0: columns m0 m1 | r0 r1 b0 r2 r3
    visible = step_visibility(layout, 2, 3, 5, keys)
    assert visible.shape == (1, 1, 2, 7)
    assert visible[0, 0].long().tolist() == [[1, 0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1]]
    # a padding query still sees itself (no empty row)
    first_keys = key_keep(2, 2, memory_keep, window_keep[:, :2])
    first = step_visibility(layout, 2, 0, 2, first_keys)
    assert first[0, 0].long().tolist() == [[1, 0, 1, 0], [1, 0, 0, 1]]
    assert step_visibility(layout, 2, 3, 5, None)[0, 0].long().tolist() == [
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]
    eager = attention_mask_for(first, first_keys, "eager", torch.float32, "cpu")
    assert eager[0, 0, 0].tolist() == [0.0, torch.finfo(torch.float32).min, 0.0, torch.finfo(torch.float32).min]
    assert attention_mask_for(first, first_keys, "sdpa", torch.float32, "cpu").dtype == torch.bool
    # flash-attn (full-coverage): no mask without padding, else the key mask (the padding query's own
    # column stays masked there)
    assert attention_mask_for(visible, None, "flash_attention_2", torch.float32, "cpu") is None
    assert attention_mask_for(visible, keys, "flash_attention_2", torch.float32, "cpu").tolist() == [
        [1, 0, 0, 1, 1, 1, 1]
    ]


@pytest.mark.parametrize("length,ratio", [(95, 2), (96, 4)])
def test_adapt_picks_the_smallest_ratio_whose_positions_fit(length, ratio, monkeypatch):
    """Reference: the positions the forward hands the rotary module. 64 positions, windows of 16, sink 1: at ratio 2,
    95 tokens use positions 0..62 (memory 1 + 5 x 8, then 15 raw tokens and 7 beacons); 96 would use 0..64, so adapt
    takes 4. The authors' reach, (64 - 16) x 2 + 16 = 112 tokens at ratio 2, leaves out the sink and the last
    window's beacons: it took ratio 2 at 96 to 112 tokens and went up to position 72."""
    from longpeft.adapters.beacon import BeaconCache, apply_beacon
    from longpeft.tiny import tiny_model

    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=64)
    apply_beacon(model, BeaconConfig(window=16, ratios=[2, 4], sink=1, inference_ratio_mix="adapt-0").settings())
    seen, cache = [], BeaconCache()
    rotary = model.model.rotary_emb
    real_forward = rotary.forward
    monkeypatch.setattr(
        rotary,
        "forward",
        lambda x, position_ids: seen.append(int(position_ids.max())) or real_forward(x, position_ids),
    )
    with torch.no_grad():
        model(torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
    assert cache.state.chosen_ratio == ratio and max(seen) < 64
    assert choose_ratio((2, 4), "adapt-0", 16, 64, length, None, sink=1) == ratio
    assert choose_ratio((2, 4), "adapt-1", 16, 64, 95, None, sink=1) == 4  # adapt-N counts N tokens still to come
    assert choose_ratio((8, 2, 4), "adapt-0", 16, 64, 96, None, sink=1) == 4
    assert choose_ratio((2, 4), "adapt-0", 16, 64, 10**6, None, sink=1) == 4  # nothing fits: the largest


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"attn": "segmentation", "pos": "interleave"}, "segmentation with pos: interleave"),
        ({"window": 100, "ratios": [3]}, "ratio 3 must be 0 or divide window 100"),
        ({"attn": "step-expansion", "pos": "interleave", "attend_prev": True}, "attend_prev: true is not possible"),
        ({"attend_prev": False}, "impossible with attn: full-coverage"),
        ({"sink": 1024}, "sink"),
        ({"params": ["q", "q"]}, "at most once"),
        ({"lora_rank": 8}, "settings of projection: lora"),
        ({"ratio_mix": "round-robin"}, "step-random, instance-random, sequence or adapt-N"),
        ({"inference_ratios": [5]}, "inference_ratios: ratio 5"),
        ({"layout_rule": "authors", "attn": "step-expansion"}, "hides window slots 0 and 1 instead of the beacons"),
        ({"layout_rule": "authors", "attn": "segmentation", "pos": "append"}, "the authors' code fails there"),
        ({"layout_rule": "paper"}, "layout_rule"),
    ],
)
def test_bad_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        BeaconConfig(**settings)


def test_resolved_settings_write_out_what_is_implied():
    resolved = BeaconConfig(attn="step-expansion", pos="interleave", projection="lora").resolved()
    assert resolved.attend_prev is False and resolved.inference_ratios == [2, 4, 8]
    assert (resolved.lora_rank, resolved.lora_alpha) == (32, 32.0)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize(
    "attn,pos", [("full-coverage", "interleave"), ("full-coverage", "append"), ("step-expansion", "interleave")]
)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("length,positions", [(37, 256), (38, 256), (64, 256), (120, 64)])
def test_window_span_is_the_largest_position_the_forward_uses(attn, pos, training, length, positions, monkeypatch):
    """Reference: the positions the beacon forward really hands the rotary module, with every random ratio
    draw forced to the first ratio it may draw (the smallest that fits, the worst case of step-random) in
    training, adapt-N at inference. 37 tokens: the fourth (full) window reaches further than the short last
    one; 38 tokens: with interleaved beacons the short last one (6 raw tokens, 3 beacons) reaches further, with
    appended ones it has no beacon yet; 120 tokens on 64 positions: ratio 2 does not fit, 4 is the worst draw.
    Stepwise expansion with interleaved beacons: a beacon takes the position of the raw token after it."""
    from longpeft.adapters.beacon import apply_beacon
    from longpeft.adapters.beacon.layout import window_span
    from longpeft.tiny import tiny_model

    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=positions)
    settings = BeaconConfig(
        window=8,
        ratios=[2, 4, 8],
        inference_ratios=[2, 4, 8],
        inference_ratio_mix="adapt-4",
        sink=1,
        attn=attn,
        pos=pos,
    ).settings()
    apply_beacon(model, settings)
    ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(1))
    seen = []
    rotary = model.model.rotary_emb
    real_forward = rotary.forward
    monkeypatch.setattr(
        rotary,
        "forward",
        lambda x, position_ids: seen.append(int(position_ids.max())) or real_forward(x, position_ids),
    )
    # draw ratios[0]
    monkeypatch.setattr(torch, "randint", lambda high, size, **kw: torch.zeros(size, dtype=torch.long))
    model.train(training)
    with torch.no_grad():
        model(ids)
    assert max(seen) + 1 == window_span(settings, length, positions, training=training) <= positions


def test_training_draws_only_ratios_that_keep_the_input_inside_the_positions():
    """16K tokens on 4K positions: ratios 2 and 4 would overflow, so training draws 8 (inference adapts to 8 too);
    only a recipe whose largest ratio overflows spans more than the positions."""
    from longpeft.adapters.beacon.layout import choose_ratio, fitting_ratios, span_at, window_span

    settings = BeaconConfig(window=1024, ratios=[2, 4, 8]).settings()
    assert span_at(1024, 0, 2, 16384, training=True) == 14 * 512 + 1024 + 512 > 4096  # the 15th window
    assert span_at(1024, 0, 4, 16384, training=True) == 14 * 256 + 1024 + 256 > 4096
    assert fitting_ratios((2, 4, 8), 1024, 0, 4096, 16384, training=True) == (8,)
    assert fitting_ratios((2, 4, 8), 1024, 0, 4096, 4096, training=True) == (2, 4, 8)
    assert {choose_ratio((2, 4, 8), "step-random", 1024, 4096, 16384, None, training=True) for _ in range(20)} == {8}
    assert window_span(settings, 16384, 4096, training=True) == span_at(1024, 0, 8, 16384, True) <= 4096
    assert window_span(settings, 16384, 4096) <= 4096
    only_two = BeaconConfig(window=1024, ratios=[2, 4]).settings()
    assert window_span(only_two, 16384, 4096, training=True) == span_at(1024, 0, 4, 16384, True) > 4096


@pytest.mark.parametrize("mix", ["step-random", "instance-random"])
def test_random_ratio_draws_in_training_never_pass_the_positions(mix, monkeypatch):
    """The positions the beacon forward hands the rotary module over many random draws, at a length where the
    smallest ratio would overflow (120 tokens, windows of 8, 64 positions: ratio 2 reaches position 64)."""
    from longpeft.adapters.beacon import apply_beacon, scheduler
    from longpeft.tiny import tiny_model

    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=64)
    apply_beacon(model, BeaconConfig(window=8, ratios=[2, 4, 8], ratio_mix=mix, sink=1).settings())
    ids = torch.randint(3, 512, (1, 120), generator=torch.Generator().manual_seed(0))
    seen, drawn = [], []
    rotary = model.model.rotary_emb
    real_forward, real_choose = rotary.forward, scheduler.choose_ratio
    monkeypatch.setattr(
        rotary,
        "forward",
        lambda x, position_ids: seen.append(int(position_ids.max())) or real_forward(x, position_ids),
    )
    monkeypatch.setattr(scheduler, "choose_ratio", lambda *a, **k: drawn.append(real_choose(*a, **k)) or drawn[-1])
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(8):
            model(ids)
    assert set(drawn) == {4, 8} and max(seen) < 64


def authors_admit(ratio: int, window: int, positions: int, length: int) -> bool:
    """Whether the authors' adapt-N admits ``length`` tokens at ``ratio``, written from their rule and walked token by
    token: each token of the first window takes a position, each later one ``1 / ratio`` of a position (its window is
    condensed, as every window but the last is, and the last counts as raw) ; ratio 0: a position per token. Counted
    in ``1 / ratio`` units so that the walk stays in integers."""
    if not ratio:
        return length <= positions
    used = 0
    for token in range(length):
        used += ratio if token < window else 1
    return used <= positions * ratio


def authors_choice(ratios: tuple[int, ...], window: int, positions: int, length: int) -> int:
    """The smallest ratio the authors' rule admits ``length`` tokens at (the largest when none does)."""
    admitted = [ratio for ratio in sorted(ratios) if authors_admit(ratio, window, positions, length)]
    return admitted[0] if admitted else max(ratios)


@pytest.mark.parametrize(
    "window,positions,mix", [(8, 256, "adapt-16"), (16, 48, "adapt-0"), (1024, 8192, "adapt-1024")]
)
@pytest.mark.parametrize("ratios", [(2, 4, 8), (8, 2, 4), (0, 2, 4)])
def test_the_authors_adapt_rule_equals_a_token_by_token_count(window, positions, mix, ratios):
    """One length each side of every boundary of the reference (and a few between): ``layout_rule: authors`` picks
    the ratio the authors' count admits, longpeft's own rule a larger one just below each boundary."""
    n = int(mix.split("-")[1])
    lengths = {window // 2, window + 1, 3 * positions}
    for ratio in ratios:
        reach = (positions - window) * ratio + window if ratio else positions
        lengths |= {reach - n, reach - n + 1}
    for length in sorted(x for x in lengths if x > 0):
        expected = authors_choice(ratios, window, positions, length + n)
        assert choose_ratio(ratios, mix, window, positions, length, None, sink=1, rule="authors") == expected, length
        assert choose_ratio(ratios, mix, window, positions, length, None, sink=1) >= expected


def test_the_authors_rule_picks_a_smaller_ratio_just_below_each_boundary_on_llama3_8b():
    """Llama-3-8B, window 1024, sink 1, adapt-1024, ratios 2/4/8: the two rules part on 13,312-14,336 and
    27,648-28,672 prompt tokens."""
    picks = {
        length: (
            choose_ratio((2, 4, 8), "adapt-1024", 1024, 8192, length, None, sink=1, rule="authors"),
            choose_ratio((2, 4, 8), "adapt-1024", 1024, 8192, length, None, sink=1),
        )
        for length in (13311, 13312, 14336, 14337, 27647, 27648, 28672, 28673)
    }
    assert picks == {
        13311: (2, 2),
        13312: (2, 4),
        14336: (2, 4),
        14337: (4, 4),
        27647: (4, 4),
        27648: (4, 8),
        28672: (4, 8),
        28673: (8, 8),
    }
    assert all(authors_choice((2, 4, 8), 1024, 8192, length + 1024) == ours for length, (ours, _) in picks.items())


def test_the_runtime_settings_are_the_config_fields_and_a_partial_config_beacon_is_refused():
    """Each setting is declared once, in BeaconConfig; the modeling code's BeaconSettings holds the same fields, and
    a ``config.beacon`` lacking one is refused by name instead of taking a default from elsewhere."""
    import dataclasses

    from longpeft.adapters.beacon import BeaconSettings

    assert [f.name for f in dataclasses.fields(BeaconSettings)] == list(BeaconConfig.model_fields)
    written = BeaconConfig(window=8, ratios=[2]).settings().as_dict()
    assert BeaconSettings.from_dict(written).as_dict() == written
    del written["sink"]
    with pytest.raises(ValueError, match=r"lacks \['sink'\]"):
        BeaconSettings.from_dict(written)


def test_apply_beacon_takes_some_settings_with_the_configs_defaults_and_names_a_bad_one():
    """``apply_beacon`` on a dict: every setting as ``config.beacon`` holds them, or some of them with BeaconConfig's
    defaults for the rest; an unknown key or a refused value is one ConfigError naming it."""
    from longpeft.adapters.beacon import apply_beacon
    from longpeft.adapters.beacon.patch import backbone_of
    from longpeft.errors import ConfigError
    from longpeft.tiny import tiny_model

    model = tiny_model("llama", seed=0, vocab_size=64)
    apply_beacon(model, {"window": 8, "ratios": [2]})
    assert backbone_of(model).beacon_settings == BeaconConfig(window=8, ratios=[2]).settings()
    full = BeaconConfig(window=8, ratios=[4], projection="full").settings()
    apply_beacon(model, full.as_dict())
    assert backbone_of(model).beacon_settings == full
    with pytest.raises(ConfigError, match="ratio: Extra inputs"):
        apply_beacon(model, {"window": 8, "ratio": [2]})
    with pytest.raises(ConfigError, match="window"):
        apply_beacon(model, {"window": -1, "ratios": [2]})
