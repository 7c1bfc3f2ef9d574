"""Problem.shard: the per-rank problem of a tensor-parallel layer, and its refusals."""

from __future__ import annotations

import pytest

import ssu

NEMOTRON_H_8B = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8, num_slots=16, max_batch=8, device="cuda")
GRANITE = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=1, num_slots=16, max_batch=8)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_heads_and_groups_split_evenly(tp):
    shards = [NEMOTRON_H_8B.shard(tp, rank, device=f"cuda:{rank}") for rank in range(tp)]
    assert {(s.nheads, s.ngroups, s.heads_per_group) for s in shards} == {(128 // tp, 8 // tp, 16)}
    assert [s.device for s in shards] == [f"cuda:{r}" for r in range(tp)]
    assert all(s.num_slots == 16 and s.headdim == 64 and s.dstate == 128 for s in shards)
    slices = [NEMOTRON_H_8B.shard_slices(tp, r) for r in range(tp)]
    assert [h for heads, _ in slices for h in heads] == list(range(128))
    assert [g for _, groups in slices for g in groups] == list(range(8))
    for heads, groups in slices:  # every head of a rank reads a group of that rank
        assert {h // 16 for h in heads} == set(groups)


def test_a_single_group_is_replicated():
    shard = GRANITE.shard(2, 1)
    assert (shard.nheads, shard.ngroups, shard.device) == (64, 1, "cpu")
    assert GRANITE.shard_slices(2, 1) == (range(64, 128), range(0, 1))


@pytest.mark.parametrize(
    "problem, tp, rank, message",
    [
        (NEMOTRON_H_8B, 3, 0, r"nheads=128 does not split over tp=3 ranks.*tp that fit H=128 G=8: 1, 2, 4, 8"),
        (NEMOTRON_H_8B, 16, 0, r"ngroups=8 does not split over tp=16 ranks \(a single group is replicated"),
        (NEMOTRON_H_8B, 2, 2, r"rank must be 0..1 for tp=2, got 2"),
        (NEMOTRON_H_8B, 0, 0, r"tp must be a positive integer, got 0"),
        (NEMOTRON_H_8B, True, 0, r"tp must be a positive integer"),
    ],
)
def test_refusals_name_the_fix(problem, tp, rank, message):
    with pytest.raises(ssu.ConfigError, match=message):
        problem.shard(tp, rank)
