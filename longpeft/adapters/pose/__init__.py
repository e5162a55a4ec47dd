"""PoSE (positional skip-wise training): position ids that make a short window look like a long one.

The ``pose`` section of recipes and of ``longpeft.json`` is :class:`PoseConfig`. PoSE changes only the position
ids seen in training, through its method's ``collator`` (:class:`PoseCollator`); the trained model runs with plain
positions, so the method has no ``apply``/``remove``.

- :mod:`.config`: :class:`PoseConfig`, and what it implies for a run (the simulated length, the longer samples a
  content skip draws from);
- :mod:`.modeling`: the skip-wise position ids, the window each sample trains with (``content_skip``), and the
  collator, with the pitfalls it handles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...family import IGNORE_INDEX
from ..registry import CollatorContext, Method, torch_names
from .config import PoseConfig, describe, long_samples, resolve, training_span

if TYPE_CHECKING:
    from .modeling import PoseCollator

TORCH_NAMES = dict.fromkeys(("PoseCollator", "pose_position_ids", "pose_sample"), "modeling")
__getattr__ = torch_names(__name__, TORCH_NAMES)


class Pose(Method):
    """PoSE in the registry: its collator (skip-wise position ids), the longer samples a content skip draws from, and
    the positions its inputs span; no change to a built model."""

    name = "pose"
    config = PoseConfig
    conflicts = {
        "beacon": "Activation Beacon sets the positions itself (memory first, then the window), so PoSE's position "
        "ids would be ignored",
        "split_sequences": "PoSE trains on sequences of the base's window, which need no sequence parallelism",
        "unsloth": "unsloth runs its own attention and RoPE kernels, which are not checked with PoSE's skip-wise "
        "position ids",
    }

    resolve = staticmethod(resolve)
    describe = staticmethod(describe)
    long_samples = staticmethod(long_samples)
    training_span = staticmethod(training_span)

    def collator(self, config: PoseConfig, context: CollatorContext) -> PoseCollator:
        """:class:`PoseCollator` of a resolved section in the run's window."""
        from .modeling import PoseCollator

        return PoseCollator(
            target_length=config.target_length,
            pad_token_id=context.pad_token_id,
            n_chunks=config.n_chunks,
            max_length=context.max_length,
            seed=context.seed,
            content_skip=config.content_skip,
        )


METHOD = Pose()

__all__ = ["IGNORE_INDEX", "METHOD", "PoseConfig", *TORCH_NAMES]
