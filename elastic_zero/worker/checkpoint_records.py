"""The sample records a worker's next checkpoint carries: those of every step its generation
committed (replicated) or saved, so that a checkpoint stands for the generation's reports should every
member be lost (older checkpoints may be pruned by then). Started anew with each generation: the
coordinator holds the last generation's from its report."""

from __future__ import annotations


class CheckpointRecords:
    def __init__(self) -> None:
        self.rows: list[tuple] = []  # (generation, step, rank, start, count)
        self.saved_through = -1  # the index of the last step whose records went into a checkpoint

    def new_generation(self) -> None:
        self.rows, self.saved_through = [], -1

    def committed(self, generation: int, rows) -> None:
        """A commit made these (step, rank, start, count) records safe: those not saved yet are kept."""
        self.rows.extend((generation, *row) for row in rows if row[0] > self.saved_through)

    def saved_at(self, step_count: int) -> bool:
        """Whether the step that brought the count to `step_count` was saved already."""
        return self.saved_through == step_count - 1

    def for_save(self, generation: int, rows, step_count: int) -> list[tuple]:
        """The records of a save of step `step_count`: those kept, and `rows` ((step, rank, start,
        count) not committed yet), which are kept from now on too."""
        self.rows = self.rows + [(generation, *row) for row in rows]
        self.saved_through = step_count - 1  # rows name a step by its index
        return self.rows
