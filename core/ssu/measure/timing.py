"""GPU timing the way the project reports numbers: CUDA-graph replays, CUDA events, the median.

Each launch in a captured graph may use a different input set (rotate them to defeat the L2);
the graph is replayed several times and the median per-launch time is returned. A callable that
cannot be captured (a backend that does not declare ``cuda_graphs``) is timed launched eagerly
between CUDA events instead (:func:`event_time_us`), which adds the host's launch time.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence


def graph_time_us(
    launches: Sequence[Callable[[], object]], *, replays: int = 7, warmup: int = 2, min_launches: int = 1
) -> float:
    """Median microseconds per launch of ``launches`` captured once into a CUDA graph.

    Every callable is run ``warmup`` times eagerly first (compiles, allocator warm-up), then the
    list, cycled to at least ``min_launches`` entries, is captured in order into one graph that is
    replayed ``replays`` times.
    """
    import torch

    launches = list(launches)
    launches = (launches * -(-min_launches // len(launches)))[: max(min_launches, len(launches))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for fn in launches:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / len(launches))
    del graph
    return statistics.median(samples)


def event_time_us(
    launches: Sequence[Callable[[], object]], *, repeats: int = 7, warmup: int = 2, min_launches: int = 1
) -> float:
    """Median microseconds per launch of ``launches`` run eagerly between two CUDA events (the
    list cycled to at least ``min_launches`` entries, ``repeats`` times): for callables that a
    CUDA graph cannot capture. Includes each launch's host time, so it is an upper bound of what
    the same kernels take inside a graph."""
    import torch

    launches = list(launches)
    launches = (launches * -(-min_launches // len(launches)))[: max(min_launches, len(launches))]
    for _ in range(warmup):
        for fn in launches:
            fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in launches:
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / len(launches))
    return statistics.median(samples)


def host_times_us(calls: dict, *, count: int = 200, repeats: int = 7, warmup: int = 10, cuda: bool = False) -> dict:
    """Median host microseconds per call of each callable of ``calls`` (name -> callable), each
    called ``count`` times in a row as an eager decode step calls it, the device synchronised
    before and after each run (so a run also waits for the last kernel), the callables' runs
    interleaved ``repeats`` times so that they share the host's drift. What a launch costs on the
    host, where the kernel itself is shorter: the share of an eager decode at small batch."""
    import time

    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    samples: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(count):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / count * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}
