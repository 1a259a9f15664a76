"""Pipeline schedules as data, checked without processes for p in 1..8, m in 1..16, v in 1..3."""

import pytest

from shardlib.errors import ShardingError
from shardlib.parallel.actions import rank_stages, stage_rank
from shardlib.parallel.schedule_theory import bubble_ratio, bubble_time, dualpipe_bound, peak_stash
from shardlib.parallel.schedules import (
    Action,
    bubble_fraction,
    build_schedule,
    dualpipev,
    format_grid,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    placement,
    simulate,
    zb_h1,
    zbv,
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
            assert stage_rank(a.stage, p) == r
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


def test_interleaved_1f1b_defaults_to_two_chunks_and_refuses_one():
    """schedule='interleaved_1f1b' without virtual_stages ran plain 1F1B (one chunk per rank),
    silently (new-user pass): it now takes its own default of 2, and 1 is refused naming 1F1B."""
    assert build_schedule("interleaved_1f1b", 2, 4) == interleaved_1f1b(2, 4, 2) != one_f_one_b(2, 4)
    with pytest.raises(ShardingError, match=r"interleaved_1f1b with virtual_stages=1 is the plain 1F1B schedule.*"
                                            r"Fix: virtual_stages=2 \(the default\), or schedule='1f1b'"):
        build_schedule("interleaved_1f1b", 2, 4, 1)


def test_grid_prints_step_by_rank():
    text = format_grid(simulate(one_f_one_b(3, 4)))
    lines = text.splitlines()
    assert lines[0].split() == ["step", "rank0", "rank1", "rank2"]
    assert lines[1].split() == ["0", "0F0", ".", "."]
    assert "2B3" in text


# -- zero-bubble schedules (split backward: I then W) ---------------------------------------------
ZB_CASES = [(name, p, m, v) for p in range(1, 9) for m in range(1, 17)
            for name, v in [("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)] if not (name == "dualpipev" and m < 2 * p)]
# (forward, input-gradient, weight) clock units of one chunk: the papers' equal costs, and unequal ones
COSTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2)]


@pytest.mark.parametrize("name,p,m,v", ZB_CASES)
def test_zero_bubble_schedule_is_valid_and_matches_its_paper(name, p, m, v):
    """Every F once and every backward split into I then W (DualPipeV: some full B), each on the
    rank its placement gives (a V for zbv and dualpipev), in dependency order on its rank; no
    deadlock; the idle time per rank and the peak stash equal each paper's closed form (see
    schedule_theory), ZB-H1 also under unequal costs; DualPipeV within the DualPipe table's bound."""
    sched = build_schedule(name, p, m, v)
    where = placement(name)
    assert where == ("v" if v == 2 else "loop")
    for r, acts in enumerate(sched):
        assert {a.stage for a in acts} == set(rank_stages(r, p, v, where))
        seen = set()
        for a in acts:
            assert stage_rank(a.stage, p, where) == r
            if a.kind in "BI":
                assert Action(a.stage, "F", a.microbatch) in seen, f"rank {r}: {a} before its forward"
            if a.kind == "W":
                assert Action(a.stage, "I", a.microbatch) in seen, f"rank {r}: {a} before its input gradient"
            seen.add(a)
    if name != "dualpipev":
        assert not any(a.kind == "B" for acts in sched for a in acts)
    for f, b, w in COSTS if name == "zb_h1" else COSTS[:1]:
        sim = simulate(sched, backward_cost=b + w, weight_cost=w)
        assert sim.idle() == [bubble_time(name, p, m, f, b, w)] * p
    sim = simulate(sched)  # the default clock of a split schedule: F, I and W one unit each
    assert sim.idle() == [bubble_time(name, p, m)] * p
    assert sim.peak_stash == (peak_stash(name, p, m, v) or sim.peak_stash)
    assert max(sim.peak_stash) <= (2 * p + 1 if name == "dualpipev" else v * min(p, m) if name == "zb_h1" else 2 * p)
    if name == "dualpipev":
        for f, b, w in COSTS:
            assert max(simulate(sched, b + w, w).idle()) <= dualpipe_bound(p, f, b, w)


def test_zero_bubble_ratios_against_1f1b_at_p4_m8():
    """At T_F = T_B = T_W: ZB-H1 idles a third of 1F1B's time, ZB-V and DualPipeV a sixth
    (the V's floor: the last rank's first chunk waits p - 1 chunk forwards), on the simulated
    clock as in the formulas; the same model in two half-size chunks for the V schedules."""
    one = 2 * simulate(one_f_one_b(4, 8), backward_cost=2).idle()[0]  # in chunk units: a rank's F is two chunks'
    assert one == 18
    assert 2 * simulate(zb_h1(4, 8)).idle()[0] / one == pytest.approx(1 / 3)
    assert bubble_ratio("zb_h1", 4, 8) == pytest.approx(1 / 3)
    for build in (zbv, dualpipev):
        assert simulate(build(4, 8)).idle()[0] / one == pytest.approx(1 / 6)
    assert bubble_ratio("zbv", 4, 8) == bubble_ratio("dualpipev", 4, 8) == pytest.approx(1 / 6)


def test_zero_bubble_refusals_name_the_fix():
    with pytest.raises(ShardingError, match="zb_h1 runs one model chunk per rank.*schedule='zbv'"):
        zb_h1(2, 4, 2)
    for build in (zbv, dualpipev):
        with pytest.raises(ShardingError, match="exactly two model chunks per rank.*virtual_stages=2"):
            build(2, 4, 3)
    with pytest.raises(ShardingError, match="at least as many microbatches as stages: 3 microbatches for 4 stages"):
        dualpipev(2, 3)
    with pytest.raises(ShardingError, match="microbatches must be a positive int, got True"):
        zb_h1(2, True)
    with pytest.raises(ShardingError, match=r"unknown pipeline schedule 'zb'.*'dualpipev'.*'zb_h1', 'zbv'"):
        build_schedule("zb", 2, 2)


def test_simulate_refuses_incomplete_split_schedules():
    sched = zb_h1(2, 2)
    with pytest.raises(ShardingError, match="stage 1 microbatch 0 needs one F and either one B or one I and one W"):
        simulate([sched[0], [a for a in sched[1] if a != Action(1, "W", 0)]])
    with pytest.raises(ShardingError, match="stage 1 microbatch 0 needs"):
        simulate([sched[0], sched[1] + [Action(1, "B", 0)]])
    moved = [sched[0] + [Action(1, "W", 0)], [a for a in sched[1] if a != Action(1, "W", 0)]]
    with pytest.raises(ShardingError, match="stage 1 has actions on ranks 0 and 1"):
        simulate(moved)
    w_first = [sched[0], [Action(1, "W", 0)] + [a for a in sched[1] if a != Action(1, "W", 0)]]
    with pytest.raises(ShardingError, match="deadlocks: .*rank 1 waits at 1W0"):
        simulate(w_first)
    with pytest.raises(ShardingError, match="whole number of units >= 1"):
        simulate(sched, backward_cost=2, weight_cost=2)


def test_grid_shows_input_and_weight_gradients():
    text = format_grid(simulate(zb_h1(2, 2)))
    assert text.splitlines()[1].split() == ["0", "0F0", "."]
    assert "1I0" in text and "0W1" in text
