"""Training past one node: where a node stands in the job (``--nodes``, ``--node-rank``, ``--main-address``), the
``accelerate launch`` arguments that say it (torchrun's static rendezvous at the node of rank 0, DeepSpeed's launches
included, rather than DeepSpeed's own ssh launcher), and a SLURM batch script that runs one launch per node.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass

from ..errors import ConfigError
from .kinds import DEEPSPEED_LAUNCHES

DEFAULT_MAIN_PORT = 29500  # torchrun's and accelerate's default


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as this node sees them: ``count`` nodes, this one of rank ``rank`` (0 runs process 0 and the
    rendezvous), which listens at ``host:port``. One node needs no address (accelerate picks its own port); with
    ``host`` None the arguments leave the address to accelerate."""

    count: int = 1
    rank: int = 0
    host: str | None = None
    port: int = DEFAULT_MAIN_PORT

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.count}")
        if not 0 <= self.rank < self.count:
            raise ConfigError(
                f"--node-rank {self.rank} is out of range for --nodes {self.count}: give 0 to "
                f"{self.count - 1} (0 is the node at --main-address), a different one on every node"
            )
        if self.count > 1 and self.host is None:
            raise ConfigError(
                f"--nodes {self.count}: give --main-address HOST:PORT, the address of the node of "
                "--node-rank 0 that every node can reach (the same on every node)"
            )
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--main-address: port {self.port} is out of range (1 to 65535)")

    def accelerate_arguments(self, launch: str) -> list[str]:
        """``accelerate launch`` flags of this node's place: ``--num_machines --machine_rank --main_process_ip
        --main_process_port`` (and DeepSpeed's torchrun launcher) past one node; one node's given address only."""
        address = [] if self.host is None else ["--main_process_ip", self.host, "--main_process_port", str(self.port)]
        if self.count == 1:
            return address
        arguments = ["--num_machines", str(self.count), "--machine_rank", str(self.rank), *address]
        if launch in DEEPSPEED_LAUNCHES:
            arguments += ["--deepspeed_multinode_launcher", "standard"]
        return arguments


def parse_main_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 address in brackets, ``[fd00::1]:29500``) -> ``(host, port)``; a ConfigError naming
    ``--main-address`` and the expected form."""
    match = re.fullmatch(r"\[(?P<ipv6>[^]]+)\]:(?P<port>\d+)|(?P<host>[A-Za-z0-9._-]+):(?P<port2>\d+)", text)
    if match is None:
        raise ConfigError(
            f"--main-address {text!r}: give HOST:PORT, the node of rank 0 and a free port on it, e.g. "
            "10.0.0.1:29500 or node001:29500 ([fd00::1]:29500 for IPv6)"
        )
    host = match["host"] or match["ipv6"]
    if match["ipv6"]:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"--main-address {text!r}: {host!r} is not an IPv6 address") from None
    port = int(match["port"] or match["port2"])
    if not 1 <= port <= 65535:
        raise ConfigError(f"--main-address {text!r}: port {port} is out of range (1 to 65535)")
    return host, port


def slurm_script(command: list[str], job_name: str, nodes: int, gpus_per_node: int) -> str:
    """A SLURM batch script that runs ``command`` (:func:`longpeft.launch.launch_command` for ``Nodes(nodes,
    host=...)``, any host) once per node, with its machine rank from ``$SLURM_NODEID`` and the main address from the
    allocation's first host at ``$MAIN_PORT`` (default 29500)."""
    words = [shlex.quote(word) for word in command]
    for flag, variable in (
        ("--machine_rank", "SLURM_NODEID"),
        ("--main_process_ip", "MAIN_HOST"),
        ("--main_process_port", "MAIN_PORT"),
    ):
        if flag in command:  # one node has no machine rank
            words[command.index(flag) + 1] = f'"${variable}"'
        elif flag != "--machine_rank" or nodes > 1:
            raise ValueError(f"slurm_script: the command has no {flag} (build it with Nodes({nodes}, host=...))")
    launch = " ".join(words)
    place = f"{nodes} node{'s' if nodes > 1 else ''} x {gpus_per_node} GPUs"
    return f"""#!/bin/bash
# longpeft training on {place}, written by `longpeft train ... --print-slurm`. Submit it with
# `sbatch FILE` from the environment where longpeft is installed (sbatch passes it on to the nodes). srun runs one
# task per node: an `accelerate launch` that starts the node's {gpus_per_node} processes.
# The recipe (a bundled name or a path), its data and its output_dir must be on a filesystem every node sees: every
# process writes its part of a checkpoint there. After a kill, add --resume to the longpeft command below and submit
# again. `MAIN_PORT=PORT sbatch FILE` changes the rendezvous port (default {DEFAULT_MAIN_PORT}).
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
set -euo pipefail

# the first host of the allocation is node 0: it runs process 0 and the rendezvous
MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MAIN_PORT=${{MAIN_PORT:-{DEFAULT_MAIN_PORT}}}
export MAIN_HOST MAIN_PORT

# one task per node; SLURM_NODEID (0 .. nodes-1) is each task's node, hence its machine rank
srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote(launch)}
"""
