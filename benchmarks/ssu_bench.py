"""The SSU step per backend on this GPU: ``ssu bench`` (this file passes its arguments on, for the
benchmark commands the docs quote).

    python benchmarks/ssu_bench.py --backends triton,flashinfer --state-dtype fp32,bf16 --adopt --out results
"""

import sys

from ssu.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
