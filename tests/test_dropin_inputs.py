"""The drop-in ``ssu.selective_state_update`` on a caller's bad input: an argument that is no
tensor and slot ids that do not match x are refused naming them; rows whose ids name no slot of
the cache are served as pad rows, as the spec guards them, and said once per cache tensor."""

from __future__ import annotations

import warnings

import pytest
import torch

import ssu
from ssu.checking import oracle

H, P, N, G = 4, 8, 16, 2


@pytest.fixture(autouse=True)
def fresh_dropin():
    ssu.dropin.clear()
    yield
    ssu.dropin.clear()


def call(b, gen):
    """A one-token drop-in call of ``b`` rows, per-head parameters."""
    return dict(
        x=torch.randn(b, H, P, generator=gen),
        dt=torch.randn(b, H, generator=gen),
        A=-torch.rand(H, generator=gen) - 1,
        B=torch.randn(b, G, N, generator=gen),
        C=torch.randn(b, G, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_softplus=True,
    )


def ids(*values):
    return torch.tensor(values, dtype=torch.int32)


def served(cache, **kwargs) -> tuple:
    """The call's output and the ssu warnings it gave (every one, not Python's once per line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ssu.selective_state_update(cache, **kwargs)
    return out, [str(w.message) for w in caught if issubclass(w.category, ssu.SSUWarning)]


def pad_row_output(args, row):
    """What a pad row outputs: y from a zero state."""
    start = torch.zeros(1, H, P, N, dtype=torch.float64)
    one = {k: v[row : row + 1] for k, v in args.items() if k in ("x", "dt", "B", "C")}
    _, out = oracle.ssu_math64(
        start,
        one["x"][:, None],
        one["dt"][:, None],
        args["A"],
        one["B"][:, None],
        one["C"][:, None],
        D=args["D"],
        dt_softplus=True,
    )
    return out[0, 0]


@pytest.mark.parametrize("first", [True, False], ids=["first call", "kernel open"])
@pytest.mark.parametrize(
    "bad, message",
    [
        (
            dict(x=None),
            r"^x: expected a torch.Tensor \(batch, H, P\), or \(batch, T, H, P\) for SGLang's verify call, "
            r"got NoneType$",
        ),
        (dict(state_batch_indices=[0, 1]), r"^state_batch_indices: expected a torch.Tensor, got list$"),
        (dict(dst_state_batch_indices=(2, 3)), r"^dst_state_batch_indices: expected a torch.Tensor, got tuple$"),
    ],
    ids=["x", "slots", "destinations"],
)
def test_an_argument_that_is_no_tensor_is_named(first, bad, message, gen):
    cache = torch.randn(4, H, P, N, generator=gen)
    if not first:
        ssu.selective_state_update(cache, **call(2, gen))
    before = cache.clone()
    with pytest.raises(ssu.InputError, match=message):
        ssu.selective_state_update(cache, **dict(call(2, gen), **bad))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "slots, message",
    [
        (ids(0, 1, 2), r"^slots \(state_batch_indices\): 3 slot ids for the 2 rows of x; give one slot id per row"),
        (ids(3), r"^slots \(state_batch_indices\): 1 slot id for the 2 rows of x; give one slot id per row"),
    ],
    ids=["more", "fewer"],
)
def test_slot_ids_that_do_not_match_x_name_the_mismatch(slots, message, gen):
    cache = torch.randn(4, H, P, N, generator=gen)
    before = cache.clone()
    with pytest.raises(ssu.InputError, match=message):
        ssu.selective_state_update(cache, **call(2, gen), state_batch_indices=slots)
    assert torch.equal(cache, before)
    kernel = ssu.open(ssu.Config(), ssu.Problem(nheads=H, headdim=P, dstate=N, ngroups=G, input_dtype="fp32"))
    args = {k: v for k, v in call(2, gen).items() if k != "dt_softplus"}
    with pytest.raises(ssu.InputError, match=r"^slots \(state_batch_indices\): 3 slot ids for the 2 rows of x"):
        kernel.step(kernel.allocate_state(), slots=ids(0, 1, 2), **args)


def test_ids_outside_the_cache_are_served_as_pad_rows_and_said_once_per_cache(gen):
    cache = torch.randn(4, H, P, N, generator=gen)
    before = cache.clone()
    args = call(3, gen)
    out, said = served(cache, **args, state_batch_indices=ids(1, 7, -5))
    assert len(said) == 1, said
    assert said[0].startswith(
        "ssu.selective_state_update served 2 rows of a call's 3 as pad rows (a zero state read, no state written, "
        "the output written): their ids name no slot of the cache (slots 0..3) nor the pad id -1, the first: "
        "state_batch_indices[1] = 7; said once per cache. Fix the caller's slot ids; "
        "ssu.dropin.kernel_for(cache).check() raises naming the first such row"
    )
    for row in (1, 2):
        assert oracle.rel_error(out[row], pad_row_output(args, row)) < 1e-5
    assert torch.equal(cache[[0, 2, 3]], before[[0, 2, 3]]) and not torch.equal(cache[1], before[1])
    assert served(cache, **call(3, gen), state_batch_indices=ids(9, 1, 2))[1] == []  # once per cache tensor
    with pytest.raises(ssu.InputError, match=r"slots\[0\] = 9: neither a slot of this cache"):
        ssu.dropin.kernel_for(cache).check()  # the record keeps the first row of every call since
    other = torch.randn(4, H, P, N, generator=gen)
    assert served(other, **call(3, gen), state_batch_indices=ids(0, 1, 2))[1] == []  # its ids are fine
    said = served(other, **call(3, gen), state_batch_indices=ids(0, 1, 2), dst_state_batch_indices=ids(3, 4, 2))[1]
    assert len(said) == 1 and "served 1 row of a call's 3" in said[0]
    assert "the first: dst_state_batch_indices[1] = 4" in said[0]


def test_a_batch_larger_than_the_cache_without_ids_is_served_and_said_once(gen):
    cache = torch.randn(4, H, P, N, generator=gen)
    args = call(6, gen)
    out, said = served(cache, **args)
    assert said == [
        "ssu.selective_state_update served 2 rows of a call's 6 as pad rows (a zero state read, no state written, "
        "the output written): without state_batch_indices row b uses slot b, and the cache has 4 slots, none for "
        "rows 4..5; said once per cache. Pass state_batch_indices, or a cache of 6 slots or more; "
        "ssu.dropin.kernel_for(cache).check() raises naming the first such row since it last checked (it reads the "
        'kernel\'s fault record: on CUDA a synchronisation), and validate = "full" refuses such ids before the step'
    ]
    for row in (4, 5):
        assert oracle.rel_error(out[row], pad_row_output(args, row)) < 1e-5
    assert served(cache, **call(6, gen))[1] == []
    assert served(cache, **call(8, gen))[1] == []  # a larger batch opens another kernel: still once per tensor


def test_valid_ids_say_nothing(gen):
    cache = torch.randn(6, H, P, N, generator=gen)
    for _ in range(2):
        assert served(cache, **call(3, gen), state_batch_indices=ids(5, -1, 0))[1] == []
        assert served(cache, **call(4, gen))[1] == []


def test_a_cuda_cache_reads_its_fault_record_only_at_a_tensors_first_call(gen, monkeypatch):
    """Reading the record off a GPU synchronises: after a tensor's first call the drop-in leaves it
    to ``check()``, so a later call's bad ids are recorded but not said (simulated on the CPU)."""
    from ssu.dropin import cache as dropin

    cache = torch.randn(4, H, P, N, generator=gen)
    served(cache, **call(2, gen), state_batch_indices=ids(0, 1))
    entry = dropin._adopted[(id(cache), id(None))]
    entry.host = False  # as on a CUDA device
    reads = []
    monkeypatch.setattr(dropin, "_warn_ids_outside", lambda *a: reads.append(a))
    assert served(cache, **call(2, gen), state_batch_indices=ids(0, 9))[1] == [] and reads == []
    with pytest.raises(ssu.InputError, match=r"slots\[1\] = 9"):
        ssu.dropin.kernel_for(cache).check()
