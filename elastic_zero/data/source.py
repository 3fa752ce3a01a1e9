"""The training data of a job: batches (dicts of tensors) addressed by global sample position.

Position p of the run is a sample of a finite dataset in a seeded order per epoch (order.py), or
synthetic walk number p. Any rank computes any position's sample, which is what keeps every sample
consumed exactly once when the ranks change (see plan/batches.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from elastic_zero.data.collate import BadRow, checked_batch, token_collate
from elastic_zero.data.synthetic import MarkovTokens
from elastic_zero.losses import IGNORE


READ_AHEAD_SAMPLES = 256  # a rank reads its coming shares in calls of about this many samples


HELD_OUT_WALKS = 1 << 40  # synthetic eval data: walks this far on, which training never reaches


class SyntheticSource:
    num_samples = None  # endless

    def __init__(self, walks: MarkovTokens, first_walk: int = 0) -> None:
        self.walks, self.first_walk = walks, first_walk

    def holds(self, positions: range) -> bool:
        return True  # computed on demand: nothing to read ahead

    def read_ahead(self, shares: Sequence[range]) -> None:
        pass

    def batch(self, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        t = self.walks.tokens([self.first_walk + p for p in positions])
        return {"input_ids": t[:, :-1], "targets": t[:, 1:]}


class ArrowSource:
    """Rows of an Arrow/Parquet dataset, read streaming, through a collate."""

    def __init__(self, rows, order, collate: Callable, vocab_size: int | None, custom_collate: bool,
                 field: str = "data.source") -> None:
        self.rows, self.order, self.collate = rows, order, collate
        self.field = field  # what its errors name: "eval.source" for the eval set
        self.vocab_size, self.custom_collate = vocab_size, custom_collate
        self.num_samples = rows.num_samples
        # rows read ahead: the table, the sample of each row, and each position's row in it
        self._ahead_table, self._ahead_ids, self._ahead_row = None, [], {}

    def holds(self, positions: range) -> bool:
        """Whether these positions were read ahead (as one run)."""
        first = self._ahead_row.get(positions.start) if len(positions) else None
        return first is not None and self._ahead_row.get(positions[-1]) == first + len(positions) - 1

    def read_ahead(self, shares: Sequence[range]) -> None:
        """Read the rows of a rank's coming shares (contiguous position ranges) in one call: the
        order, the gather and Arrow's fixed costs are paid once for many micro batches. What was
        read ahead before is dropped (after a change of world the shares differ)."""
        positions = [p for share in shares for p in share]
        ids = self.order.samples(positions)
        self._ahead_table, self._ahead_ids = self.rows.rows(ids), ids
        self._ahead_row = {p: i for i, p in enumerate(positions)}

    def batch(self, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        if isinstance(positions, range) and self.holds(positions):
            first = self._ahead_row[positions.start]
            table = self._ahead_table.slice(first, len(positions))
            ids = self._ahead_ids[first : first + len(positions)]
        else:
            ids = self.order.samples(positions)
            table = self.rows.rows(ids)
        try:
            batch = self.collate(table)
        except BadRow as exc:
            raise ValueError(f"{self.field}: {self.rows.where(ids[exc.row])}: {exc}") from None
        except Exception as exc:
            if not self.custom_collate:
                raise
            raise ValueError(f"data.collate: raised {type(exc).__name__}: {exc}") from None
        batch = checked_batch(batch) if self.custom_collate else batch
        self._check_vocabulary(batch, ids)
        return batch

    def _check_vocabulary(self, batch: dict, ids: list[int]) -> None:
        """Token ids the model cannot embed fail in the model with an index error far from the cause:
        name the sample instead."""
        if self.vocab_size is None:
            return
        for key in ("input_ids", "targets"):
            t = batch.get(key)
            if t is None or t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                continue
            padding = IGNORE if key == "targets" else 0  # -100 marks padding among targets only
            outside = (t >= self.vocab_size) | ((t < 0) & (t != padding))
            bad = outside.reshape(t.shape[0], -1).any(dim=1)
            if bool(bad.any()):
                row = int(bad.nonzero()[0])
                wrong = int(t[row][outside[row]][0])
                raise ValueError(f"{self.field}: {self.rows.where(ids[row])}: token id {wrong} in {key!r} is outside "
                                 f"the model's vocabulary of {self.vocab_size}")


def open_source(data, seed: int, vocab_size: int | None, seq_len: int | None, collate: Callable | None,
                held_out: bool = False):
    """The source a DataSpec describes. `vocab_size` and `seq_len` are the model's, when it says;
    the spec's own seq_len wins. `held_out`: the eval data ([eval]): synthetic, walks on the same
    chain that training never reaches; a dataset, whose errors then name eval.source."""
    seq_len = data.seq_len or seq_len
    if data.source == "synthetic":
        vocab = vocab_size or data.vocab_size
        if vocab is None or seq_len is None:
            raise ValueError("data.source: synthetic data needs a vocabulary size and a sequence length: the "
                             "model does not say (no .cfg or .config), so set data.vocab_size and data.seq_len")
        walks = MarkovTokens(vocab, seq_len, seed=seed, branching=data.branching)
        return SyntheticSource(walks, HELD_OUT_WALKS if held_out else 0)
    from elastic_zero.data.arrow_rows import ArrowRows
    from elastic_zero.data.order import BlockShuffledOrder

    rows = ArrowRows(data.source, data.columns_read(own_collate=collate is not None))
    if collate is None:
        fixed = data.seq_len is not None

        def collate(table):
            return token_collate(table, data.column, seq_len, data.pad_id, fixed_length=fixed)

        custom = False
    else:
        custom = True
    return ArrowSource(rows, BlockShuffledOrder(rows.block_sizes, seed), collate, vocab_size, custom,
                       field="eval.source" if held_out else "data.source")


def read_ahead_for_step(source, step: int, steps: int, share_of: Callable[[int], range]) -> None:
    """Before a step: if the source does not hold this rank's share of it, read the shares of this
    and the coming steps (about READ_AHEAD_SAMPLES samples; never past the last step)."""
    share = share_of(step)
    if source.holds(share):
        return
    count = max(1, READ_AHEAD_SAMPLES // max(1, len(share)))
    source.read_ahead([share_of(s) for s in range(step, min(step + count, steps))])
