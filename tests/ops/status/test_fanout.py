"""fan_out: parallel, never fail-fast, bounded by one deadline."""
import threading
import time

from dflash_ops.errors import HostUnreachable, RemoteFailed
from dflash_ops.fanout import fan_out


def test_outcomes_in_order_with_errors_kept():
    def fn(k):
        if k == "b":
            raise RemoteFailed("b broke")
        return k.upper()

    out = fan_out(["a", "b", "c"], fn, deadline_s=5)
    assert [o.value for o in out] == ["A", None, "C"] and isinstance(out[1].error, RemoteFailed)
    assert [o.ok for o in out] == [True, False, True]


def test_runs_in_parallel_and_a_stuck_item_costs_one_deadline():
    release = threading.Event()
    started = []

    def fn(k):
        started.append(k)
        if k == "stuck":
            release.wait(30)
        return k

    t0 = time.monotonic()
    out = fan_out(["x", "stuck", "y"], fn, deadline_s=0.5, describe=lambda k: f"host {k}")
    took = time.monotonic() - t0
    release.set()
    assert [o.value for o in out] == ["x", None, "y"]
    assert isinstance(out[1].error, HostUnreachable) and "host stuck: no answer within 0.5 s" in str(out[1].error)
    assert 0.5 <= took < 5 and sorted(started) == ["stuck", "x", "y"]


def test_bugs_are_collected_not_swallowed():
    out = fan_out([1], lambda k: 1 / 0, deadline_s=5)
    assert isinstance(out[0].error, ZeroDivisionError)
