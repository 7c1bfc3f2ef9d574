"""Decode of a transformers Mamba2-family model through its own SSU and through ssu, per batch:
milliseconds per generated token and the SSU's share of it (against a run whose SSU returns
zeros). Random weights at a real model's mixer shapes; prints a markdown table.

    python benchmarks/hf_decode.py --arch nemotron_h --preset nemotron-h-8b --layers 4 --dtype bf16 \\
        --batches 1,8,32,128 --backend triton [--compile]

``--compile`` also tries the same decode with the model's forward under ``torch.compile`` and says
what happened.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch

import ssu
from ssu.integrations import hf_models
from ssu.integrations import transformers as integration


def decode_row(model, batch: int, args, config) -> dict:
    ids = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
    ids = ids.to(args.device)
    result = hf_models.compare(model, ids, args.new_tokens, config=config, null=True)
    null = result.null_ssu.per_token
    own, through = result.reference.per_token, result.through_ssu.per_token
    return dict(
        batch=batch,
        own_ms=own * 1e3,
        ssu_ms=through * 1e3,
        null_ms=null * 1e3,
        own_share=(own - null) / own,
        ssu_share=(through - null) / through,
        speedup=own / through,
        agreement=result.agreement,
        within_rounding=result.divergence_within_rounding(),
    )


def try_compile(model, args, config) -> str:
    """The decode with ``torch.compile`` on the model's forward, through ssu: what happened."""
    ids = torch.randint(0, args.vocab, (8, args.prompt_len)).to(args.device)
    forward = model.forward
    try:
        model.forward = torch.compile(forward, dynamic=False)
        t0 = time.perf_counter()
        with integration.patch(model, config):
            run = hf_models.generate(model, ids, args.new_tokens)
        return (
            f"torch.compile(model.forward) through ssu at batch 8: {run.per_token * 1e3:.3f} ms per token "
            f"(first generate {time.perf_counter() - t0:.0f} s, compilation included)"
        )
    except Exception as exc:  # report, do not fail the benchmark
        return f"torch.compile(model.forward) failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        model.forward = forward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="nemotron_h")
    parser.add_argument("--preset", default="nemotron-h-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = hf_models.random_model(
        args.arch,
        args.preset,
        args.layers,
        vocab=args.vocab,
        dtype=dtype,
        device=args.device,
        chunk_size=args.prompt_len,
    )
    config = ssu.Config(backend=args.backend)
    import transformers

    H, P, N, G = hf_models.PRESETS[args.preset]
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"# hf_decode {datetime.date.today()} on {gpu}: transformers {transformers.__version__}, torch "
        f"{torch.__version__}, Python {platform.python_version()}; {args.arch} random weights, {args.layers} Mamba2 "
        f"layers of H={H} P={P} N={N} G={G}, {args.dtype}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"ssu backend {args.backend}\n"
    )
    print(
        "| batch | transformers ms/token | SSU share | ssu ms/token | SSU share | speed-up | tokens equal | "
        "flips within rounding |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        r = decode_row(model, batch, args, config)
        print(
            f"| {batch} | {r['own_ms']:.2f} | {r['own_share']:.0%} | {r['ssu_ms']:.2f} | {r['ssu_share']:.0%} | "
            f"{r['speedup']:.2f}x | {r['agreement']:.0%} | {'yes' if r['within_rounding'] else 'NO'} |",
            flush=True,
        )
        ssu.dropin.clear()
        torch.cuda.empty_cache()
    print(
        "\n(ms/token: the median decode step after the first token, the device synchronised at each; SSU share: "
        "against the same decode with an SSU that returns zeros)"
    )
    if args.compile:
        print("\n" + try_compile(model, args, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
