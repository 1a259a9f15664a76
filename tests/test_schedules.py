"""Pipeline schedules as data, checked without processes for p in 1..8, m in 1..16, v in 1..3."""

import pytest

from shardlib.errors import ShardingError
from shardlib.parallel.schedules import (
    Action,
    bubble_fraction,
    build_schedule,
    format_grid,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)

CASES = [(name, p, m, v) for p in range(1, 9) for m in range(1, 17)
         for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)]
         if not (name == "interleaved_1f1b" and m % p)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_is_valid_and_bubble_equals_theory(name, p, m, v):
    """Every action once, forwards before backwards, dependencies met, no deadlock; the idle
    fraction on a clock with equal forward/backward cost is (p-1)/(vm+p-1)."""
    sched = build_schedule(name, p, m, v)
    for r, acts in enumerate(sched):
        seen = set()
        for a in acts:
            assert a.stage % p == r
            if a.kind == "B":
                assert Action(a.stage, "F", a.microbatch) in seen, f"rank {r}: {a} before its forward"
            seen.add(a)
    sim = simulate(sched)
    for b in sim.bubble():
        assert b == pytest.approx(bubble_fraction(p, m, v), abs=1e-12)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_peak_stash_equals_theory(p, m):
    assert simulate(gpipe(p, m)).peak_stash == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_stash == [min(p - r, m) for r in range(p)]


def test_backward_twice_as_expensive_keeps_schedules_valid():
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]:
        sim = simulate(build_schedule(name, 4, 8, v), backward_cost=2)
        assert sim.makespan >= 3 * 8 * v


def test_deadlock_and_bad_schedules_are_reported():
    bad = one_f_one_b(2, 2)
    bad[1] = list(reversed(bad[1]))
    with pytest.raises(ShardingError, match="deadlock|before"):
        simulate(bad)
    missing = one_f_one_b(2, 2)
    missing[0] = missing[0][:-1]
    with pytest.raises(ShardingError, match="permutation"):
        simulate(missing)
    with pytest.raises(ShardingError, match="multiple of the pipeline size"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ShardingError, match="unknown pipeline schedule"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ShardingError, match="one model chunk"):
        gpipe(2, 2, 2)


def test_grid_prints_step_by_rank():
    text = format_grid(simulate(one_f_one_b(3, 4)))
    lines = text.splitlines()
    assert lines[0].split() == ["step", "rank0", "rank1", "rank2"]
    assert lines[1].split() == ["0", "0F0", ".", "."]
    assert "2B3" in text
