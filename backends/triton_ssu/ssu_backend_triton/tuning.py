"""Launch parameters per problem and batch bucket: defaults, tuning on scratch, a JSON cache.

Tuning times each candidate :class:`Schedule` with CUDA-graph replays on *scratch* copies of
random states, rotating several slot sets so that the L2 stays cold; live state is never touched.
The winners are stored in a JSON file keyed by GPU name, Triton version, shape, dtypes, tokens and
batch bucket, so that the next process reuses them without timing anything.

Cache file: option ``tuning_cache``, else ``$SSU_TRITON_TUNING_CACHE``, else
``$XDG_CACHE_HOME/ssu/triton-tuning.json`` (``~/.cache/ssu/triton-tuning.json``).
Delete the file to clear it. Several processes may tune at once: each merges its entries under
the file's lock (``triton-tuning.json.lock`` beside it) and replaces the file atomically.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from ssu.contract.dtypes import ITEMSIZE
from ssu.measure.files import locked, write_atomically

from .interpreter import interpreting

ENV_CACHE = "SSU_TRITON_TUNING_CACHE"
#: scratch memory tuning may use per bucket (bytes)
SCRATCH_LIMIT = 4 << 30
#: bytes of state that the rotated slot sets span at least (several times the H200's 60 MB L2)
COLD_BYTES = 256 << 20
#: slot sets a tuning run rotates over at most: enough for a batch of one to span COLD_BYTES (16
#: sets of an fp32 slot at H=128 P=64 N=128 span 64 MB, which an H100's or H200's L2 half holds:
#: warmer than a server's states, and a schedule fastest warm can be slower cold)
MAX_SETS = 64
#: the fastest schedules of the first pass, timed again in interleaved rounds: the best median
#: wins (one noisy sample of a few-microsecond launch no longer decides a small bucket)
FINALISTS, FINAL_ROUNDS = 3, 3


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def buckets(max_batch: int) -> list[int]:
    """Batch buckets 1, 2, 4, ... up to the first power of two >= max_batch."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_batch:
            return out
        b *= 2


class Schedule(NamedTuple):
    """How one step is launched: ``block_p`` rows of a head per tile, ``num_warps`` per program,
    ``tiles`` consecutive tiles per program (1: a program per tile), the pipeline ``stages`` of a
    program's loop over its tiles (0 with one tile), ``maxnreg``, a cap on registers per thread
    (0: the compiler's choice; a cap fits more programs on an SM), ``pdl`` (1: programmatic
    dependent launch, the step's launch overlapping the drain of the kernel before it) and
    ``branchless`` (1: the optional inputs and softplus without branches, so that a token's loads
    issue together; more registers live, see the kernel module)."""

    block_p: int
    num_warps: int
    tiles: int = 1
    stages: int = 0
    maxnreg: int = 0
    pdl: int = 0
    branchless: int = 0


#: programs below which a launch leaves the GPU's SMs idle (an H200 has 132)
MIN_PROGRAMS = 4 * 132


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def default_config(problem, batch: int) -> Schedule:
    """A sound schedule without tuning, the fastest measured on an H200 (docs/benchmarks.md):
    a single-warp program per tile of about 1024 values; for a 2-byte state and one token, two-warp
    programs looping over such tiles with 4 pipeline stages, as many tiles per program as leaves
    enough programs to fill the GPU. Smaller tiles when the batch is too small. On a GPU with
    programmatic dependent launch, which the tuner kept at almost every batch; branch-free input
    loads for a 4-byte state with several tokens, where they won (docs/benchmarks.md)."""
    block_n = next_pow2(problem.dstate)
    block_p = max(1, min(next_pow2(problem.headdim), 1024 // block_n))
    n_tiles = lambda bp: -(-problem.headdim // bp)  # noqa: E731
    while block_p > 2 and batch * problem.nheads * n_tiles(block_p) < MIN_PROGRAMS:
        block_p //= 2
    pdl = int(problem.device_type == "cuda")
    if ITEMSIZE[problem.state_dtype] <= 2 and problem.tokens_per_step == 1 and block_p * block_n >= 1024:
        for tiles in _divisors_descending(n_tiles(block_p))[:-1]:
            if batch * problem.nheads * (n_tiles(block_p) // tiles) >= MIN_PROGRAMS:
                return Schedule(block_p, 2, tiles, 4, pdl=pdl)
    branchless = int(ITEMSIZE[problem.state_dtype] == 4 and problem.tokens_per_step > 1)
    return Schedule(block_p, 1, pdl=pdl, branchless=branchless)


def candidates(problem) -> list[Schedule]:
    """Schedules worth timing for this shape: a program per tile (tiles of 256 to 16384 values,
    1 to 8 warps), those of 32 or more values a thread also with registers capped at 96 and 128;
    with one token, programs of 1 or 2 warps looping over a whole head's tiles (3 or 4 pipeline
    stages) or half of them (4 stages), tiles of 1024 or 2048 values at 16 or 32 values a thread
    (the shapes that won on an H200; others were slower, docs/benchmarks.md); for an 8-bit state
    also tiles of up to 4096 values at 64 a thread."""
    block_n = next_pow2(problem.dstate)
    top = next_pow2(problem.headdim)
    # an 8-bit tile holds a quarter of an fp32 one's bytes: looping programs may also take tiles
    # of 4096 values at 64 a thread, so that a tile's row work (reductions, scales, the output's
    # gate) is shared by more values
    loop_per_thread, loop_values = ((16, 32, 64), 4096) if problem.quantized else ((16, 32), 2048)
    out = []
    for block_p in (1, 2, 4, 8, 16, 32, 64):
        if block_p > top or block_p * block_n > 16384 or block_p * block_n < 256:
            continue
        n_tiles = -(-problem.headdim // block_p)
        for warps in (1, 2, 4, 8):
            per_thread = block_p * block_n // (32 * warps)
            if 8 <= per_thread <= 64 or (block_p * block_n < 2048 and per_thread >= 4):
                out.append(Schedule(block_p, warps))
                if per_thread >= 32:  # left alone the compiler may take more registers than it needs
                    out += [Schedule(block_p, warps, maxnreg=96), Schedule(block_p, warps, maxnreg=128)]
            if (
                problem.tokens_per_step == 1
                and warps <= 2
                and per_thread in loop_per_thread
                and n_tiles > 1
                and 1024 <= block_p * block_n <= loop_values
            ):
                out += [Schedule(block_p, warps, n_tiles, 3), Schedule(block_p, warps, n_tiles, 4)]
                if n_tiles % 2 == 0 and n_tiles > 2:
                    out.append(Schedule(block_p, warps, n_tiles // 2, 4))
    return out or [default_config(problem, 1)]


def cache_path(option: Optional[str]) -> Optional[Path]:
    """Where the tuning cache lives (None: caching disabled by ``tuning_cache = ""``)."""
    if option is not None:
        return Path(option).expanduser() if option else None
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ssu" / "triton-tuning.json"


def cache_key(problem, bucket: int, gpu: str, triton_version: str, stochastic: bool) -> str:
    """The key a tuned tile is stored under: GPU, Triton version, kernel variant, shapes, dtypes, batch bucket."""
    p = problem
    return (
        f"{gpu}|triton {triton_version}|kernel v8|H{p.nheads} P{p.headdim} N{p.dstate} G{p.ngroups}|"
        f"state {p.state_dtype} input {p.input_dtype}|T{p.tokens_per_step}{' spec' if p.speculative else ''}"
        f"{' sr' if stochastic else ''}|batch {bucket}"
    )


def read_cache(path: Optional[Path]) -> dict:
    """The tuning cache as a dict; a missing or unreadable file reads as empty (it is re-tuned, never fatal)."""
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a corrupt cache is re-tuned, never fatal
    return data if isinstance(data, dict) else {}


def cached_schedule(cached: dict, key: str) -> Optional[Schedule]:
    """The schedule stored under ``key``, or None when absent or malformed (then it is re-tuned)."""
    entry = cached.get(key)
    config = entry.get("config") if isinstance(entry, dict) else None
    if (
        isinstance(config, list)
        and len(config) == len(Schedule._fields)
        and all(isinstance(v, int) and v >= 0 for v in config)
    ):
        return Schedule(*config)
    return None


def write_cache(path: Optional[Path], entries: dict) -> None:
    """Merge ``entries`` into the cache file: under the file's lock (so that processes tuning at
    once, the ranks of one job, keep each other's entries) and by atomic replacement (so that a
    reader never sees half a file)."""
    if path is None or not entries:
        return
    with locked(path):
        merged = read_cache(path)
        merged.update(entries)
        write_atomically(path, json.dumps(merged, indent=1, sort_keys=True))


def compile_in_parallel(calls) -> None:
    """Run ``calls``, each a launch made with ``compile_only`` (a kernel compiled, not run), with
    Triton compiling them in a pool of threads (``triton.AsyncCompileMode``): warmup compiles tens
    of kernel variants, most of whose time is spent outside Python. Returns once all are compiled.
    A variant the compiler rejects is left for its real launch to report (tuning skips it). Under
    the interpreter, or a Triton without the mode, nothing is compiled ahead."""
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None or interpreting():
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool, mode(pool, ignore_errors=True):
        for call in calls:
            try:
                call()
            except Exception:  # reported by the real launch
                pass


def tune_bucket(
    problem,
    bucket: int,
    run: Callable,
    configs: list,
    iterations: int,
    log: Callable,
    try_pdl: bool = True,
    try_branchless: bool = True,
) -> tuple:
    """Time every config for one batch bucket on scratch, then the fastest again: on a GPU of
    compute capability 9.0 or newer (with ``try_pdl``) with programmatic dependent launch (it helps
    at most batches), and (with ``try_branchless``) with the other way of loading the optional
    inputs (branch-free wins for an fp32 state with several tokens, loses where its registers
    spill: docs/benchmarks.md); then the :data:`FINALISTS` fastest of all that again, in
    :data:`FINAL_ROUNDS` interleaved rounds. Returns (the config of the best median, that median in
    microseconds), or None when every config failed. Back-to-back launches of the same step are
    timed, over slot sets spanning at least :data:`COLD_BYTES` (up to :data:`MAX_SETS` of them), so
    a launch with PDL overlaps the drain of the step before it and the L2 stays cold.

    ``run(config, scratch_ssm, slots, inputs, out, compile_only=False)`` launches one step on the
    scratch state (with ``compile_only``, compiles its kernel only: every config is compiled at
    once, in parallel, before the timing).
    """
    import torch

    from ssu.contract.dtypes import to_torch
    from ssu.checking.inputs import step_inputs
    from ssu.state.slot_state import versions
    from ssu.measure.timing import graph_time_us

    from ssu.state.slot_kernels import pdl_capable

    p = problem
    K = versions(p)
    slot_bytes = p.state_bytes_per_slot() * K
    sets = max(1, min(MAX_SETS, -(-COLD_BYTES // (slot_bytes * bucket)), SCRATCH_LIMIT // (slot_bytes * bucket)))
    gen = torch.Generator().manual_seed(bucket)
    total = sets * bucket
    shape = (total, K, p.nheads, p.headdim, p.dstate)
    if p.quantized:  # 8-bit values (their scales are the launcher's scratch)
        scratch = (torch.randn(shape, device=p.device) * 40).to(to_torch(p.state_dtype))
    else:
        scratch = torch.empty(shape, device=p.device, dtype=to_torch(p.state_dtype)).normal_(generator=None)
    slot_sets = [torch.arange(i * bucket, (i + 1) * bucket, dtype=torch.int32, device=p.device) for i in range(sets)]
    inputs = [step_inputs(p, s, gen) for s in slot_sets]
    outs = [torch.empty_like(i.x) for i in inputs]
    timed = []  # (microseconds, config) of every config timed

    def time_config(config) -> Optional[float]:
        launches = [
            (lambda c=config, s=s, i=i, o=o: run(c, scratch, s, i, o)) for s, i, o in zip(slot_sets, inputs, outs)
        ]
        try:
            us = graph_time_us(launches, replays=5, warmup=1, min_launches=iterations)
        except Exception as exc:  # a config the compiler rejects is skipped, not fatal
            log(f"  config {config} failed: {type(exc).__name__}: {exc}")
            return None
        timed.append((us, config))
        return us

    def fastest():
        return min(timed, key=lambda entry: entry[0])[1] if timed else None

    compile_in_parallel(
        lambda c=c: run(c, scratch, slot_sets[0], inputs[0], outs[0], compile_only=True) for c in configs
    )
    for config in configs:
        time_config(config)
    # the winner again with programmatic dependent launch, where launches honour it (sm_90 and newer)
    if try_pdl and timed and not fastest().pdl and pdl_capable(torch.device(p.device)):
        time_config(fastest()._replace(pdl=1))
    if try_branchless and timed:
        time_config(fastest()._replace(branchless=1 - fastest().branchless))
    if not timed:
        return None
    finalists = []
    for _, config in sorted(timed, key=lambda entry: entry[0]):
        if config not in finalists:
            finalists.append(config)
    finalists = finalists[:FINALISTS]
    if len(finalists) == 1:
        return finalists[0], min(timed, key=lambda entry: entry[0])[0]
    rounds: dict = {config: [] for config in finalists}
    for _ in range(FINAL_ROUNDS):
        for config in finalists:
            us = time_config(config)
            if us is not None:
                rounds[config].append(us)
    medians = {config: statistics.median(samples) for config, samples in rounds.items() if samples}
    if not medians:
        return None
    best = min(medians, key=medians.get)
    return best, medians[best]
