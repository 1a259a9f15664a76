"""SHARDLIB_CHECK_STEPS: check mode's comparisons across ranks limited to a task's first optimizer
steps (the trace's ``compare``), its local checks kept on every step."""

from __future__ import annotations

import pytest

from shardlib.mesh.trace import Trace


@pytest.mark.parametrize("steps, expected", [("", [True, True, True]), ("1", [True, False, False]),
                                             ("2", [True, True, False])])
def test_check_mode_compares_during_the_first_check_steps_only(monkeypatch, steps, expected):
    """SHARDLIB_CHECK_STEPS=N: check mode compares across ranks (each collective's fingerprint, a
    pipeline step's signature) until the N-th optimizer step of a task ends; its local checks stay
    on (``check``)."""
    monkeypatch.setenv("SHARDLIB_CHECK_COLLECTIVES", "1")
    monkeypatch.setenv("SHARDLIB_CHECK_STEPS", steps)
    trace = Trace(0, path="")
    seen = []
    for _ in range(3):
        seen.append(trace.compare)
        assert trace.check
        trace.next_step()
    assert seen == expected
    trace.new_task()  # a new task of the pool compares again
    assert trace.compare and trace.step == 0
    monkeypatch.setenv("SHARDLIB_CHECK_COLLECTIVES", "0")
    assert not Trace(0, path="").compare


@pytest.mark.parametrize("steps", ["0", "-1", "two", "1.5"])
def test_check_steps_not_a_positive_integer_is_refused_naming_the_variable(monkeypatch, steps):
    from shardlib.errors import ShardingError

    monkeypatch.setenv("SHARDLIB_CHECK_STEPS", steps)
    with pytest.raises(ShardingError, match=rf"SHARDLIB_CHECK_STEPS='{steps}' is not understood: a positive integer"):
        Trace(0, path="")
