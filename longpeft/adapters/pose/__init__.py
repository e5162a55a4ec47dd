"""PoSE (positional skip-wise training): position ids that make a short window look like a long one. It changes
only the position ids seen in training, through its collator (:mod:`.modeling`): no ``apply``/``remove``."""

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
    """PoSE in the registry: its collator, the longer samples a content skip draws from, the positions it spans."""

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
        """:class:`PoseCollator` of a resolved section (its every field) in the run's window."""
        from .modeling import PoseCollator

        return PoseCollator(
            **config.model_dump(), pad_token_id=context.pad_token_id, max_length=context.max_length, seed=context.seed
        )


METHOD = Pose()

__all__ = ["IGNORE_INDEX", "METHOD", "PoseConfig", *TORCH_NAMES]
