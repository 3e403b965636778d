"""The process group: one process, `torchrun` (DDP over gloo/nccl) or `deepspeed` (ZeRO 1/2).

Every process sees the same global batch order and takes its slice; `Dist` is what the rest of training
knows about the others: this process's rank and device, sums over all of them, and barriers.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from medusa.errors import MedusaError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mine(self, micro: int) -> slice:
        """This process's rows of a global micro-batch of `micro * world` rows."""
        return slice(self.rank * micro, (self.rank + 1) * micro)


def local_rank() -> int:
    """This process's index on its machine. torchrun, `deepspeed` and `accelerate launch` all set
    LOCAL_RANK (the deepspeed launcher also passes `--local_rank=N`, which the CLI accepts and ignores)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise MedusaError(f"LOCAL_RANK: expected an integer, got {value!r}") from None


def rank_device(rank: int | None = None) -> torch.device:
    """The device this process trains on: `cuda:LOCAL_RANK` (made the current CUDA device, so that NCCL and
    every bare `cuda` tensor use it) when CUDA is available, else the CPU. Without this every rank would
    land on GPU 0."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    rank = local_rank() if rank is None else rank
    count = torch.cuda.device_count()
    if not 0 <= rank < count:
        raise MedusaError(f"LOCAL_RANK: {rank} but this machine has {count} visible CUDA device(s); "
                          "start at most that many processes per machine (or set CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def init_dist(deepspeed: bool = False) -> Dist:
    """Join the process group the launcher describes (WORLD_SIZE > 1), or a group of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # The device is chosen before the process group starts: NCCL binds each rank to the current device.
    device = rank_device()
    if world == 1:
        return Dist(device=device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if deepspeed:
            import deepspeed as ds

            ds.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend)
        # A process group still alive when the interpreter tears down may abort the process ("terminate
        # called without an active exception") after training has finished: close it first.
        atexit.register(_close_process_group)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def _close_process_group() -> None:
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
        release_shm_buffer(rank)


def release_shm_buffer(rank: int) -> bool:
    """Remove this rank's DeepSpeed CPU all-reduce buffer from /dev/shm (64 MiB or more each), which
    DeepSpeed creates per rank and never removes: every CPU run under its launcher would otherwise leave
    them behind in shared memory (RAM) until reboot. Only the name goes: the processes that mapped it keep
    their mapping until they exit. Returns whether a buffer was removed."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return False
    path = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"
    try:
        path.unlink()
    except OSError:  # none made (GPU, no shm op) or already gone
        return False
    return True


def shard_frozen(model: torch.nn.Module, d: Dist) -> tuple[int, int]:
    """Shard a frozen HF causal LM over every process with FSDP2 (`fully_shard`): each decoder layer is a
    group of its own, then the whole model (embeddings, final norm, lm_head: tied weights stay one
    parameter) is the root group. Each process keeps 1/world of every weight; a forward all-gathers one
    group at a time and frees it again after (`reshard_after_forward`), so a process holds at most the
    shards plus one layer in full. Every process must then run the model's forward the same number of
    times (the layers' all-gathers are collectives): the caller's job. In place; returns the weights this
    process holds and the model's, in elements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    params = list(model.parameters())
    return sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)


class _OwnEmbeddings:
    """What a head borrows from its target (`FeatureHead.embed`), here a whole copy of the input embeddings
    of a target that is sharded: its own are shards outside the target's forward."""

    def __init__(self, embeddings: torch.nn.Module):
        self.embeddings = embeddings

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embeddings


def shard_target(hf, head, d: Dist) -> None:
    """`target_sharding: fsdp`: the head takes a whole copy of the embeddings it reads (its lm_head rows are
    its own already), then the target is sharded over every process (medusa.train.dist.shard_frozen)."""
    import copy
    import sys

    head._target = [_OwnEmbeddings(copy.deepcopy(hf.get_input_embeddings()).to(d.device).requires_grad_(False))]
    local, whole = shard_frozen(hf, d)
    if d.main:
        print(f"target sharded with FSDP2 over {d.world} processes: rank 0 holds {local:,} of its {whole:,} "
              "weights", file=sys.stderr, flush=True)
