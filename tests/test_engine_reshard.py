"""Oracle: the same job at another world size. Train at N ranks, repartition the shards over M
ranks (and another ZeRO stage), go on: the weights match one uninterrupted process."""

import pytest

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.zero import ShardState, reshard
from engine_cases import difference, make_engine, oracle, run_steps

FIRST, TOTAL = 3, 6


def _first_part(ctx, case, stage):
    engine = make_engine(ctx.process_group, ctx.rank, case, stage)
    run_steps(engine, ctx.rank, ctx.world_size, case, 0, FIRST)
    return engine.shard_state()


def _second_part(ctx, shards, case, stage):
    engine = make_engine(ctx.process_group, ctx.rank, case, stage, seed=99)  # other weights: all must come in
    engine.load_shard_state(shards[ctx.rank])
    run_steps(engine, ctx.rank, ctx.world_size, case, FIRST, TOTAL)
    return engine.full_state_dict()


@pytest.mark.parametrize("case", ["sgd", "adamw"])
def test_three_ranks_stage_2_continue_on_two_ranks_stage_3_then_one_rank(case):
    want = oracle(case, TOTAL)
    shards = run_local_group(_first_part, 3, (case, 2), timeout_s=120)
    moved = reshard(shards, 2)
    assert [s.partition.world_size for s in moved] == [2, 2] and moved[0].scalars["step"] == FIRST
    got = run_local_group(_second_part, 2, (moved, case, 3), timeout_s=120)[0]
    assert difference(case, want, got) <= 1e-5
    # and 3 -> 1 in this process, at stage 1
    engine = make_engine(None, 0, case, 1, seed=99)
    engine.load_shard_state(reshard(shards, 1)[0])
    run_steps(engine, 0, 1, case, FIRST, TOTAL)
    assert difference(case, want, engine.full_state_dict()) <= 1e-5


def test_reshard_needs_every_rank():
    engine = make_engine(None, 0, "sgd", 2)
    shard = engine.shard_state()
    with pytest.raises(ValueError, match="one shard per rank 0..0, got ranks \\[0, 0\\]"):
        reshard([shard, shard], 2)
    with pytest.raises(ValueError, match="got none"):
        reshard([], 2)
    odd = ShardState(shard.layout, shard.partition, 0, dict(shard.vectors), {"step": 5})
    assert reshard([odd], 3)[2].scalars == {"step": 5}
