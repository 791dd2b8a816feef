"""The network-namespace rig the peer tests stand on (``tests/support/netns.py``): each
link runs at the rate it is shaped to, both ways, and nothing of a rig outlives it, even
when the test using it fails."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.netns import Rig, RigUnavailable, Shape, leftovers, rig_or_skip


def test_each_link_runs_at_its_shaped_rate_both_ways() -> None:
    with rig_or_skip() as rig:
        a = rig.add_host("a", Shape(400))
        b = rig.add_host("b", Shape(400))
        store = rig.add_host("store", Shape(100))
        # Two unshaped hosts: what the machine can carry at the moment.
        free = [rig.add_host("free-a", Shape()), rig.add_host("free-b", Shape())]
        # Measured, never assumed. Every reading within the shaped rate. And near it: a
        # stall of a loaded machine only lowers a reading, so the best of up to three
        # counts, against what an unshaped link carries then if the machine cannot reach
        # the rate at all (that is the machine, not the shaping).
        for sender, receiver, rate in ((a, b, 400), (b, a, 400), (a, store, 100), (store, a, 100)):
            readings: list[float] = []
            while len(readings) < 3 and max(readings, default=0.0) <= 0.6 * rate:
                readings.append(rig.measure(sender, receiver, mib=12))
                assert readings[-1] <= 1.05 * rate, (sender.name, receiver.name, readings)
            if max(readings) <= 0.6 * rate:
                carried = rig.measure(*free, mib=12)
                assert max(readings) > 0.6 * min(rate, carried), (
                    sender.name, receiver.name, readings, carried,
                )  # fmt: skip


def test_a_rig_is_gone_after_its_test_even_when_the_test_fails() -> None:
    try:
        rig = Rig.make()
    except RigUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    with pytest.raises(RuntimeError, match="the test failed"), rig:
        rig.add_host("a", Shape(100))
        assert leftovers(rig)
        raise RuntimeError("the test failed")
    assert leftovers(rig) == []


def test_a_host_whose_link_is_down_is_unreachable() -> None:
    with rig_or_skip() as rig:
        a = rig.add_host("a", Shape(100))
        b = rig.add_host("b", Shape(100))
        assert rig.measure(a, b, mib=1) > 0
        rig.link(b, up=False)
        with pytest.raises(subprocess.CalledProcessError):
            rig.measure(a, b, mib=1)
        rig.link(b, up=True)
        assert rig.measure(a, b, mib=1) > 0
