"""Launch parameters per problem and batch bucket: defaults, tuning on scratch, a JSON cache.

Tuning times each candidate (BLOCK_P, num_warps) with CUDA-graph replays on *scratch* copies of
random states, rotating several slot sets so that the L2 stays cold; live state is never touched.
The winners are stored in a JSON file keyed by GPU name, Triton version, shape, dtypes, tokens and
batch bucket, so that the next process reuses them without timing anything.

Cache file: option ``tuning_cache``, else ``$SSU_TRITON_TUNING_CACHE``, else
``$XDG_CACHE_HOME/ssu/triton-tuning.json`` (``~/.cache/ssu/triton-tuning.json``).
Delete the file to clear it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

ENV_CACHE = "SSU_TRITON_TUNING_CACHE"
#: scratch memory tuning may use per bucket (bytes)
SCRATCH_LIMIT = 4 << 30
#: bytes of state that the rotated slot sets span at least (several times the H200's 60 MB L2)
COLD_BYTES = 256 << 20


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def buckets(max_batch: int) -> list[int]:
    """Batch buckets 1, 2, 4, ... up to the first power of two >= max_batch."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_batch:
            return out
        b *= 2


def default_config(problem, batch: int) -> tuple[int, int, int]:
    """A sound (BLOCK_P, num_warps, loop stages) without tuning: one single-warp
    program per tile of about 1024 values (the fastest shape measured on an H200 for both state
    dtypes), smaller when the batch is too small to fill the GPU."""
    block_n = next_pow2(problem.dstate)
    block_p = max(1, min(next_pow2(problem.headdim), 1024 // block_n))
    programs = lambda bp: batch * problem.nheads * -(-problem.headdim // bp)  # noqa: E731
    while block_p > 2 and programs(block_p) < 4 * 132:
        block_p //= 2
    return block_p, 1, 0


def candidates(problem) -> list[tuple[int, int, int]]:
    """(BLOCK_P, num_warps, loop stages) worth timing for this shape: one program per tile, and
    one program per head looping over 2- or 3-stage pipelined tiles."""
    block_n = next_pow2(problem.dstate)
    top = next_pow2(problem.headdim)
    out = []
    for block_p in (1, 2, 4, 8, 16, 32, 64):
        if block_p > top or block_p * block_n > 16384 or block_p * block_n < 256:
            continue
        for warps in (1, 2, 4, 8):
            per_thread = block_p * block_n // (32 * warps)
            if 8 <= per_thread <= 64 or (block_p * block_n < 2048 and per_thread >= 4):
                out.append((block_p, warps, 0))
            if 8 <= per_thread <= 32 and block_p < problem.headdim and warps >= 4:
                out += [(block_p, warps, 2), (block_p, warps, 3)]
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
    p = problem
    return (f"{gpu}|triton {triton_version}|kernel v3|H{p.nheads} P{p.headdim} N{p.dstate} G{p.ngroups}|"
            f"state {p.state_dtype} input {p.input_dtype}|T{p.tokens_per_step}{' spec' if p.speculative else ''}"
            f"{' sr' if stochastic else ''}|batch {bucket}")


def read_cache(path: Optional[Path]) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a corrupt cache is re-tuned, never fatal
    return data if isinstance(data, dict) else {}


def write_cache(path: Optional[Path], entries: dict) -> None:
    """Merge ``entries`` into the cache file atomically (other processes' entries are kept)."""
    if path is None or not entries:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = read_cache(path)
    merged.update(entries)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".triton-tuning-")
    with os.fdopen(fd, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def tune_bucket(problem, bucket: int, run: Callable, configs: list, iterations: int, log: Callable) -> tuple:
    """Time every config for one batch bucket on scratch; returns (best config, its microseconds).

    ``run(config, scratch_ssm, slots, inputs, out)`` launches one step on the scratch state.
    """
    import torch

    from ssu.dtypes import to_torch
    from ssu.inputs import step_inputs
    from ssu.slot_state import versions
    from ssu.timing import graph_time_us

    p = problem
    K = versions(p)
    slot_bytes = p.state_bytes_per_slot() * K
    sets = max(1, min(16, -(-COLD_BYTES // (slot_bytes * bucket)), SCRATCH_LIMIT // (slot_bytes * bucket)))
    gen = torch.Generator().manual_seed(bucket)
    total = sets * bucket
    scratch = torch.empty(1, total, K, p.nheads, p.headdim, p.dstate, device=p.device,
                          dtype=to_torch(p.state_dtype)).normal_(generator=None)
    slot_sets = [torch.arange(i * bucket, (i + 1) * bucket, dtype=torch.int32, device=p.device) for i in range(sets)]
    inputs = [step_inputs(p, s, gen) for s in slot_sets]
    outs = [torch.empty_like(i.x) for i in inputs]
    best = None
    for config in configs:
        launches = [(lambda c=config, s=s, i=i, o=o: run(c, scratch, s, i, o))
                    for s, i, o in zip(slot_sets, inputs, outs)]
        try:
            us = graph_time_us(launches, replays=5, warmup=1, min_launches=iterations)
        except Exception as exc:  # a config the compiler rejects is skipped, not fatal
            log(f"  config {config} failed: {type(exc).__name__}: {exc}")
            continue
        if best is None or us < best[1]:
            best = (config, us)
    return best
