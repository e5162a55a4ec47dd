"""Run under ``accelerate launch --config_file longpeft/launch/zero3.yaml --num_processes 2`` (DeepSpeed's CPU
accelerator, gloo): build a tiny model as the runner does (the saved base loaded inside ``zero.Init``, LoRA and the
trained weights in float32), prepare it and torch AdamW with accelerate, take one step, and print, from every rank,
one JSON line of the bytes that rank holds under ZeRO-3: weight partitions (frozen and trained), the gradient
partitions, the float32 master partitions, AdamW's moments, and the reduce bucket.

Arguments: ``full`` (every weight trains), ``lora`` (LoRA r=4 on q, k, v, o and a trained copy of the input
embedding, as the planner's tiny-cpu recipe) or ``qlora`` (the same over the base loaded in 4 bits, NF4 with double
quantization, as the runner's ``quantization_config``); the saved tiny base's folder. The precision is the launch's
``--mixed_precision`` (``no``: float32; ``bf16``: DeepSpeed's bf16 mode). The sizes are read from the DeepSpeed
optimizer's own tensors, so they are what this release allocates, not what the planner assumes. Not counted: the
whole copies DeepSpeed keeps on every rank of parameters under ``stage3_param_persistence_threshold`` (1e5
elements: here every tensor; at 8B the norms and low-rank LoRA matrices, tens of MB).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from fsdp2_bytes_worker import quant_tensors  # this folder is on sys.path when the worker runs as a script


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def main(mode: str, base: str) -> None:
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    from longpeft.recipes.peft_setup import keep_trained_weights_in

    accelerator = Accelerator()
    assert is_deepspeed_zero3_enabled()  # so from_pretrained builds the base partitioned, inside zero.Init
    compute = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    quantization = None
    if mode == "qlora":  # as the runner's quantization_config: NF4, double quantization, storage in the compute dtype
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_quant_storage=compute,
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=compute, quantization_config=quantization)
    if mode in ("lora", "qlora"):
        model = get_peft_model(
            model,
            LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["embed_tokens"]),
        )
    # trained weights in float32 (the runner's default lora.trainable_dtype), the forward in the compute dtype
    keep_trained_weights_in(model, torch.float32, compute)
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    # no data loader fills the "auto" batch sizes; on CPU accelerate counts 1 process (no backend name), DeepSpeed 2
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config.update(train_micro_batch_size_per_gpu=1, train_batch_size=torch.distributed.get_world_size())
    engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(trained))
    zero = optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO-3 optimizer
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    tokens = torch.randint(0, 512, (1, 16), generator=generator)
    accelerator.backward(engine(input_ids=tokens, labels=tokens).loss)
    optimizer.step()
    line = json.dumps(
        {
            "rank": torch.distributed.get_rank(),
            "frozen_weights": sum(nbytes(p.ds_tensor) for p in frozen),
            "quant_constants": sum(
                nbytes(t)
                for p in frozen
                if getattr(p, "quant_state", None) is not None
                for t in quant_tensors(p.quant_state)
            ),
            "trained_weights": sum(nbytes(p.ds_tensor) for p in trained),
            "trained_dtype": str(trained[0].ds_tensor.dtype),
            "gradients": nbytes(zero.grad_partitions_flat_buffer),
            "master": sum(nbytes(t) for t in zero.fp32_partitioned_groups_flat),
            "moments": sum(nbytes(t) for state in zero.optimizer.state.values() for t in state.values() if t.dim()),
            "reduce_bucket": sum(nbytes(bucket.buffer) for bucket in zero.ipg_buckets.values()),
        }
    )
    os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: the ranks share the pipe
    from longpeft.launch.teardown import exit_without_teardown

    exit_without_teardown()  # DeepSpeed's CPU processes abort at teardown now and then, after the bytes were written


if __name__ == "__main__":
    main(*sys.argv[1:])
