"""Processes, devices and data parallelism, kept out of the model code.

Under ``torchrun`` (``WORLD_SIZE > 1``) every rank trains a replica on its rows of the
global batch: FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per block, then the
whole model) or DDP. In one process the model is used as it is. The model module keeps
its parameter names in every mode, so checkpoints move between them.

With context parallelism (``cp`` ranks per row) the ranks form a ``(data, context)``
DeviceMesh: the ``cp`` ranks of one data index hold the same rows, each its part of every
sequence (:class:`lapse.layers.ContextParallel`, over the mesh's ``context`` group).
FSDP2 or DDP still spans every rank: each rank's loss is its share of its rows' mean
times ``cp`` (``Decoder.forward``), so the gradients averaged over all ranks are those of
the global batch's mean.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lapse.layers import ContextParallel
from lapse.ops.backend import resolve_device


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` processes, on ``device``."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    cp: int = 1
    """Ranks per row (context parallelism): consecutive ranks share rows."""

    @property
    def main(self) -> bool:
        """Rank 0 writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def data_rank(self) -> int:
        """Which rows this rank holds: its index along the data dimension."""
        return self.rank // self.cp

    @property
    def data_size(self) -> int:
        """How many ways the global batch's rows are split."""
        return self.size // self.cp


def init_world(device: str = "auto") -> World:
    """Join the process group when launched by ``torchrun`` and pick this rank's device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if size > 1 and not dist.is_initialized():
        # a long timeout: the other ranks wait at a barrier while rank 0 tokenises the corpus
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            device_id=dev if dev.type == "cuda" else None,
            timeout=timedelta(hours=2),
        )
    return World(rank=rank, size=size, local_rank=local_rank, device=dev)


def context_parallel(world: World, cp: int, mode: str) -> tuple[World, ContextParallel | None]:
    """``world`` with ``cp`` ranks per row, and this rank's
    :class:`~lapse.layers.ContextParallel` over its row group (``None`` when ``cp`` is 1
    or in one process), from a ``(data, context)`` DeviceMesh."""
    if cp == 1 or not world.distributed:  # one process holds whole rows
        return world, None
    if cp < 1 or world.size % cp:
        raise ValueError(f"--cp {cp} must divide the {world.size} processes (torchrun --nproc-per-node)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world.device.type, (world.size // cp, cp), mesh_dim_names=("data", "context"))
    return replace(world, cp=cp), ContextParallel.of(mesh.get_group("context"), mode)


def close_world(world: World, clean: bool = True) -> None:
    """Leave the process group. After a run that ended normally (``clean``) every rank first
    waits for the others at a barrier: rank 0 still writes the plots and the report, and a rank
    that tears its group down while a peer is busy can leave a process hanging at exit
    (pytorch/pytorch#75097; the two-process CPU test timed out that way once). After an error
    there is no barrier: the other ranks may never reach it."""
    if world.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def parallelize(
    model: nn.Module,
    world: World,
    mode: str,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The module the training loop calls: the model itself in one process, sharded with
    FSDP2 per block (``mode`` "fsdp" or "auto") or wrapped in DDP across processes.
    ``auto`` takes DDP for a model with scalar parameters (DCP's ``beta``), which FSDP2's
    ``fully_shard`` refuses."""
    if not world.distributed:
        return model
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars and mode == "fsdp":
        names = ", ".join(scalars[:3])
        raise ValueError(f"FSDP2 cannot shard scalar parameters ({names}); use --parallel ddp")
    if scalars and mode == "auto":  # DCP's beta: fully_shard refuses 0-d parameters
        mode = "ddp"
    if mode in ("auto", "fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        # the root (embedding, final norm, head) is needed again at once by the backward
        fully_shard(model, reshard_after_forward=False, mp_policy=mp)
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[world.device] if world.device.type == "cuda" else None
        )
    raise ValueError(f"parallel must be 'auto', 'fsdp' or 'ddp', got {mode!r}")


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def gradient_sync(module: nn.Module, enabled: bool):
    """A context in which backward passes do (or do not) all-reduce gradients: off for every
    micro-batch of an accumulation but the last."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def all_reduce_mean(value: torch.Tensor, world: World) -> torch.Tensor:
    """The mean of ``value`` over ranks (the value itself in one process)."""
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG if value.device.type == "cuda" else dist.ReduceOp.SUM)
        if value.device.type != "cuda":  # gloo has no AVG
            value /= world.size
    return value


def any_rank(flag: bool, world: World) -> bool:
    """Whether ``flag`` is set on any rank (so all ranks stop at the same step)."""
    if not world.distributed:
        return flag
    t = torch.tensor([int(flag)], device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
