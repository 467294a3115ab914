"""Data parallelism under ``torchrun``; without an initialised process group every function here is a no-op."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_and_world()[0] == 0


def init_from_env() -> bool:
    """Join the process group ``torchrun`` describes in the environment (gloo on CPU, nccl on GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return True


def local_part(batch: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global batch (rows split evenly; the batch size must divide)."""
    rank, world = rank_and_world()
    if world == 1:
        return batch
    if batch.shape[0] % world:
        from .errors import QuadapterError

        raise QuadapterError(f"batch size {batch.shape[0]} does not split over {world} processes")
    return batch.tensor_split(world)[rank]


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_BUCKET_ELEMENTS = 1 << 22  # 16 MB of fp32 per all-reduce, about DDP's default bucket (25 MB)


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and size + g.numel() > _BUCKET_ELEMENTS:
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        yield bucket


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Average the gradients over the ranks, one all-reduce per few MB of gradients (as DDP buckets them)."""
    _, world = rank_and_world()
    if world == 1:
        return
    params = list(params)
    for p in params:
        if p.grad is None:  # this rank's data did not reach it: a zero contribution, but the same collective
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    device = _collective_device()
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket]).to(device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def mean_over_ranks(value: float) -> float:
    _, world = rank_and_world()
    return value if world == 1 else sum_over_ranks(value)[0] / world


def sum_over_ranks(*values: float) -> tuple[float, ...]:
    _, world = rank_and_world()
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return tuple(t.tolist())


def shard(items: Sequence) -> Sequence:
    rank, world = rank_and_world()
    return items[rank::world]


def barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()
