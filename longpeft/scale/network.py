"""What training past one node sends between nodes (``longpeft plan RECIPE --gpus G --nodes N``): the gradient
all-reduce of each optimizer step and its time at a stated inter-node bandwidth.

Model: the P = N x G processes synchronise the trained weights' gradients (``trainable_params`` x bytes per
gradient) with a ring all-reduce, which sends ``2 (P - 1) / P`` times the gradient bytes from every GPU (a
reduce-scatter and an all-gather). Between nodes every GPU's share goes through its own network link (NCCL runs one
ring per link), so the time is those bytes over one GPU's inter-node bandwidth, at the full line rate (NCCL reaches
about 80-90 % of it: a lower bound). DDP reduces gradients in the trained weights' dtype (``lora.trainable_dtype``,
float32 for a full fine-tune and a method's own weights), sharded launches in the compute dtype (accelerate's FSDP2
mixed-precision policy reduces in it; DeepSpeed keeps its gradients in it). DeepSpeed (``zero3``, ``ulysses``)
reduce-scatters them at every micro-batch and gathers the updated shards once per step, where DDP and FSDP2
accumulate them locally and synchronise once per optimizer step. Not counted: the frozen weights' all-gathers of
sharded launches (every forward and backward), and Ulysses' all-to-all of the attention inputs and outputs. The time
stands beside the compute time, not added to it: the launches overlap much of it with the backward.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from ..launch import DEEPSPEED_LAUNCHES, SHARDED_LAUNCHES
from ..launch.topology import gradient_accumulation
from ..units import format_duration

# Gb/s each GPU has to other nodes: one 400 Gb/s NDR InfiniBand (or 400 GbE) port per GPU, as in DGX H100 nodes.
DEFAULT_INTER_NODE_GBPS = 400.0


def gradient_bytes_per_param(recipe: Any, launch: str | None) -> int:
    """Bytes of one trained weight's gradient as it is reduced: the compute dtype under a sharded launch, else the
    trained weights' dtype (LoRA's ``lora.trainable_dtype``; float32 otherwise)."""
    if launch in SHARDED_LAUNCHES:
        return 4 if recipe.model.dtype == "float32" else 2
    return 2 if recipe.finetune == "lora" and recipe.lora.trainable_dtype == "bfloat16" else 4


def inter_node_traffic(plan: Any, recipe: Any, nodes: int, gbps: float = DEFAULT_INTER_NODE_GBPS) -> dict[str, Any]:
    """The gradient synchronisation of ``plan`` (an :func:`~longpeft.scale.plan.estimate` over all ``plan.gpus``
    = nodes x GPUs per node) between ``nodes`` nodes at ``gbps`` Gb/s per GPU: bytes every GPU sends per optimizer
    step, seconds per step and hours over the run's optimizer steps."""
    if nodes < 2:
        raise ConfigError(f"--nodes {nodes}: inter-node traffic needs 2 nodes or more")
    if gbps <= 0:
        raise ConfigError(f"--inter-node-gbps must be > 0, got {gbps:g}")
    processes, launch = plan.gpus, plan.assumptions["launch"]
    gradient = plan.assumptions["trainable_params"] * gradient_bytes_per_param(recipe, launch)
    data_parallel = processes // plan.assumptions["sequence_parallel"]
    micro_batches = gradient_accumulation(recipe, data_parallel)
    reductions = micro_batches if launch in DEEPSPEED_LAUNCHES else 1  # reduce-scatters; then one all-gather
    sent = (reductions + 1) * (processes - 1) / processes * gradient
    seconds = sent / (gbps * 1e9 / 8)
    steps = plan.assumptions["optimizer_steps"]
    return {
        "nodes": nodes,
        "gpus_per_node": processes // nodes,
        "gbps": gbps,
        "gradient_bytes": gradient,
        "reductions_per_step": reductions,
        "bytes_per_step": sent,
        "seconds_per_step": seconds,
        "optimizer_steps": steps,
        "hours": seconds * steps / 3600,
    }


def add_inter_node(plan: Any, recipe: Any, nodes: int, gbps: float = DEFAULT_INTER_NODE_GBPS) -> Any:
    """``plan`` with its :func:`inter_node_traffic` in ``plan.assumptions["inter_node"]`` (its table's line)."""
    plan.assumptions["inter_node"] = inter_node_traffic(plan, recipe, nodes, gbps)
    return plan


def inter_node_lines(traffic: dict[str, Any] | None, compute_hours: float) -> list[str]:
    """The plan table's line for :func:`inter_node_traffic` (none on one node)."""
    if traffic is None:
        return []
    share = traffic["hours"] / compute_hours if compute_hours else math.inf
    reductions = traffic["reductions_per_step"]
    times = "" if reductions == 1 else f", reduced at each of {reductions} micro-batches"
    return [
        f"inter-node: {traffic['nodes']} nodes x {traffic['gpus_per_node']} GPUs, gradient all-reduce of "
        f"{traffic['gradient_bytes'] / 1e9:.2f} GB{times}: {traffic['bytes_per_step'] / 1e9:.2f} GB sent per GPU "
        f"per optimizer step, {traffic['seconds_per_step']:.3g} s at {traffic['gbps']:g} Gb/s per GPU, "
        f"{format_duration(traffic['hours'] * 3600)} over {traffic['optimizer_steps']:,} steps ({share:.1%} of "
        "the compute time, added to it where it does not overlap the backward)"
    ]
