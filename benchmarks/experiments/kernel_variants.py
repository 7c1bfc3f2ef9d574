"""Experiment (not used by the backend): variants of the triton backend's kernel, written as
modules into a directory for ``structure_probe.py`` to import. Results: docs/benchmarks.md, sixth
and seventh sessions.

- ``kernel_copy.py``, from the current kernel: the same grid, slot and cursor indexing, pipelined
  loads and state stores (one per token version), without the arithmetic: the copy ceiling of
  the kernel's own memory structure.
- ``kc_evict_<load|store|both>.py``, from the current kernel: the state tile loaded, stored or
  both with the L2 eviction hint ``evict_first`` (the state is touched once per step; seventh
  session: no faster).
- ``kv_<name>.py``, from the kernel at commit ``BASE_COMMIT`` (before the sixth session changed
  how inputs are loaded; needs a git checkout): ``bf`` branch-free optional inputs (kept, now the
  schedule field ``branchless``), ``sf`` the state tile loaded before the token inputs in the
  tile shape, ``b2d`` B and C loaded in the tile's layout (kept for looping programs), ``li``
  token inputs loaded per tile inside the loop, and their combinations; ``base`` unchanged.

    python benchmarks/experiments/kernel_variants.py benchmarks/experiments/generated
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "backends/triton_ssu/ssu_backend_triton/kernel.py"
BASE_COMMIT = "1a5e834"
#: name -> (branch-free inputs, state loaded first, B and C in the tile's layout, inputs in the loop)
INPUT_VARIANTS = {"base": (0, 0, 0, 0), "bf": (1, 0, 0, 0), "sf": (0, 1, 0, 0), "bfsf": (1, 1, 0, 0),
                  "bfb2d": (1, 0, 1, 0), "bfsfb2d": (1, 1, 1, 0), "bfli": (1, 0, 0, 1), "bfsfb2dli": (1, 1, 1, 1)}


def _replace(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise SystemExit(f"kernel_variants: the kernel no longer contains, once:\n{old}")
    return src.replace(old, new)


def copy_variant(src: str) -> str:
    """``_rows`` renamed ``_rows_math`` and wrapped: with ``COPY`` it stores the loaded tile to
    every version the step would write, instead of computing."""
    start = src.index("@triton.jit\ndef _rows(")
    sig = src[start + len("@triton.jit\ndef _rows("):src.index("):", start)]
    params = [p.split(":")[0].strip() for p in sig.replace("\n", " ").split(",") if p.strip()]
    src = _replace(src, "import triton.language as tl\n", "import triton.language as tl\n\nCOPY = tl.constexpr(True)\n")
    src = src.replace("def _rows(", "def _rows_math(", 1)
    wrapper = (
        "@triton.jit\ndef _rows(" + sig + "):\n"
        "    if COPY:\n"
        "        for t in tl.static_range(T):\n"
        "            if SPECULATIVE or t == T - 1:\n"
        "                if SPECULATIVE:\n"
        "                    dest = (cur + 1 + t) % K\n"
        "                else:\n"
        "                    dest = 0\n"
        "                tl.store(base + dest * s_ver + offs_p[:, None] * s_p + offs_n[None, :], s_raw,\n"
        "                         mask=_state_mask(offs_p, offs_n, state_rows, N, EVEN_N))\n"
        "    else:\n"
        "        _rows_math(" + ", ".join(params) + ")\n\n\n")
    anchor = src.index("# ``layer_offset`` must stay")
    return src[:anchor] + wrapper + src[anchor:]


def evict_variant(src: str, load: bool, store: bool) -> str:
    """The current kernel with ``eviction_policy="evict_first"`` on the state tile's load and/or
    its stores."""
    if load:
        src = _replace(src, "mask=_state_mask(offs_p, offs_n, state_rows, N, EVEN_N), other=0.0)",
                       'mask=_state_mask(offs_p, offs_n, state_rows, N, EVEN_N), other=0.0,\n'
                       '                   eviction_policy="evict_first")')
    if store:
        src = _replace(src, "tl.store(base + dest * s_ver + tile, stored, mask=state_mask)",
                       'tl.store(base + dest * s_ver + tile, stored, mask=state_mask, eviction_policy="evict_first")')
    return src


EVICT_VARIANTS = {"load": (True, False), "store": (False, True), "both": (True, True)}


def input_variant(src: str, bf: int, sf: int, b2d: int, li: int) -> str:
    """The kernel of ``BASE_COMMIT`` with module-level switches for the input-loading changes."""
    r = _replace
    src = r(src, "import triton.language as tl\n",
            f"import triton.language as tl\n\nBRANCHFREE = tl.constexpr({bool(bf)})\nSTATE_FIRST = "
            f"tl.constexpr({bool(sf)})\nB2D = tl.constexpr({bool(b2d)})\nLOOP_INPUTS = tl.constexpr({bool(li)})\n")
    src = r(src, """    d = tl.load(dt_ptr + row * dt_b + t * dt_t + head * dt_h).to(tl.float32) + bias
    if softplus:
        d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))))""",
            """    d = tl.load(dt_ptr + row * dt_b + t * dt_t + head * dt_h).to(tl.float32) + bias
    if BRANCHFREE:
        d = tl.where(softplus & (d <= 20.0), tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    else:
        if softplus:
            d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))))""")
    src = r(src, """    C_ptrs = C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n
    if EVEN_N:""", """    C_ptrs = C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n
    if B2D:
        Bv = tl.load(B_ptrs[None, :] + 0 * offs_p[:, None], mask=(offs_n < N)[None, :], other=0.0).to(tl.float32)
        Cv = tl.load(C_ptrs[None, :] + 0 * offs_p[:, None], mask=(offs_n < N)[None, :], other=0.0).to(tl.float32)
    elif EVEN_N:""")
    src = r(src, """    zv = tl.zeros_like(x)
    if has_z:
        zv = tl.load(z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p, mask=mask_p, other=0.0).to(tl.float32)""",
            """    if BRANCHFREE:
        zv = tl.load(z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p, mask=mask_p & has_z,
                     other=0.0).to(tl.float32)
    else:
        zv = tl.zeros_like(x)
        if has_z:
            zv = tl.load(z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p, mask=mask_p,
                         other=0.0).to(tl.float32)""")
    src = r(src, """        s = tl.fma(s, tl.exp(a * d), (d * x)[:, None] * Bv[None, :])
        y = tl.sum(s * Cv[None, :], axis=1)""", """        if B2D:
            s = tl.fma(s, tl.exp(a * d), (d * x)[:, None] * Bv)
            y = tl.sum(s * Cv, axis=1)
        else:
            s = tl.fma(s, tl.exp(a * d), (d * x)[:, None] * Bv[None, :])
            y = tl.sum(s * Cv[None, :], axis=1)""")
    src = r(src, """    d_skip = 0.0
    if has_d:
        d_skip = tl.load(D_ptr + head).to(tl.float32)
    bias = 0.0
    if has_dt_bias:
        bias = tl.load(dt_bias_ptr + head).to(tl.float32)""", """    if BRANCHFREE:
        d_skip = tl.load(D_ptr + head, mask=has_d, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias_ptr + head, mask=has_dt_bias, other=0.0).to(tl.float32)
    else:
        d_skip = 0.0
        if has_d:
            d_skip = tl.load(D_ptr + head).to(tl.float32)
        bias = 0.0
        if has_dt_bias:
            bias = tl.load(dt_bias_ptr + head).to(tl.float32)""")
    src = r(src, """    # token 0's inputs for the first tile (dt, B and C serve every tile of the program)
    d0, x0, z0, B0, C0 = _token_inputs(""", """    if STATE_FIRST and TILES == 1:
        s_first = _load_tile(base, cur, s_ver, s_p, first + rows, offs_n, state_rows, N, EVEN_N)
    # token 0's inputs for the first tile (dt, B and C serve every tile of the program)
    d0, x0, z0, B0, C0 = _token_inputs(""")
    src = r(src, """    if TILES == 1:  # one program per tile
        s_raw = _load_tile(base, cur, s_ver, s_p, first + rows, offs_n, state_rows, N, EVEN_N)""",
            """    if TILES == 1:  # one program per tile
        if STATE_FIRST:
            s_raw = s_first
        else:
            s_raw = _load_tile(base, cur, s_ver, s_p, first + rows, offs_n, state_rows, N, EVEN_N)""")
    loop_body = ("            x_i, z_i = _row_inputs(x_ptr, z_ptr, offs_p, row, head, 0, x_b, x_t, x_h, x_p, z_b, z_t,"
                 " z_h, z_p, has_z,\n                                   P)\n"
                 "            s_raw = _load_tile(base, cur, s_ver, s_p, offs_p, offs_n, state_rows, N, EVEN_N)")
    src = r(src, loop_body,
            """            s_raw = _load_tile(base, cur, s_ver, s_p, offs_p, offs_n, state_rows, N, EVEN_N)
            if LOOP_INPUTS:
                d0, x_i, z_i, B0, C0 = _token_inputs(x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, offs_p, offs_n, row, head,
                                                     group, 0, bias, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t,
                                                     B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z,
                                                     softplus, P, N, EVEN_N)
            else:
                x_i, z_i = _row_inputs(x_ptr, z_ptr, offs_p, row, head, 0, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p,
                                       has_z, P)""")
    return src


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else Path(__file__).parent / "generated")
    out.mkdir(parents=True, exist_ok=True)
    current = (ROOT / KERNEL).read_text()
    (out / "kernel_copy.py").write_text(copy_variant(current))
    for name, flags in EVICT_VARIANTS.items():
        (out / f"kc_evict_{name}.py").write_text(evict_variant(current, *flags))
    try:
        base = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASE_COMMIT}:{KERNEL}"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"kernel_variants: no git history ({exc}); wrote only kernel_copy.py and kc_*.py", file=sys.stderr)
        return 0
    for name, flags in INPUT_VARIANTS.items():
        (out / f"kv_{name}.py").write_text(input_variant(base, *flags))
    print(f"wrote kernel_copy.py, {len(EVICT_VARIANTS)} kc_*.py and {len(INPUT_VARIANTS)} kv_*.py to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
