"""Parallel windows and the kept start / end against an independent reference.

The reference recomputes a beacon forward in plain torch, one chunk of the input after another, as the authors'
loop cuts it (``modeling_beacon.py``: ``beacon_skip_first`` / ``beacon_skip_last``): the kept start alone with
a causal mask, then windows of ``WINDOW`` raw tokens from the token after it, each with its beacons, then from
``keep_end`` on chunks of ``WINDOW`` raw tokens that read the memory and stay in it raw. Slots, positions and masks
are written out per chunk from the rules (loops), memory keys rotated directly at their memory positions. It
knows no parallel windows: the model, with several windows per forward, must give its logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_beacon_reference import (  # tests/test_beacon_reference.py
    linear,
    perturb_beacon_weights,
    reference_layer,
    rms,
    rope,
)
from transformers.models.llama import modeling_llama

from longpeft.adapters.beacon import BeaconCache, BeaconConfig, apply_beacon, set_inference_settings
from longpeft.adapters.beacon.layout import window_span
from longpeft.errors import ConfigError
from longpeft.family import cache_keyword
from longpeft.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = 8
LAYOUTS = {  # attn, pos, ratio, sink
    "full-coverage/interleave": ("full-coverage", "interleave", 2, 1),
    "full-coverage/append": ("full-coverage", "append", 4, 0),
    "step-expansion/append": ("step-expansion", "append", 4, 1),
    "step-expansion/interleave": ("step-expansion", "interleave", 2, 0),
    "segmentation/append": ("segmentation", "append", 2, 3),
}


def chunks_of(length: int, ratio: int, keep_start: int, keep_end: int | None) -> list[tuple[int, int, int, int]]:
    """``(first raw token, raw tokens, ratio (0: raw chunk), capacity)`` of each chunk."""
    chunks, start = [], 0
    if keep_start:
        chunks.append((0, min(keep_start, length), 0, keep_start))
        start = keep_start
    while start < length:
        n = min(WINDOW, length - start)
        chunks.append((start, n, 0 if keep_end is not None and start >= keep_end else ratio, WINDOW))
        start += n
    return chunks


def chunk_rules(attn: str, pos: str, ratio: int, n_raw: int, memory: int):
    """Slots ``(kind, index)``, positions and the ``[slots, memory + slots]`` mask of a chunk of ``n_raw`` raw tokens
    (ratio 0: raw tokens only, plain causal)."""
    if ratio == 0:
        slots = [("raw", i) for i in range(n_raw)]
    elif pos == "interleave":
        slots = []
        for i in range(n_raw):
            slots.append(("raw", i))
            if (i + 1) % ratio == 0:
                slots.append(("beacon", (i + 1) // ratio - 1))
    else:  # appended beacons come with the window's last raw token
        slots = [("raw", i) for i in range(n_raw)] + [
            ("beacon", j) for j in range(WINDOW // ratio if n_raw == WINDOW else 0)
        ]
    attend_prev = not (attn == "step-expansion" and pos == "interleave")
    positions, mask = [], torch.zeros(len(slots), memory + len(slots), dtype=torch.bool)
    mask[:, :memory] = True
    for q, (q_kind, qi) in enumerate(slots):
        if attn == "full-coverage" or q_kind == "raw":
            positions.append(memory + (q if attn == "full-coverage" else qi))
        else:  # right after the last raw token it reads (and the earlier beacons it reads)
            positions.append(memory + (qi + 1) * ratio + (qi if attend_prev and pos == "append" else 0))
        for k, (k_kind, ki) in enumerate(slots):
            if attn == "full-coverage":
                allowed = k <= q
            elif q_kind == "raw":
                allowed = k_kind == "raw" and ki <= qi
            elif k_kind == "raw":
                allowed = (qi * ratio if attn == "segmentation" else 0) <= ki < (qi + 1) * ratio
            else:
                allowed = ki <= qi if attend_prev else ki == qi
            mask[q, memory + k] = allowed
    return slots, positions, mask


def reference_logits(
    model,
    ids: torch.Tensor,
    attn: str,
    pos: str,
    ratio: int,
    sink: int = 0,
    keep_start: int = 0,
    keep_end: int | None = None,
) -> torch.Tensor:
    """Logits of ``ids [n]`` chunk by chunk."""
    config, backbone = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d, theta = config.hidden_size // heads, config.rope_parameters["rope_theta"]
    memory_k = [torch.zeros(kv_heads, 0, d) for _ in backbone.layers]
    memory_v = [torch.zeros(kv_heads, 0, d) for _ in backbone.layers]
    logits, windows = [], 0
    for begin, n_raw, chunk_ratio, capacity in chunks_of(ids.numel(), ratio, keep_start, keep_end):
        m = memory_k[0].shape[1]
        slots, positions, mask = chunk_rules(attn, pos, chunk_ratio, n_raw, m)
        beacon_rows = [s for s, (kind, _) in enumerate(slots) if kind == "beacon"]
        raw_rows = [s for s, (kind, _) in enumerate(slots) if kind == "raw"]
        commits = n_raw == capacity and begin + n_raw < ids.numel()  # a full chunk, read by what follows
        if chunk_ratio == 0:
            kept = raw_rows
        else:
            kept = (raw_rows[:sink] if windows == 0 else []) + beacon_rows
            windows += 1
        x = torch.stack(
            [
                backbone.embed_tokens.weight[ids[begin + i]]
                if kind == "raw"
                else backbone.beacon_embed_tokens.weight[0]
                for kind, i in slots
            ]
        )
        for index, layer in enumerate(backbone.layers):
            x, k, v = reference_layer(
                layer, x, positions, mask, memory_k[index], memory_v[index], beacon_rows, theta, heads
            )
            if commits:  # memory entries, each key rotated directly at its memory position
                moved = rope(k[:, kept], list(range(m, m + len(kept))), theta)
                memory_k[index] = torch.cat([memory_k[index], moved], dim=1)
                memory_v[index] = torch.cat([memory_v[index], v[:, kept]], dim=1)
        logits.append(linear(rms(x[raw_rows], backbone.norm), model.lm_head))
    return torch.cat(logits)


def beacon_model(
    layout: str, attn_implementation: str = "eager", parallel_windows: int = 1, arch: str = "llama", **kept
):
    """A tiny Llama (or ``arch``) with beacons whose weights differ from the copies they start as."""
    attn, pos, ratio, sink = LAYOUTS[layout]
    bias = {"attention_bias": True} if arch == "llama" else {}  # Qwen2 has q/k/v biases of its own
    model = tiny_model(arch, attn_implementation=attn_implementation, **bias)
    sink = 0 if kept.get("keep_start") else sink
    config = BeaconConfig(
        window=WINDOW,
        ratios=[ratio],
        attn=attn,
        pos=pos,
        sink=sink,
        params=["q", "k", "v", "o"],
        parallel_windows=parallel_windows,
        **kept,
    )
    apply_beacon(model, config.settings())
    perturb_beacon_weights(model, torch.Generator().manual_seed(0))
    return model, config


@pytest.fixture
def forwards(monkeypatch):
    """Counts the runs of the stock decoder stack (one per window, or per group of windows)."""
    runs = []
    stock = modeling_llama.LlamaModel.forward
    monkeypatch.setattr(
        modeling_llama.LlamaModel, "forward", lambda self, *a, **k: runs.append(1) or stock(self, *a, **k)
    )
    return runs


def both_ways(
    model, ids: torch.Tensor, windows: int, forwards: list, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits with one window per forward and with ``windows``, and how many decoder-stack runs the second took."""
    set_inference_settings(model, parallel_windows=1)
    with torch.no_grad():
        one = model(ids, **kwargs).logits
    set_inference_settings(model, parallel_windows=windows)
    forwards.clear()
    with torch.no_grad():
        parallel = model(ids, **kwargs).logits
    return one, parallel, len(forwards)


# 40: five full windows (groups of 3 and 2, the last window stays open); 43: and a partial one; 17: a group of 2
@pytest.mark.parametrize("length,runs", [(40, 2), (43, 3), (17, 2)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_windows_equal_the_reference_and_one_window_at_a_time(layout, length, runs, forwards):
    model, config = beacon_model(layout)
    ids = torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(length))
    one, parallel, used = both_ways(model, ids[None], 3, forwards)
    with torch.no_grad():
        expected = reference_logits(model, ids, config.attn, config.pos, config.ratios[0], config.sink)
    assert used == runs  # the windows ran in groups
    torch.testing.assert_close(one[0], expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parallel[0], expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parallel, one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["full-coverage/interleave", "step-expansion/append"])
def test_parallel_windows_with_sdpa_equal_the_reference(layout, forwards):
    model, config = beacon_model(layout, "sdpa")
    ids = torch.randint(3, 512, (43,), generator=torch.Generator().manual_seed(3))
    one, parallel, used = both_ways(model, ids[None], 4, forwards)
    with torch.no_grad():
        expected = reference_logits(model, ids, config.attn, config.pos, config.ratios[0], config.sink)
    assert used == 3  # windows 0-3, window 4, the partial window
    torch.testing.assert_close(parallel[0], expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parallel, one, atol=1e-5, rtol=1e-5)


# 3: padding inside the partial last window; 9: and over the border before it (left padding is refused:
# tests/test_beacon.py)
@pytest.mark.parametrize("pad", [3, 9])
@pytest.mark.parametrize("layout", ["full-coverage/interleave", "step-expansion/append"])
def test_parallel_windows_of_a_right_padded_batch_equal_each_rows_reference(layout, pad, forwards):
    model, config = beacon_model(layout)
    ids = torch.randint(3, 512, (2, 43), generator=torch.Generator().manual_seed(pad))
    ids[0, -pad:] = 0
    attention_mask = torch.ones_like(ids)
    attention_mask[0, -pad:] = 0
    one, parallel, _ = both_ways(model, ids, 3, forwards, attention_mask=attention_mask)
    with torch.no_grad():
        short = reference_logits(model, ids[0, :-pad], config.attn, config.pos, config.ratios[0], config.sink)
        full = reference_logits(model, ids[1], config.attn, config.pos, config.ratios[0], config.sink)
    torch.testing.assert_close(parallel[0, :-pad], short, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parallel[1], full, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parallel[:, :-pad], one[:, :-pad], atol=1e-5, rtol=1e-5)


def test_a_random_inference_mix_groups_the_windows_of_one_ratio(forwards, monkeypatch):
    """step-random at inference: the windows draw their ratios in the same order as one window at a time would, and
    a window whose ratio differs from its group's starts the next group."""
    from longpeft.adapters.beacon import scheduler

    model, _ = beacon_model("full-coverage/interleave")
    set_inference_settings(model, inference_ratios=[2, 4], inference_ratio_mix="step-random")
    drawn, real_choose = [], scheduler.choose_ratio
    monkeypatch.setattr(scheduler, "choose_ratio", lambda *a, **k: drawn.append(real_choose(*a, **k)) or drawn[-1])
    ids = torch.randint(3, 512, (1, 8 * 9 + 3), generator=torch.Generator().manual_seed(5))
    logits, ratios, runs = {}, {}, {}
    for windows in (1, 3):
        set_inference_settings(model, parallel_windows=windows)
        torch.manual_seed(1)
        drawn.clear()
        forwards.clear()
        with torch.no_grad():
            logits[windows] = model(ids).logits
        ratios[windows], runs[windows] = list(drawn), len(forwards)
    assert ratios[3] == ratios[1] and len(set(ratios[1])) == 2  # the same draws, of both ratios
    changes = sum(a != b for a, b in zip(ratios[1][:9], ratios[1][1:9]))  # among the 9 full windows
    assert changes + 2 <= runs[3] < runs[1] == 10  # a group per run of one ratio, the tail; fewer runs than windows
    torch.testing.assert_close(logits[3], logits[1], atol=1e-5, rtol=1e-5)


def decode_after_prefill(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of ``ids [n]``: ``prompt`` tokens in one forward, then one token per forward on its cache."""
    name = cache_keyword()
    with torch.no_grad():
        out = model(ids[None, :prompt], **{name: BeaconCache()})
        logits, cache = [out.logits[0]], getattr(out, name)
        for i in range(prompt, ids.numel()):
            out = model(ids[None, i : i + 1], **{name: cache})
            logits.append(out.logits[0])
            cache = getattr(out, name)
    return torch.cat(logits)


@pytest.mark.parametrize("layout", ["full-coverage/interleave", "step-expansion/append"])
def test_decoding_after_a_parallel_prefill_equals_the_reference(layout):
    """The group leaves the cache as one window at a time would: its last window open, committed by the next
    token."""
    model, config = beacon_model(layout, parallel_windows=3)
    ids = torch.randint(3, 512, (45,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference_logits(model, ids, config.attn, config.pos, config.ratios[0], config.sink)
    torch.testing.assert_close(decode_after_prefill(model, ids, 40), expected, atol=2e-5, rtol=1e-5)


# (keep_start, keep_end): the start alone; the end from window 2 (with a sink); both; both, nothing condensed
KEPT = [(5, None), (0, 16), (5, 21), (3, 3)]


@pytest.mark.parametrize("keep_start,keep_end", KEPT)
@pytest.mark.parametrize("layout,arch", [("full-coverage/interleave", "qwen2"), ("step-expansion/append", "llama")])
def test_kept_start_and_end_equal_the_reference(layout, arch, keep_start, keep_end, forwards):
    model, config = beacon_model(layout, arch=arch, keep_start=keep_start, keep_end=keep_end)
    ids = torch.randint(3, 512, (43,), generator=torch.Generator().manual_seed(keep_start))
    one, parallel, _ = both_ways(model, ids[None], 3, forwards)
    with torch.no_grad():
        expected = reference_logits(
            model, ids, config.attn, config.pos, config.ratios[0], config.sink, keep_start, keep_end
        )
        unkept = reference_logits(model, ids, config.attn, config.pos, config.ratios[0], config.sink)
    torch.testing.assert_close(one[0], expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(parallel[0], expected, atol=2e-5, rtol=1e-5)
    assert (expected - unkept).abs().max() > 1e-2  # the kept spans change what the model computes


@pytest.mark.parametrize("keep_start,keep_end", [(5, 21), (0, 16)])
def test_decoding_into_the_kept_end_equals_the_reference(keep_start, keep_end):
    """Generated tokens past keep_end stay raw too (the prompt ends inside a condensed window)."""
    model, config = beacon_model(
        "full-coverage/interleave", parallel_windows=3, keep_start=keep_start, keep_end=keep_end
    )
    ids = torch.randint(3, 512, (36,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = reference_logits(
            model, ids, config.attn, config.pos, config.ratios[0], config.sink, keep_start, keep_end
        )
    torch.testing.assert_close(decode_after_prefill(model, ids, 14), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("keep_start,keep_end", KEPT)
def test_window_span_counts_the_kept_spans(keep_start, keep_end, monkeypatch):
    """The largest position the forward hands the rotary module is the span ``model_span`` reports."""
    model, _ = beacon_model(
        "full-coverage/interleave", "sdpa", parallel_windows=3, keep_start=keep_start, keep_end=keep_end
    )
    seen, rotary = [], model.model.rotary_emb
    real_forward = rotary.forward
    monkeypatch.setattr(
        rotary,
        "forward",
        lambda x, position_ids: seen.append(int(position_ids.max())) or real_forward(x, position_ids),
    )
    for length in (4, 20, 43):
        seen.clear()
        with torch.no_grad():
            model(torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(length)))
        assert max(seen) + 1 == window_span(model.model.beacon_settings, length, 256)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"keep_start": 4, "sink": 1}, "keep_start .4. keeps the first tokens in memory already; set sink: 0"),
        ({"keep_start": 4, "keep_end": 10}, r"whole number of windows of 8 tokens.*keep_end: 12"),
        ({"keep_end": 3}, r"keep_end: 0\)"),
        ({"parallel_windows": 0}, "parallel_windows"),
    ],
)
def test_bad_kept_spans_and_parallel_windows_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        BeaconConfig(window=8, ratios=[2], **settings)


def test_kept_spans_are_refused_in_training():
    model, _ = beacon_model("full-coverage/interleave", keep_start=4)
    model.train()
    with pytest.raises(ValueError, match="inference settings"):
        model(torch.randint(3, 512, (1, 20)))


def test_set_inference_settings_changes_only_inference_settings():
    model, _ = beacon_model("full-coverage/interleave")
    with pytest.raises(ConfigError, match=r"\['window'\] are not inference settings"):
        set_inference_settings(model, window=16)
    with pytest.raises(ConfigError, match="whole number of windows"):
        set_inference_settings(model, keep_end=5)
    settings = set_inference_settings(model, parallel_windows=2, keep_end=16)
    assert (settings.parallel_windows, settings.keep_end, settings.sink) == (2, 16, 1)
    assert model.config.beacon["parallel_windows"] == 2 and model.model.beacon_settings is settings


def test_set_inference_settings_reads_lora_values_under_full_projection():
    """A config.beacon may record LoRA values under ``projection: full`` (they do not apply there)."""
    model, _ = beacon_model("full-coverage/interleave")
    written = dataclasses.replace(model.model.beacon_settings, lora_rank=32, lora_alpha=32.0)
    assert written.projection == "full"
    model.model.beacon_settings = written
    settings = set_inference_settings(model, parallel_windows=2)
    assert (settings.parallel_windows, settings.lora_rank, settings.lora_alpha) == (2, None, None)


# the authors' sink layouts (layout_rule: authors): a sink longer than the ratio holds beacon slots; at ratio 0
# the sink is stored twice. Parallel groups must commit the same entries as one window at a time.
@pytest.mark.parametrize("ratio,sink", [(2, 3), (0, 2)])
def test_parallel_windows_follow_the_authors_sink_layout(ratio, sink, forwards):
    model = tiny_model("llama")
    config = BeaconConfig(window=WINDOW, ratios=[ratio], sink=sink, layout_rule="authors", params=["q", "k", "v"])
    apply_beacon(model, config.settings())
    generator = torch.Generator().manual_seed(1)
    perturb_beacon_weights(model, generator)
    ids = torch.randint(3, 512, (1, 43), generator=generator)
    one, parallel, used = both_ways(model, ids, 3, forwards)
    assert used == 3  # windows 0-2, windows 3-4, the partial window
    torch.testing.assert_close(parallel, one, atol=1e-5, rtol=1e-5)
