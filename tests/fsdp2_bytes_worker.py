"""Run under ``torchrun --nproc_per_node N`` (gloo, CPU): shard a tiny model with torch's FSDP2 (``fully_shard``
on every decoder layer, then the root, as accelerate does), take one AdamW step, and print, from every rank, one
JSON line of the bytes that rank holds: frozen and trained weights, gradients and optimizer moments.

Argument: ``full`` (every weight trains), ``lora`` (LoRA r=4 on q, k, v, o and a trained copy of the input
embedding, as the planner's tiny-cpu recipe) or ``qlora`` (the same over the tiny model quantized to NF4 with double
quantization, storage in bf16, as the runner loads a 4-bit base; its quantization constants are reported apart;
second argument: the saved tiny model's folder).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's shard of ``tensor`` (the whole tensor when it is not sharded)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def quant_tensors(state) -> list[torch.Tensor]:
    """A bitsandbytes 4-bit quant state's tensors: absmax, and with double quantization its own absmax and offset."""
    return [state.absmax] + ([state.state2.absmax, state.offset] if state.nested else [])


def main(mode: str, base: str | None = None) -> None:
    from peft import LoraConfig, get_peft_model

    from longpeft.tiny import tiny_model

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model("llama")
    if mode == "qlora":  # the saved tiny model loaded through bitsandbytes, as the runner loads a 4-bit base
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        model = AutoModelForCausalLM.from_pretrained(
            base,
            dtype=torch.bfloat16,
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
                bnb_4bit_quant_storage=torch.bfloat16,
            ),
        )
    if mode in ("lora", "qlora"):
        model = get_peft_model(
            model,
            LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["embed_tokens"]),
        )
    if mode == "qlora":  # trained weights in float32, as the runner keeps them (peft copied the embedding in bf16)
        from longpeft.recipes.peft_setup import keep_trained_weights_in

        keep_trained_weights_in(model, torch.float32, torch.bfloat16)
    layers = model.model.layers if mode == "full" else model.get_base_model().model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 512, (1, 16), generator=generator)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    line = json.dumps(
        {
            "rank": dist.get_rank(),
            "frozen_weights": sum(local_bytes(p) for p in model.parameters() if not p.requires_grad),
            "trained_weights": sum(local_bytes(p) for p in trained),
            "gradients": sum(local_bytes(p.grad) for p in trained),
            "moments": sum(local_bytes(t) for state in optimizer.state.values() for t in state.values() if t.dim()),
            # bitsandbytes keeps a 4-bit layer's quant state on the module (FSDP2 replaced its weight parameter)
            "quant_constants": sum(
                local_bytes(t)
                for module in model.modules()
                if getattr(module, "quant_state", None)
                for t in quant_tensors(module.quant_state)
            ),
        }
    )
    # one write call with its newline: both ranks share the stdout pipe, and print's two writes interleaved
    # ('{...rank 0...}{...rank 1...}' on one line, then two newlines); a pipe write under 4 KiB is atomic
    os.write(sys.stdout.fileno(), (line + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
