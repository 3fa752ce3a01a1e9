"""ArrowRows against pyarrow.dataset's whole-table read, and BlockShuffledOrder's properties."""

import bisect
import itertools
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_zero.data.arrow_rows import ArrowRows, DataError
from elastic_zero.data.order import BlockShuffledOrder

N = 37
SPLITS = [(0, 13), (13, 20), (20, N)]  # rows of the three files of a directory dataset


def _table(ids=range(N)) -> pa.Table:
    ids = list(ids)
    return pa.table({"id": pa.array(ids, pa.int64()),
                     "text": [f"row {i}" if i % 5 else None for i in ids],
                     "tokens": pa.array([[i, i + 1, i + 2] for i in ids], pa.list_(pa.int32()))})


def _write_ipc(path, table, batch_rows):
    with ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> (source, pyarrow.dataset format): one table in several layouts, several blocks each."""
    root, table = tmp_path_factory.mktemp("arrow_data"), _table()
    pq.write_table(table, root / "one.parquet", row_group_size=5)
    _write_ipc(root / "one.arrow", table, 6)
    (root / "pq").mkdir()
    (root / "ipc").mkdir()
    for k, (lo, hi) in enumerate(SPLITS):
        pq.write_table(table.slice(lo, hi - lo), root / "pq" / f"part-{k}.parquet", row_group_size=4)
        _write_ipc(root / "ipc" / f"part-{k}{('.arrow', '.feather', '.ipc')[k]}", table.slice(lo, hi - lo), 3)
    (root / "pq" / "_SUCCESS").write_text("")  # a marker file that pyarrow.dataset (and so ArrowRows) skips
    return {"parquet file": (str(root / "one.parquet"), "parquet"),
            "ipc file": (str(root / "one.arrow"), "ipc"),
            "parquet dir": (str(root / "pq"), "parquet"),
            "ipc dir": (str(root / "ipc"), "ipc"),
            "parquet dir uri": ((root / "pq").as_uri(), "parquet"),
            "ipc file uri": ((root / "one.arrow").as_uri(), "ipc")}


def _oracle(source, fmt) -> pa.Table:
    return ds.dataset(source, format=fmt).to_table()


@pytest.mark.parametrize("name", ["parquet file", "ipc file", "parquet dir", "ipc dir", "parquet dir uri",
                                  "ipc file uri"])
@settings(max_examples=40, deadline=None)
@given(indices=st.lists(st.integers(0, N - 1), max_size=30),
       columns=st.sampled_from([None, ["tokens", "id"], ["text"]]))
def test_rows_are_the_rows_of_the_whole_table(sources, name, indices, columns):
    source, fmt = sources[name]
    oracle = _oracle(source, fmt)
    assert oracle.column("id").to_pylist() == list(range(N))  # files in path order, blocks in file order
    data = ArrowRows(source, columns=columns, cache_blocks=2)
    wanted = list(columns or oracle.column_names)
    assert data.num_samples == N and sum(data.block_sizes) == N and data.columns == tuple(wanted)
    got = data.rows(indices)
    assert got.column_names == wanted
    assert got.equals(oracle.take(pa.array(indices, pa.int64())).select(wanted))


def test_block_sizes_follow_files_in_path_order_then_blocks(sources):
    assert ArrowRows(sources["parquet dir"][0]).block_sizes == (4, 4, 4, 1, 4, 3, 4, 4, 4, 4, 1)
    assert ArrowRows(sources["ipc dir"][0]).block_sizes == (3, 3, 3, 3, 1, 3, 3, 1) + (3,) * 5 + (2,)
    assert ArrowRows(sources["parquet file"][0]).block_sizes == (5,) * 7 + (2,)


def test_only_the_blocks_holding_the_asked_rows_are_read(sources, monkeypatch):
    calls = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **kw: calls.append(i) or real(self, i, **kw))
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **kw: pytest.fail("a whole file was read"))
    data = ArrowRows(sources["parquet dir"][0], columns=["id"], cache_blocks=4)
    assert data.blocks_read == 0 and calls == []  # opening reads metadata only
    assert data.rows([5, 0, 1, 4]).column("id").to_pylist() == [5, 0, 1, 4]
    assert data.blocks_read == 2 and calls == [0, 1]  # rows 0-3 and 4-7: row groups 0 and 1 of part-0
    data.rows([2, 6])
    assert data.blocks_read == 2  # both cached
    data.rows([13, 36])
    assert data.blocks_read == 4 and calls == [0, 1, 0, 4]  # part-1 row group 0, part-2 row group 4
    # All rows in one call, in reverse: each of the 11 blocks is read once, although the cache holds 4.
    fresh = ArrowRows(sources["parquet dir"][0], columns=["id"], cache_blocks=4)
    assert fresh.rows(range(N)[::-1]).column("id").to_pylist() == list(range(N))[::-1]
    assert fresh.blocks_read == 11 and len(calls) == 4 + 11


def test_ipc_reads_count_blocks_too(sources):
    data = ArrowRows(sources["ipc dir"][0], columns=["text"], cache_blocks=1)
    data.rows([0, 1, 2])
    data.rows([2, 1])
    assert data.blocks_read == 1
    data.rows([3])
    data.rows([0])
    assert data.blocks_read == 3  # block 1 displaced block 0 from the one-block cache


def test_where_names_the_file_and_the_row_within_it(sources):
    source = sources["parquet dir"][0]
    data = ArrowRows(source)
    assert data.where(0) == f"{source}/part-0.parquet row 0"
    assert data.where(13) == f"{source}/part-1.parquet row 0"
    assert data.where(36) == f"{source}/part-2.parquet row 16"
    assert ArrowRows(sources["ipc dir"][0]).where(19) == f"{sources['ipc dir'][0]}/part-1.feather row 6"
    assert ArrowRows(sources["ipc file"][0]).where(30) == f"{sources['ipc file'][0]} row 30"
    uri = sources["parquet dir uri"][0]
    assert ArrowRows(uri).where(20) == f"{uri}/part-2.parquet row 0"
    with pytest.raises(IndexError, match="out of range"):
        data.where(N)


def test_empty_and_out_of_range_requests(sources):
    data = ArrowRows(sources["parquet file"][0], columns=["tokens"])
    empty = data.rows([])
    assert empty.num_rows == 0 and empty.column_names == ["tokens"]
    for bad in ([0, N], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            data.rows(bad)


def _data_error(source, **kw) -> str:
    with pytest.raises(DataError) as info:
        ArrowRows(str(source), **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_missing_column_names_the_field_the_file_and_the_columns_it_has(sources):
    message = _data_error(sources["parquet dir"][0], columns=["id", "nope"])
    assert message == (f"data.column: 'nope' is not a column of '{sources['parquet dir'][0]}/part-0.parquet' "
                       "(it has: id, text, tokens)")
    assert _data_error(sources["ipc file"][0], columns=["x"]).startswith(
        f"data.column: 'x' is not a column of '{sources['ipc file'][0]}'")


def test_a_missing_path_and_an_empty_dataset(tmp_path):
    assert _data_error(tmp_path / "absent") == f"data.source: no dataset at '{tmp_path / 'absent'}'"
    assert _data_error((tmp_path / "absent.parquet").as_uri()).startswith("data.source: no dataset at 'file://")
    (tmp_path / "empty_dir").mkdir()
    assert _data_error(tmp_path / "empty_dir") == f"data.source: no data files in '{tmp_path / 'empty_dir'}'"
    pq.write_table(_table([]), tmp_path / "empty.parquet")
    assert _data_error(tmp_path / "empty.parquet") == f"data.source: '{tmp_path / 'empty.parquet'}' has no rows"
    _write_ipc(tmp_path / "empty.arrow", _table([]), 4)
    assert _data_error(tmp_path / "empty.arrow").endswith("has no rows")


def test_files_with_different_schemas(tmp_path):
    pq.write_table(_table(range(3)), tmp_path / "a.parquet")
    pq.write_table(_table(range(3)).set_column(0, "id", pa.array(["0", "1", "2"])), tmp_path / "b.parquet")
    assert _data_error(tmp_path) == (f"data.source: '{tmp_path}/b.parquet' and '{tmp_path}/a.parquet' have "
                                     "different schemas (column 'id': string vs int64)")
    pq.write_table(_table(range(3)).drop_columns(["text"]), tmp_path / "b.parquet")
    assert _data_error(tmp_path).endswith("(columns id, tokens vs id, text, tokens)")


def test_unreadable_and_mixed_sources(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert _data_error(tmp_path / "junk.parquet").startswith(f"data.source: cannot read '{tmp_path / 'junk.parquet'}' (")
    (tmp_path / "mixed").mkdir()
    pq.write_table(_table(range(3)), tmp_path / "mixed" / "a.parquet")
    _write_ipc(tmp_path / "mixed" / "b.arrow", _table(range(3)), 2)
    assert "mixes Arrow IPC and Parquet files (b.arrow, a.parquet)" in _data_error(tmp_path / "mixed")


# ---- BlockShuffledOrder

def _block_of(sizes):
    first = list(itertools.accumulate(sizes, initial=0))
    return lambda sample: bisect.bisect_right(first, sample) - 1


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=12).filter(sum),
       seed=st.integers(0, 2**40), epoch=st.integers(0, 3))
def test_each_epoch_is_a_permutation_visiting_each_block_in_one_run(sizes, seed, epoch):
    order = BlockShuffledOrder(sizes, seed)
    n = order.num_samples
    positions = range(epoch * n, (epoch + 1) * n)
    samples = order.samples(positions)
    assert sorted(samples) == list(range(n))
    # Consecutive positions stay in a block until all its rows are done: one run per non-empty block.
    runs = [(block, len(list(run))) for block, run in itertools.groupby(map(_block_of(sizes), samples))]
    assert sorted(runs) == [(b, size) for b, size in enumerate(sizes) if size]
    # So a contiguous share no longer than the smallest block touches at most two blocks.
    share = min(s for s in sizes if s)
    assert all(len({_block_of(sizes)(x) for x in samples[i:i + share]}) <= 2 for i in range(n))
    # Pure: a new instance, and any query order, give the same sample for each position.
    assert BlockShuffledOrder(sizes, seed).samples(reversed(positions)) == samples[::-1]


def test_epochs_and_seeds_give_different_orders_and_positions_wrap_into_epochs():
    order = BlockShuffledOrder([50, 50, 50, 50], seed=7)
    first, second = order.samples(range(200)), order.samples(range(200, 400))
    assert first != second and sorted(second) == list(range(200))
    assert BlockShuffledOrder([50] * 4, seed=8).samples(range(200)) != first
    assert order.samples([5, 205, 5]) == [first[5], second[5], first[5]]


def test_the_order_is_the_same_in_another_process():
    code = ("from elastic_zero.data.order import BlockShuffledOrder as O; "
            "print(O([7, 0, 5, 9, 3], 123).samples(range(0, 72, 5)))")
    env = dict(os.environ, PYTHONHASHSEED="987")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(BlockShuffledOrder([7, 0, 5, 9, 3], 123).samples(range(0, 72, 5)))
