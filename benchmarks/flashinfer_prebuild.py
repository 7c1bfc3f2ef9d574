"""Compile FlashInfer modules in parallel processes (about 26 s of nvcc each for an SSU module,
about 260 s for a ReplaySSM one on an H200 machine), so that the tests and the benchmark that
follow find them in FlashInfer's JIT cache.

    python benchmarks/flashinfer_prebuild.py "fp32,bf16,128,64,1,int32" "replayssm:bf16,4,15" ...

An SSU spec is state dtype, input dtype, dstate, headdim, tokens, index dtype, then any of ``sr``
(stochastic rounding), ``packed`` and ``verify`` (the modules of those engine call forms, which
warmup builds for an adopted cache; ``"bf16,bf16,128,64,4,int32,packed"``); a ReplaySSM spec is
``replayssm:`` state dtype, tokens, max_window (H=128 P=64 N=128 G=8, bf16 input, int32).
"""

from __future__ import annotations

import subprocess
import sys
import time

WARM = """
import sys, torch, ssu
from ssu.checking.harness import engine_cache, engine_scales
state, inp, N, P, T, index, *flags = sys.argv[1].split(",")
calls = {f for f in flags if f in ("packed", "verify")}
p = ssu.Problem(nheads=8, headdim=int(P), dstate=int(N), ngroups=1, state_dtype=state, input_dtype=inp,
                num_slots=4, max_batch=2, tokens_per_step=int(T), speculative=int(T) > 1 and not calls,
                device="cuda", engine_state=bool(calls), engine_calls=calls)
options = {"warmup_index_dtypes": [index], "stochastic_rounding": "sr" in flags}
k = ssu.open(ssu.Config(backend="flashinfer", backends={"flashinfer": options}), p)
if calls:
    gen = torch.Generator()
    caches, _ = engine_cache(p, 1, gen)
    scales, _ = engine_scales(p, 1, gen)
    k.warmup(k.adopt_state(caches, scales=scales or None))
else:
    k.warmup(k.allocate_state())
"""

WARM_REPLAYSSM = """
import sys, ssu
state, T, W = sys.argv[1].split(":")[1].split(",")
p = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8, state_dtype=state, input_dtype="bf16",
                num_slots=4, max_batch=2, tokens_per_step=int(T), speculative=int(T) > 1, device="cuda")
options = {"max_window": int(W), "autotune": False}
k = ssu.open(ssu.Config(backend="flashinfer-replayssm", backends={"flashinfer-replayssm": options}), p)
k.warmup(k.allocate_state())
"""


def main(specs: list[str]) -> int:
    t0 = time.perf_counter()
    procs = [
        (
            spec,
            subprocess.Popen(
                [sys.executable, "-c", WARM_REPLAYSSM if spec.startswith("replayssm:") else WARM, spec],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
        for spec in specs
    ]
    failed = 0
    for spec, proc in procs:
        out, _ = proc.communicate()
        lines = [line for line in out.splitlines() if "module" in line or "Error" in line or "ready" in line]
        print(f"{spec}: rc={proc.returncode} {lines[-1] if lines else out[-300:]}")
        failed += proc.returncode != 0
    print(f"prebuilt {len(specs)} modules in {time.perf_counter() - t0:.0f} s")
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
