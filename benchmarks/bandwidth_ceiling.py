"""What any kernel can reach on this GPU for the SSU's traffic pattern: plain copies that read a
buffer once and write it ``copies`` times (1: the T = 1 step; 4: a T = 4 speculative step), timed
exactly like ``ssu_bench.py`` (CUDA-graph replays of back-to-back launches, each on another buffer
set so that the L2 stays cold, the median).

It separates what the SSU kernel could still win from what the memory system and the launch
boundary cost: a copy of the same bytes that stays below 90 % of 4.26 TB/s bounds the step too.
Variants: ``torch`` (``Tensor.copy_``, one copy only), ``grid`` (a Triton program per 4 KB block),
``persistent`` (one program per SM slot looping over blocks, loads pipelined), each optionally
with programmatic dependent launch (``+pdl``: the next launch starts while this one drains).

    python benchmarks/bandwidth_ceiling.py --mbytes 67,268,2147 --copies 1,4
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from ssu.measure.timing import graph_time_us

PEAK_TBPS = 4.26
COLD_BYTES = 1 << 30


@triton.jit
def copy_kernel(
    src,
    dst,
    n,
    COPIES: tl.constexpr,
    BLOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """dst[c * n + i] = src[i] for c < COPIES; ``n`` a multiple of BLOCK."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    lanes = tl.arange(0, BLOCK)
    if PERSISTENT:
        for block in tl.range(tl.program_id(0), n // BLOCK, tl.num_programs(0), num_stages=STAGES):
            v = tl.load(src + block * BLOCK + lanes)
            for c in tl.static_range(COPIES):
                tl.store(dst + c * n + block * BLOCK + lanes, v)
    else:
        offs = tl.program_id(0) * BLOCK + lanes
        v = tl.load(src + offs)
        for c in tl.static_range(COPIES):
            tl.store(dst + c * n + offs, v)


def time_variant(variant: str, nbytes: int, copies: int, iterations: int) -> float:
    """Median microseconds per launch of one copy of ``nbytes`` (bf16) to ``copies`` places."""
    n = nbytes // 2 // 4096 * 4096
    sets = max(2, min(64, -(-COLD_BYTES // (n * 2 * (1 + copies)))))
    srcs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    dsts = [torch.empty(copies * n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    pdl = variant.endswith("+pdl")
    kind = variant.removesuffix("+pdl")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = 2048
    if kind == "torch":
        if copies != 1 or pdl:
            return float("nan")
        launches = [(lambda s=s, d=d: d.copy_(s)) for s, d in zip(srcs, dsts)]
    elif kind == "grid":
        launches = [
            (
                lambda s=s, d=d: copy_kernel[(n // block,)](
                    s,
                    d,
                    n,
                    COPIES=copies,
                    BLOCK=block,
                    PERSISTENT=False,
                    STAGES=0,
                    PDL=pdl,
                    num_warps=4,
                    launch_pdl=pdl,
                )
            )
            for s, d in zip(srcs, dsts)
        ]
    elif kind == "persistent":  # 4 programs of 4 warps per SM, 3 stages of 4 KB each
        launches = [
            (
                lambda s=s, d=d: copy_kernel[(4 * sms,)](
                    s, d, n, COPIES=copies, BLOCK=block, PERSISTENT=True, STAGES=3, PDL=pdl, num_warps=4, launch_pdl=pdl
                )
            )
            for s, d in zip(srcs, dsts)
        ]
    else:
        raise SystemExit(f"unknown variant {variant!r}: use torch, grid or persistent, each optionally +pdl")
    for d in dsts:  # every variant is checked before it is timed
        d.fill_(0)
    launches[0]()
    assert torch.equal(dsts[0].view(copies, n), srcs[0].expand(copies, n)), variant
    return graph_time_us(launches, min_launches=iterations)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", default="67,268,2147", help="bytes read per launch, in MB (10^6)")
    ap.add_argument("--copies", default="1,4")
    ap.add_argument("--variants", default="torch,grid,grid+pdl,persistent,persistent+pdl")
    ap.add_argument("--iterations", type=int, default=40)
    args = ap.parse_args()
    print(
        f"# bandwidth_ceiling on {torch.cuda.get_device_name()}: torch {torch.__version__}, "
        f"triton {triton.__version__}; CUDA-graph replays of {args.iterations} launches, cold L2, median of 7"
    )
    print("| read MB | copies | variant | us | TB/s (read + writes) | % of 4.26 |")
    print("|---|---|---|---|---|---|")
    for mb in (int(v) for v in args.mbytes.split(",")):
        for copies in (int(c) for c in args.copies.split(",")):
            for variant in args.variants.split(","):
                us = time_variant(variant, mb * 10**6, copies, args.iterations)
                if us != us:  # nan: not applicable
                    continue
                moved = (mb * 10**6 // 2 // 4096 * 4096) * 2 * (1 + copies)
                tbps = moved / us / 1e6
                print(
                    f"| {mb} | {copies} | {variant} | {us:.1f} | {tbps:.2f} | {100 * tbps / PEAK_TBPS:.0f}% |",
                    flush=True,
                )
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
