"""torchrun integration: rank/world from the environment, gloo on CPU and nccl on CUDA, and the
few collectives the trainer needs (sums, gathers, barriers). Without torchrun it is a no-op."""
from __future__ import annotations

import datetime
import os

import torch


class Dist:
    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world > 1
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{self.local_rank}" if cuda else "cpu")
        if self.enabled:
            import torch.distributed as dist

            if cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    def gather(self, obj):
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    def close(self, finished: bool = True) -> None:
        """Leave the process group. After a normal finish every rank first waits for the others:
        rank 0 is still writing the last checkpoint when the others return, and a rank that tears
        its gloo connections down while a peer still uses them aborts ("terminate called without
        an active exception"). After an error there is no barrier, which could wait forever."""
        if self.enabled:
            import torch.distributed as dist

            if finished:
                dist.barrier()
            dist.destroy_process_group()
