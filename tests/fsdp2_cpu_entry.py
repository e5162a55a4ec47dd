"""Test-only entry point: ``accelerate launch --config_file longpeft/launch/fsdp2.yaml tests/fsdp2_cpu_entry.py
train RECIPE ...`` runs ``longpeft`` with accelerate's FSDP2 path on CPU processes (gloo).

accelerate 1.15 turns FSDP on only for GPU-like process groups and makes every multi-process CPU run plain DDP
(``MULTI_CPU``), although torch's FSDP2 (``fully_shard``) runs on CPU over gloo. Here, and only here, the
``AcceleratorState`` that accelerate built is switched to FSDP with the plugin it was given, and the type written
back to ``PartialState``, as accelerate does on GPUs; everything after that (sharding, the Trainer, longpeft's
saving and resuming) is the real code.
"""

from __future__ import annotations

import os
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_original_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if (
        self.distributed_type == DistributedType.MULTI_CPU
        and fsdp_plugin is not None
        and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    ):
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate does at the end


AcceleratorState.__init__ = _init_with_fsdp_on_cpu

if __name__ == "__main__":
    from longpeft.cli import main

    sys.exit(main(sys.argv[1:]))
