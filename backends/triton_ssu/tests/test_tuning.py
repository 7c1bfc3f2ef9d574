"""The triton backend's tuning of a batch bucket (``ssu_backend_triton.tuning.tune_bucket``) with its
timer replaced: which schedule it keeps, and over how many slot sets it times them."""

from __future__ import annotations

import ssu
from ssu.measure import timing
from ssu_backend_triton import tuning
from ssu_backend_triton.tuning import Schedule


def test_the_best_median_of_the_finalists_is_kept(monkeypatch):
    """A schedule that timed fastest once, by luck, loses to the one fastest in the rounds that
    time the three fastest again; every timing rotates over enough slot sets to span COLD_BYTES."""
    lucky, steady, slow, last = Schedule(4, 1), Schedule(2, 1), Schedule(1, 1), Schedule(8, 1)
    samples = {lucky: [1.0, 5.0, 5.0, 5.0], steady: [2.0, 2.1, 1.9, 2.0], slow: [3.0, 3.0, 3.0, 3.0], last: [9.0]}
    rotations = []

    def timer(launches, **kwargs):
        config = launches[0]()
        rotations.append(len(launches))
        return samples[config].pop(0)

    monkeypatch.setattr(timing, "graph_time_us", timer)
    p = ssu.Problem(nheads=2, headdim=4, dstate=8, ngroups=1, max_batch=1, device="cpu")
    best = tuning.tune_bucket(
        p, 1, lambda config, *rest, **kw: config, [lucky, steady, slow, last], 3, print, try_branchless=False
    )
    assert best == (steady, 2.0)
    assert all(not left for config, left in samples.items() if config != last)  # three rounds of three
    slot_bytes = p.state_bytes_per_slot()
    assert set(rotations) == {min(tuning.MAX_SETS, tuning.COLD_BYTES // slot_bytes)} == {tuning.MAX_SETS}


def test_one_config_is_not_timed_again(monkeypatch):
    """A bucket with a single candidate keeps it with its first time."""
    only = Schedule(4, 1)
    monkeypatch.setattr(timing, "graph_time_us", lambda launches, **kwargs: 7.0)
    p = ssu.Problem(nheads=2, headdim=4, dstate=8, ngroups=1, max_batch=1, device="cpu")
    assert tuning.tune_bucket(p, 1, lambda *a, **k: None, [only], 3, print, try_branchless=False) == (only, 7.0)
