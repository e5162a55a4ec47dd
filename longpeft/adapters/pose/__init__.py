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

from ...family import IGNORE_INDEX
from ..registry import Method, MethodTraining, imported_on_call, torch_names
from .config import PoseConfig, describe, long_samples, resolve, training_span

__getattr__ = torch_names(
    __name__, dict.fromkeys(("PoseCollator", "pose_collator", "pose_position_ids", "pose_sample"), "modeling")
)

METHOD = Method(
    name="pose",
    config=PoseConfig,
    resolve=resolve,
    describe=describe,
    training=MethodTraining(
        collator=imported_on_call(f"{__name__}.modeling", "pose_collator"),
        long_samples=long_samples,
        span=training_span,
    ),
    conflicts={
        "beacon": "Activation Beacon sets the positions itself (memory first, then the window), so PoSE's position "
        "ids would be ignored",
        "split_sequences": "PoSE trains on sequences of the base's window, which need no sequence parallelism",
        "unsloth": "unsloth runs its own attention and RoPE kernels, which are not checked with PoSE's skip-wise "
        "position ids",
    },
)

__all__ = ["IGNORE_INDEX", "METHOD", "PoseCollator", "PoseConfig", "pose_collator", "pose_position_ids", "pose_sample"]
