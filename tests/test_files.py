"""Files several processes update at once: no lost update under the lock, no torn file."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from ssu.measure.files import lock_path, locked, write_atomically


def _increment(path: str, times: int) -> None:
    for _ in range(times):
        with locked(path):
            with open(path) as f:
                value = json.load(f)["count"]
            write_atomically(path, json.dumps({"count": value + 1, "pad": "x" * 4096}))


def test_concurrent_writers_lose_no_update(tmp_path):
    path = tmp_path / "counter.json"
    write_atomically(path, json.dumps({"count": 0}))
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_increment, args=(str(path), 40)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    assert json.loads(path.read_text())["count"] == 4 * 40
    assert lock_path(path).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_a_held_lock_times_out_with_the_file_named(tmp_path):
    path = tmp_path / "cache.json"
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(TimeoutError, match="cache.json.lock is still held"):
            with locked(path, timeout=0.2):
                pass
    finally:
        release.set()
        holder.join(60)
    with locked(path, timeout=5):  # released with its holder
        pass


def _hold(path, ready, release) -> None:
    with locked(path):
        ready.set()
        release.wait(60)


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "cache.json"
    write_atomically(path, "old")

    with pytest.raises(TypeError):
        write_atomically(path, 17)  # not text: fails while writing
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["cache.json"]
