"""What training past one node sends between nodes (``longpeft plan RECIPE --gpus G --nodes N``): the gradient
all-reduce of each optimizer step and its time at a stated inter-node bandwidth.

The P = N x G processes all-reduce the trained weights' gradients in a ring: every GPU sends ``2 (P - 1) / P`` times
the gradient bytes through its own link, at the full line rate (a lower bound). DDP and FSDP2 synchronise once per
optimizer step; DeepSpeed reduce-scatters at every micro-batch and gathers the updated shards once per step. Not
counted: sharded launches' all-gathers of frozen weights and Ulysses' all-to-all. The time stands beside the compute
time, which overlaps much of it.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from ..launch import DEEPSPEED_LAUNCHES
from ..launch.topology import gradient_accumulation
from ..units import format_duration

# Gb/s each GPU has to other nodes: one 400 Gb/s NDR InfiniBand (or 400 GbE) port per GPU, as in DGX H100 nodes.
DEFAULT_INTER_NODE_GBPS = 400.0


def add_inter_node(plan: Any, recipe: Any, nodes: int, gbps: float = DEFAULT_INTER_NODE_GBPS) -> Any:
    """``plan`` (an :func:`~longpeft.scale.plan.estimate` over all ``plan.gpus`` = nodes x GPUs per node) with its
    gradient synchronisation between ``nodes`` nodes at ``gbps`` Gb/s per GPU in ``plan.assumptions["inter_node"]``:
    bytes every GPU sends per optimizer step, seconds per step and hours over the run's optimizer steps."""
    if nodes < 2:
        raise ConfigError(f"--nodes {nodes}: inter-node traffic needs 2 nodes or more")
    if gbps <= 0:
        raise ConfigError(f"--inter-node-gbps must be > 0, got {gbps:g}")
    processes, launch, steps = plan.gpus, plan.assumptions["launch"], plan.assumptions["optimizer_steps"]
    gradient = plan.assumptions["trainable_params"] * plan.assumptions["gradient_bytes_per_param"]
    data_parallel = processes // plan.assumptions["sequence_parallel"]
    micro_batches = gradient_accumulation(recipe, data_parallel)
    reductions = micro_batches if launch in DEEPSPEED_LAUNCHES else 1  # reduce-scatters; then one all-gather
    sent = (reductions + 1) * (processes - 1) / processes * gradient
    seconds = sent / (gbps * 1e9 / 8)
    plan.assumptions["inter_node"] = {
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
    return plan


def inter_node_lines(traffic: dict[str, Any] | None, compute_hours: float) -> list[str]:
    """The plan table's line for :func:`add_inter_node`'s traffic (none on one node)."""
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
