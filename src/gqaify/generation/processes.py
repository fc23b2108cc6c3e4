"""The processes sampling one corpus: one, or several started by a launcher (`accelerate launch -m gqaify generate`,
torchrun), each on its own device. The main process holds OUT and writes the record; the shards are shared out.

Nothing here loads accelerate or torch.distributed for one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from gqaify.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Processes:
    """This process's place among the `size` processes sampling one corpus."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def launched(cls) -> Processes:
        """The processes a launcher started (WORLD_SIZE), joined in one group; one process without a launcher.

        Raises:
            UserError: the launcher started several but they could not join one group (torchrun on a machine
                without a GPU and without ACCELERATE_USE_CPU: each would sample the whole corpus alone).
        """
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched == 1:
            return cls()
        from accelerate import PartialState
        from accelerate.utils import parse_flag_from_env

        state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator reads it: gloo
        if state.num_processes != launched:
            raise UserError(
                f"the launcher started {launched} processes but accelerate joined {state.num_processes}: without a "
                "GPU, launch with ACCELERATE_USE_CPU=1"
            )
        return cls(state.process_index, state.num_processes, state.local_process_index)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """Where this process samples: a GPU of its own when the device is a GPU without an index."""
        if self.size > 1 and device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    def gather(self, value: T) -> list[T]:
        """Every process's `value`, in rank order."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        torch.distributed.all_gather_object(values, value)
        return values

    def on_main(self, work: Callable[[], T]) -> T:
        """`work()` run on the main process, its result given to every process; its `UserError` raised on every
        process (so that a refusal is one line from each, and none waits for the others)."""
        result, problem = None, None
        if self.main:
            try:
                result = work()
            except UserError as exc:
                problem = str(exc)
        if self.size > 1:
            shared = [result, problem]
            torch.distributed.broadcast_object_list(shared, src=0)
            result, problem = shared
        if problem is not None:
            raise UserError(problem)
        return result
