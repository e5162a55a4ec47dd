"""PoSE (positional skip-wise training): position ids that make a short window look like a long one.

The ``pose`` section of recipes and of ``longpeft.json`` is :class:`PoseConfig`. PoSE changes only
the position ids seen in training (through :class:`PoseCollator`, its method's ``collator``); the
trained model runs with plain positions, so the method has no ``apply``/``remove``.

A sample of ``L_c`` tokens (the training window) is split at random into ``N`` chunks (default 2).
Position ids are contiguous inside each chunk; chunk ``i`` is shifted by a skip ``u_i``, drawn
uniformly from ``{u_(i-1), ..., L_t - L_c}`` with ``u_0 = 0``, so skips never decrease, chunks never
overlap, and the largest position is at most ``L_t - 1``. Over many samples the relative distances
cover ``1 .. L_t - 1``. The authors' code also caps the first chunk at half the window; here the
cut is uniform over the window.

What the chunks contain (``content_skip``; the paper's Eq. 5 and Table 4, which finds the three within
0.08 perplexity of each other at 16K): chunk ``i`` holds ``x[v_i + st_i : v_i + st_i + l_i]`` of a
sample ``x`` of ``L_x`` tokens (``st_i``, ``l_i``: the chunk's start and length in the window).

- ``none`` (default): ``v_i = 0``, the sample's first ``L_c`` tokens, contiguous. The only choice for
  conversations, whose answers need their context.
- ``uniform``: ``v_i`` drawn uniformly from ``{v_(i-1), ..., L_x - L_c}`` (the paper's main setting and
  the authors' code): the window's chunks come from anywhere in a longer text.
- ``aligned``: ``v_i = u_i``: every token's position id is its real position in the text, so skips
  reach at most ``min(L_x, L_t) - L_c`` (texts of ``L_t`` tokens cover every distance).

With a content skip, samples up to ``L_t`` tokens reach the collator (plain text only), and the
first token after a skipped stretch is not scored: its predecessor in the window is not what
preceded it in the text.

Pitfalls this module handles (see DESIGN.md): transformers reads a jump in ``position_ids`` as the
start of a new packed sequence when no ``attention_mask`` is passed, which would cut attention
between chunks, so :class:`PoseCollator` always returns an explicit all-ones ``attention_mask``
(right padding: causal attention never lets real tokens see the padding); and TRL's collator drops
a ``position_ids`` column, so PoSE needs this collator of its own.
"""

from __future__ import annotations

from ..registry import CollatorContext, Method, MethodTraining
from .config import PoseConfig, describe, long_samples, resolve, training_span
from .modeling import IGNORE_INDEX, PoseCollator, pose_position_ids, pose_sample


def pose_collator(config: PoseConfig, context: CollatorContext) -> PoseCollator:
    """The method's ``collator``: :class:`PoseCollator` of a resolved section in the run's window."""
    return PoseCollator(target_length=config.target_length, pad_token_id=context.pad_token_id,
                        n_chunks=config.n_chunks, max_length=context.max_length, seed=context.seed,
                        content_skip=config.content_skip)


METHOD = Method(
    name="pose",
    config=PoseConfig,
    resolve=resolve,
    describe=describe,
    training=MethodTraining(collator=pose_collator, long_samples=long_samples, span=training_span),
    conflicts={
        "beacon": "Activation Beacon sets the positions itself (memory first, then the window), so PoSE's position "
                  "ids would be ignored",
        "split_sequences": "PoSE trains on sequences of the base's window, which need no sequence parallelism",
        "unsloth": "unsloth runs its own attention and RoPE kernels, which are not checked with PoSE's skip-wise "
                   "position ids",
    },
)

__all__ = ["IGNORE_INDEX", "METHOD", "PoseCollator", "PoseConfig", "pose_collator", "pose_position_ids", "pose_sample"]
