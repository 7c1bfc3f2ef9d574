"""The traffic floor: the write-every-step account, the checkpoint-and-ring account against a
simulation of the flush rules, the ``ssu_traffic`` hook through ``Kernel.traffic``, and the
columns ``ssu bench`` prints from it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ssu
from ssu.bench import measure, report
from ssu.contract.dtypes import ITEMSIZE

from fakes import small_problem


def test_write_through_counts_one_read_and_a_write_per_token():
    p = small_problem(state_dtype="bf16", input_dtype="fp16", tokens_per_step=3, speculative=True)
    slot = 4 * 8 * 16 * 2
    parts = ssu.measure.traffic.write_through(p, 5)
    assert parts["state read"] == 5 * slot and parts["state write"] == 5 * 3 * slot
    # x, z, out (H x P) and dt (H) and B, C (G x N), per token, in the input dtype
    assert parts["inputs and outputs"] == 5 * 3 * (3 * 4 * 8 + 4 + 2 * 2 * 16) * 2
    assert ssu.measure.traffic.io_bytes(p, 5, with_z=False) == 5 * 3 * (2 * 4 * 8 + 4 + 2 * 2 * 16) * 2
    assert ssu.measure.traffic.total(parts) == sum(parts.values())


def simulate(window: int, tokens: int, accepted: int, folds_new: bool, steps: int = 2000) -> tuple:
    """Per-step means of (checkpoint writes, ring tokens read, ring tokens appended) of one slot
    under the flush rules of docs/spec.md, "ReplaySSM"."""
    k = writes = held = appended = 0
    for _ in range(steps):
        held += k
        if folds_new:  # one-token steps: a flush folds the new token too
            if k + 1 > window:
                writes, k = writes + 1, 0
            else:
                appended, k = appended + 1, k + 1
        else:  # the new tokens stay in the ring; the commit keeps ``accepted`` of them
            if k > 0 and k + tokens > window:
                writes, k = writes + 1, 0
            appended += tokens
            k += accepted
    return writes / steps, held / steps, appended / steps


@given(window=st.integers(0, 16), tokens=st.integers(1, 6), accepted=st.integers(1, 6))
def test_checkpoint_and_ring_matches_the_flush_rules(window, tokens, accepted):
    accepted = min(accepted, tokens)
    folds_new = tokens == 1 and accepted == 1 and window % 2 == 0  # both rules at T = 1
    if not folds_new:
        window = max(window, tokens)  # a ring holds a whole step
    p = small_problem(tokens_per_step=tokens, speculative=tokens > 1)
    parts = ssu.measure.traffic.checkpoint_and_ring(
        p, 3, window=window, accepted=accepted, token_bytes=10, folds_new=folds_new
    )
    writes, held, appended = simulate(window, tokens, accepted, folds_new)
    slot = p.state_bytes_per_slot()
    assert parts["checkpoint read"] == 3 * slot
    assert parts["checkpoint write"] == pytest.approx(3 * slot * writes, rel=0.02, abs=1)
    assert parts["ring read"] == pytest.approx(3 * 10 * held, rel=0.02, abs=1)
    assert parts["ring write"] == pytest.approx(3 * 10 * appended, rel=0.02, abs=1)


def test_kernel_traffic_uses_the_hook_or_the_default():
    p = small_problem()
    kernel = ssu.open(ssu.Config(backend="reference"), p)
    parts = kernel.traffic(2)
    assert parts == ssu.measure.traffic.write_through(p, 2)
    with pytest.raises(ssu.InputError, match="outside 1..max_batch=4"):
        kernel.traffic(5)

    class Ring:
        @ssu.hookimpl
        def ssu_traffic(self, ctx, batch, accepted):
            return {"checkpoint read": batch * 100.0, "kept": accepted}

    kernel._hook = _with(kernel, Ring())
    assert kernel.traffic(2, accepted=1.5) == {
        "checkpoint read": 200.0,
        "kept": 1.5,
        "inputs and outputs": ssu.measure.traffic.io_bytes(p, 2),
    }

    class Broken:
        @ssu.hookimpl
        def ssu_traffic(self, ctx, batch, accepted):
            return 12

    kernel._hook = _with(kernel, Broken())
    with pytest.raises(ssu.BackendError, match="hook ssu_traffic returned 12"):
        kernel.traffic(1)

    class Raising:
        @ssu.hookimpl
        def ssu_traffic(self, ctx, batch, accepted):
            raise KeyError("window")

    kernel._hook = _with(kernel, Raising())
    with pytest.raises(ssu.BackendError, match="hook ssu_traffic raised KeyError"):
        kernel.traffic(1)


def _with(kernel, plugin):
    """The kernel's hooks with ``plugin``'s ssu_traffic in front (a backend that implements it)."""
    import pluggy

    from ssu.contract import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    return pm.hook


def test_the_table_prints_the_floor_and_the_fraction_reached():
    case = measure.Case("ring", 128, 64, 128, 8, "fp32", "bf16", 1, 128)
    traffic = (("checkpoint read", 426e6), ("inputs and outputs", 0.0))
    rows = [
        measure.Row(case, 125.0, traffic=traffic),
        measure.Row(measure.Case("plain", 128, 64, 128, 8, batch=128), 300.0),
    ]
    lines = report.table(rows, 4.26, {}).splitlines()
    assert "floor us" in lines[0] and "of floor" in lines[0]
    assert "100.0" in lines[1] and "80%" in lines[1]  # 426 MB at 4.26 TB/s: 100 us of 125
    assert lines[2].split()[-3:-1] == ["-", "-"]  # no traffic recorded: no floor
    assert rows[0].to_dict()["traffic"] == {"checkpoint read": 426000000, "inputs and outputs": 0}
    assert report.table(rows, None, {}).splitlines()[1].split()[-3:-1] == ["-", "-"]
    assert measure.mean_accepted(1) == 1 and measure.mean_accepted(4) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert ITEMSIZE["fp32"] == 4


def test_a_broken_traffic_account_costs_the_floor_not_the_row(monkeypatch):
    def broken(self, batch, accepted=None, with_z=True):
        raise ssu.BackendError("backend 'reference': hook ssu_traffic returned 12, not a dict of byte counts")

    monkeypatch.setattr(ssu.Kernel, "traffic", broken)
    case = measure.Case("reference", 4, 8, 16, 2, batch=2)
    with pytest.warns(ssu.SSUWarning, match="its rows show no traffic floor"):
        row = measure.measure(case, ssu.Config(), device="cpu", timer=lambda launches, min_launches=1: 5.0)
    assert row.us == 5.0 and row.traffic == () and row.floor_us(4.26) is None
