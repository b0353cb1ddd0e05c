"""Data parallelism over the ranks torchrun starts: who this process is, its device, its share of the work, and the
few collectives a job needs (agree on a check, broadcast a decision, gather summaries at the end).

kvzip builds nothing of its own here: torchrun launches the ranks (one node or many, with its own rendezvous) and
sets RANK, WORLD_SIZE and LOCAL_RANK; torch.distributed joins them into one process group, gloo on CPU, and on CUDA
`cpu:gloo,cuda:nccl` (NCCL for tensors; the objects exchanged here are small Python values, which torch sends
through the CPU backend). A process that torchrun did not start is a world of one: every function below works for it
without a process group, so a single-process run is the same code.

Ranks exchange metadata only (settings checks, which work is left, each rank's summary); their results go to files
that every rank can read (`kvzip.runs`). A rank that dies is torchrun's to notice: it stops the other ranks, so the
long timeout below only bounds how long a rank waits for slower ones at the end of a job of hours. torch is imported
only where a world of several ranks needs it, so that a command checks its flags before paying for it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvzip.errors import SharedUserError, UserError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
TIMEOUT = datetime.timedelta(days=7)  # a rank done with its share waits this long for the others


@dataclass(frozen=True)
class World:
    """This process's place among the ranks: rank (0 is the one that merges and reports), size, rank on its node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "World":
        """The world torchrun describes in `env` (RANK, WORLD_SIZE, LOCAL_RANK); a world of one without them."""
        if "WORLD_SIZE" not in env:
            return cls()
        try:
            world = cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))
        except (KeyError, ValueError):
            raise UserError("WORLD_SIZE is set but RANK or LOCAL_RANK is missing or not a number: start the ranks "
                            "with torchrun") from None
        if not 0 <= world.rank < world.size:
            raise UserError(f"RANK {world.rank} is outside a world of {world.size}")
        return world

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """The device this rank computes on: cuda:LOCAL_RANK on CUDA (one GPU per rank), else `device`."""
        import torch

        if device.type == "cuda" and self.size > 1:
            if self.local_rank >= torch.cuda.device_count():
                raise UserError(f"rank {self.rank} is local rank {self.local_rank}, but this node has "
                                f"{torch.cuda.device_count()} GPUs: start at most one rank per GPU")
            return torch.device("cuda", self.local_rank)
        return device


def start(world: World, device: str) -> None:
    """Join the process group (nothing to do for a world of one): gloo, and NCCL beside it unless `device` (the
    --device flag's value) rules CUDA out or none is visible, with this rank's GPU made current. It comes first,
    before any check, so that every check can be agreed on."""
    if world.size == 1:
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "gloo"
    if device != "cpu" and torch.cuda.is_available():
        backend = "cpu:gloo,cuda:nccl"
        if world.local_rank < torch.cuda.device_count():  # otherwise World.device says so, in an agreed check
            torch.cuda.set_device(world.local_rank)
    dist.init_process_group(backend, timeout=TIMEOUT)


def finish(world: World, together: bool = True) -> None:
    """Leave the process group, so that no rank exits with collectives pending. `together` (a job that ended well):
    first wait until every rank is here, so that no rank tears the group down while another still uses it (seen as
    "terminate called without an active exception" in a rank that left first, one run in three); after an error
    each rank leaves at once."""
    if world.size == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        if together:
            wait_all(world)
        dist.destroy_process_group()


def all_gather(world: World, value: T) -> list[T]:
    """Every rank's `value`, in rank order, on every rank (also a barrier)."""
    if world.size == 1:
        return [value]
    import torch.distributed as dist

    out: list = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def wait_all(world: World, poll_s: float = 0.1) -> None:
    """Wait until every rank gets here, the way a rank done with its share waits for slower ones: polling, in
    Python, so that Ctrl-C or torchrun's stop (SIGTERM) still reaches a waiting rank (a blocking collective would
    hold it in C++ until torchrun kills it)."""
    if world.size == 1:
        return
    import torch
    import torch.distributed as dist

    work = dist.all_reduce(torch.zeros(1), async_op=True)  # a CPU tensor: the gloo side of the group
    while not work.is_completed():
        time.sleep(poll_s)
    work.wait()


def broadcast(world: World, value: T) -> T:
    """Rank 0's `value` on every rank."""
    if world.size == 1:
        return value
    import torch.distributed as dist

    box = [value if world.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(world: World, check: Callable[[], T], words: Callable[[UserError], str] = str) -> T:
    """Run `check` on every rank; when it raised a UserError on any, raise it on all (SharedUserError: rank 0 says
    it, naming the rank it came from when that is another one), so every rank stops at the same point. `words`
    turns an error into the text said (the CLI's own wording of some library errors)."""
    try:
        outcome, value = None, check()
    except UserError as exc:
        outcome, value = words(exc), None
    outcomes = all_gather(world, outcome)
    failed = next(((rank, text) for rank, text in enumerate(outcomes) if text is not None), None)
    if failed is not None:
        rank, text = failed
        raise SharedUserError(text if rank == 0 else f"rank {rank}: {text}", speaker=world.main)
    return value


def deal(items: Sequence[T], world: World) -> list[T]:
    """This rank's share of `items`, dealt in turn (rank r takes items r, r + size, ...): fixed for a given list and
    world, and balanced when the items cost about the same."""
    return list(items[world.rank :: world.size])


def split_by_cost(costs: Sequence[float], world: World) -> list[int]:
    """Indices of this rank's contiguous run of items, the runs cut where the running cost passes each rank's equal
    part: neighbours stay together (work they share is done once per rank) and the parts cost about the same."""
    total = float(sum(costs)) or 1.0
    mine, running = [], 0.0
    for i, cost in enumerate(costs):
        middle = running + cost / 2  # an item belongs to the rank whose part holds its middle
        if min(int(middle * world.size / total), world.size - 1) == world.rank:
            mine.append(i)
        running += cost
    return mine
