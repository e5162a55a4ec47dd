"""The launch kinds of ``longpeft train --launch`` (each an accelerate config file beside this module)."""

LAUNCHES = ("ddp", "fsdp2", "zero3", "ulysses")
DEEPSPEED_LAUNCHES = ("zero3", "ulysses")  # the launches that run DeepSpeed (ulysses.yaml is ZeRO-3 too)
SHARDED_LAUNCHES = ("fsdp2", *DEEPSPEED_LAUNCHES)  # the launches that shard weights, gradients and optimizer state
