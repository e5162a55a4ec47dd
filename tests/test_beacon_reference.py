"""An independent dense reference: two- and three-window compressed forwards recomputed in plain torch
(explicit per-window masks built by loops from the rules, explicit RoPE rotations at explicit
positions, memory keys (sink and beacons) rotated directly at their memory positions) equal the implementation."""

from __future__ import annotations

import math

import pytest
import torch

from longpeft.adapters.beacon import BeaconCache, BeaconConfig, apply_beacon
from longpeft.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW, SINK = 8, 1


def rope(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """Rotate ``x [heads, n, d]``: pair (j, j + d/2) turns by position * theta^(-2j/d)."""
    d = x.shape[-1]
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def linear(x, layer):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def reference_layer(
    layer,
    x: torch.Tensor,
    positions: list[int],
    mask: torch.Tensor,
    memory_k: torch.Tensor,
    memory_v: torch.Tensor,
    beacon_rows: list[int],
    theta: float,
    heads: int,
):
    """One decoder layer over a chunk's slots ``x [slots, hidden]`` (the beacon projections at ``beacon_rows``), each
    query reading the memory ``memory_k / memory_v [kv_heads, m, d]`` (keys already rotated) and the chunk's slots
    as ``mask [slots, m + slots]`` allows. Returns the layer's output and the slots' keys before rotation and values,
    ``[kv_heads, slots, d]``, which the caller keeps as memory."""
    attention, d = layer.self_attn, memory_k.shape[-1]
    kv_heads = memory_k.shape[0]

    def project(name, inputs):
        out = linear(inputs, getattr(attention, f"{name}_proj"))
        for row in beacon_rows:
            out[row] = linear(inputs[row], getattr(attention, f"beacon_{name}_proj"))
        return out

    h = rms(x, layer.input_layernorm)
    q = project("q", h).view(-1, heads, d).transpose(0, 1)
    k = project("k", h).view(-1, kv_heads, d).transpose(0, 1)
    v = project("v", h).view(-1, kv_heads, d).transpose(0, 1)
    keys = torch.cat([memory_k, rope(k, positions, theta)], dim=1).repeat_interleave(heads // kv_heads, dim=0)
    values = torch.cat([memory_v, v], dim=1).repeat_interleave(heads // kv_heads, dim=0)
    scores = (rope(q, positions, theta) @ keys.transpose(1, 2)) / math.sqrt(d)
    out = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values).transpose(0, 1).reshape(len(x), -1)
    x = x + project("o", out)
    h = rms(x, layer.post_attention_layernorm)
    mlp = layer.mlp
    x = x + linear(torch.nn.functional.silu(linear(h, mlp.gate_proj)) * linear(h, mlp.up_proj), mlp.down_proj)
    return x, k, v


def perturb_beacon_weights(model, generator: torch.Generator) -> None:
    """Move every beacon weight away from the projection it starts as a copy of (else beacons change nothing)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".beacon_" in name:
                parameter.add_(torch.randn_like(parameter, generator=generator) * 0.05)


def window_rules(attn: str, pos: str, ratio: int, n_raw: int, memory: int):
    """Slots (kind, index), positions and the [slots, memory + slots] mask of a window, from the rules."""
    beacons = n_raw // ratio if ratio and (pos == "interleave" or n_raw == WINDOW) else 0
    if pos == "interleave":
        slots = []
        for i in range(n_raw):
            slots.append(("raw", i))
            if ratio and (i + 1) % ratio == 0:
                slots.append(("beacon", (i + 1) // ratio - 1))
    else:
        slots = [("raw", i) for i in range(n_raw)] + [("beacon", j) for j in range(beacons)]
    positions = []
    for s, (kind, i) in enumerate(slots):
        if attn == "full-coverage":
            positions.append(memory + s)
        elif kind == "raw":
            positions.append(memory + i)
        else:  # step-expansion, append, attend_prev: after its last raw token and the earlier beacons
            positions.append(memory + (i + 1) * ratio + i)
    mask = torch.zeros(len(slots), memory + len(slots), dtype=torch.bool)
    mask[:, :memory] = True
    for q, (q_kind, qi) in enumerate(slots):
        for k, (k_kind, ki) in enumerate(slots):
            if attn == "full-coverage":
                allowed = k <= q
            elif q_kind == "raw":
                allowed = k_kind == "raw" and ki <= qi
            else:
                allowed = ki < (qi + 1) * ratio if k_kind == "raw" else ki <= qi
            mask[q, memory + k] = allowed
    return slots, positions, mask


def reference_logits(
    model, ids: torch.Tensor, attn: str, pos: str, ratio: int, sink: int = SINK, rule: str = "longpeft"
) -> torch.Tensor:
    """Logits of the raw tokens of ``ids [n]`` with beacons, recomputed window by window. Ratio 0 keeps every raw
    token of a full window in memory. The sink, first in memory: ``rule`` longpeft, the first ``sink`` raw tokens
    (none besides the raw window at ratio 0); authors, the first ``sink`` slots of the first window whatever they
    hold, then its beacons (at ratio 0, all its slots again)."""
    config, backbone = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d, theta = config.head_dim, config.rope_parameters["rope_theta"]
    memory_k = [torch.zeros(kv_heads, 0, d) for _ in backbone.layers]
    memory_v = [torch.zeros(kv_heads, 0, d) for _ in backbone.layers]
    logits = []
    for w, begin in enumerate(range(0, ids.numel(), WINDOW)):
        chunk = ids[begin : begin + WINDOW]
        m = memory_k[0].shape[1]
        slots, positions, mask = window_rules(attn, pos, ratio, chunk.numel(), m)
        beacon_rows = [s for s, (kind, _) in enumerate(slots) if kind == "beacon"]
        x = torch.stack(
            [
                backbone.embed_tokens.weight[chunk[i]] if kind == "raw" else backbone.beacon_embed_tokens.weight[0]
                for kind, i in slots
            ]
        )
        for layer_index, layer in enumerate(backbone.layers):
            x, k, v = reference_layer(
                layer, x, positions, mask, memory_k[layer_index], memory_v[layer_index], beacon_rows, theta, heads
            )
            # memory after a full window: sink raw tokens (window 0), then the beacons, each key rotated
            # directly at its memory position
            if chunk.numel() == WINDOW and begin + WINDOW < ids.numel():
                raw_rows = [s for s, (kind, _) in enumerate(slots) if kind == "raw"]
                window_kept = beacon_rows if ratio else raw_rows
                if rule == "authors":
                    kept = (list(range(sink)) if w == 0 else []) + window_kept
                else:
                    kept = (raw_rows[:sink] if w == 0 and ratio else []) + window_kept
                kept_keys = rope(k[:, kept], list(range(m, m + len(kept))), theta)
                memory_k[layer_index] = torch.cat([memory_k[layer_index], kept_keys], dim=1)
                memory_v[layer_index] = torch.cat([memory_v[layer_index], v[:, kept]], dim=1)
        raw = [s for s, (kind, _) in enumerate(slots) if kind == "raw"]
        logits.append(linear(rms(x[raw], backbone.norm), model.lm_head))
    return torch.cat(logits)


def beacon_model(attn: str, pos: str, ratio: int, sink: int = SINK, rule: str = "longpeft"):
    """A tiny Llama with beacons whose weights differ from the copies they start as."""
    model = tiny_model("llama", attn_implementation="eager", attention_bias=True)
    settings = BeaconConfig(
        window=WINDOW, ratios=[ratio], attn=attn, pos=pos, sink=sink, params=["q", "k", "v", "o"], layout_rule=rule
    )
    apply_beacon(model, settings.settings())
    perturb_beacon_weights(model, torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("length", [16 + 5, 8 + 8])  # three windows (last partial), two full windows
@pytest.mark.parametrize("attn,pos,ratio", [("full-coverage", "interleave", 2), ("step-expansion", "append", 4)])
def test_compressed_forward_equals_the_dense_reference(length, attn, pos, ratio):
    model = beacon_model(attn, pos, ratio)
    ids = torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = reference_logits(model, ids, attn, pos, ratio)
        actual = model(ids[None]).logits[0]
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


def test_a_sink_longer_than_the_ratio_sits_at_memory_positions_0_to_sink():
    """Sink 4 at ratio 2, interleaved: window 0's beacons sit between the sink tokens, which the memory then
    holds at positions 0..3 (a sink token's key moves from its slot to its memory position, as a beacon's does)."""
    model = beacon_model("full-coverage", "interleave", 2, sink=4)
    ids = torch.randint(3, 512, (16 + 5,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference_logits(model, ids, "full-coverage", "interleave", 2, sink=4)
        actual = model(ids[None]).logits[0]
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "attn,pos,ratio,sink",
    [
        (
            "full-coverage",
            "interleave",
            2,
            4,
        ),  # the sink holds raw 0, 1, beacon 0, raw 2 (beacon 0 is in memory twice)
        ("full-coverage", "interleave", 0, 2),  # ratio 0: the sink, then the whole first window again
        ("full-coverage", "append", 4, 2),  # the first slots are raw tokens: both rules agree
    ],
)
def test_the_authors_sink_layout_equals_the_dense_reference(attn, pos, ratio, sink):
    """``layout_rule: authors`` keeps the first ``sink`` slots of the first window (beacons included) and, at ratio
    0, stores them again before the window's raw tokens, as the authors' code does; longpeft's rule differs exactly
    where the authors' sink holds a beacon or is stored twice."""
    ids = torch.randint(3, 512, (16 + 5,), generator=torch.Generator().manual_seed(sink))
    model = beacon_model(attn, pos, ratio, sink=sink, rule="authors")
    with torch.no_grad():
        expected = reference_logits(model, ids, attn, pos, ratio, sink=sink, rule="authors")
        ours = reference_logits(model, ids, attn, pos, ratio, sink=sink)
        actual = model(ids[None]).logits[0]
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    differs = float((ours - expected).abs().max()) > 1e-3
    assert differs == (pos == "interleave")


@pytest.mark.parametrize("pad", [3, 5, 9])  # inside the last window; 9: past a window border
@pytest.mark.parametrize("attn,pos,ratio", [("full-coverage", "interleave", 2), ("step-expansion", "append", 4)])
def test_a_right_padded_batch_gives_each_row_the_reference_of_its_tokens_alone(pad, attn, pos, ratio):
    """Rows share one window layout from index 0, so a row padded after its tokens (TRL's training batches) reads
    what its tokens read alone (left padding is refused: tests/test_beacon.py)."""
    model = beacon_model(attn, pos, ratio)
    ids = torch.randint(3, 512, (2, 16 + 5), generator=torch.Generator().manual_seed(pad))
    ids[0, -pad:] = 0
    attention_mask = torch.ones_like(ids)
    attention_mask[0, -pad:] = 0
    with torch.no_grad():
        actual = model(ids, attention_mask=attention_mask).logits
        short = reference_logits(model, ids[0, :-pad], attn, pos, ratio)
        full = reference_logits(model, ids[1], attn, pos, ratio)
    torch.testing.assert_close(actual[0, :-pad], short, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(actual[1], full, atol=2e-5, rtol=1e-5)


ADAPT = 498  # the tiny base's 256 positions, window 8: the authors' ratio 2 reaches (256 - 8) x 2 + 8 = 504 tokens


def authors_tokens_known_at_choice(pos: str, chunks: tuple[int, ...]) -> int:
    """Tokens the authors' code has seen when it chooses the first window's ratio, for an input fed to it in forwards
    of ``chunks`` tokens: interleaved beacons, in the first forward (their window loop sets the ratio as a window
    starts); appended ones, in the forward whose tokens fill the first window (they set it only for a full window),
    or never when none does."""
    seen = 0
    for chunk in chunks:
        seen += chunk
        if pos == "interleave" or seen >= WINDOW:
            return seen
    return seen


@pytest.mark.parametrize("chunks", [(5,) + (1,) * 8, (5, 6, 1, 1), (8,) + (1,) * 5, (13,)])
@pytest.mark.parametrize(
    "attn,pos", [("full-coverage", "append"), ("step-expansion", "append"), ("full-coverage", "interleave")]
)
def test_the_authors_rule_chooses_the_adaptive_ratio_when_their_code_does(chunks, attn, pos):
    """adapt-498 on 256 positions picks 2 for up to 6 tokens and 4 from 7 tokens on (the authors' count: the
    reference ``test_beacon_layout.authors_choice``). With appended beacons and a prompt shorter than the window (5
    tokens, then decoding), their code chooses when the window fills, at 8 tokens, so 4; with interleaved ones, at
    the prompt, so 2. Every token's logits, fed in ``chunks``, equal the dense reference at that ratio, which the
    other ratio would move."""
    from test_beacon_layout import authors_choice

    model = tiny_model("llama", attn_implementation="eager", attention_bias=True)
    settings = BeaconConfig(
        window=WINDOW,
        ratios=[2, 4],
        inference_ratio_mix=f"adapt-{ADAPT}",
        attn=attn,
        pos=pos,
        sink=SINK,
        params=["q", "k", "v", "o"],
        layout_rule="authors",
    )
    apply_beacon(model, settings.settings())
    perturb_beacon_weights(model, torch.Generator().manual_seed(1))
    ids = torch.randint(3, 512, (sum(chunks),), generator=torch.Generator().manual_seed(len(chunks)))
    expected = authors_choice((2, 4), WINDOW, 256, authors_tokens_known_at_choice(pos, chunks) + ADAPT)
    cache, logits, done = BeaconCache(), [], 0
    with torch.no_grad():
        for chunk in chunks:
            logits.append(model(ids[None, done : done + chunk], past_key_values=cache).logits[0])
            done += chunk
        reference = {ratio: reference_logits(model, ids, attn, pos, ratio, rule="authors") for ratio in (2, 4)}
    assert cache.state.chosen_ratio == expected
    torch.testing.assert_close(torch.cat(logits), reference[expected], atol=2e-5, rtol=1e-5)
    assert float((reference[2] - reference[4]).abs().max()) > 1e-3
