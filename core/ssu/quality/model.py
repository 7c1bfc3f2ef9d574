"""A Mamba2 language model whose every SSU step goes through an ssu kernel, at any state dtype.

:class:`Mamba2LM` holds the weights of a transformers ``Mamba2ForCausalLM`` checkpoint (a folder
with ``config.json`` and ``model.safetensors``); :meth:`Mamba2LM.decoder` opens an ssu kernel for
one batch of sequences and returns a :class:`Decoder` that takes one token a sequence a step, as
an engine's decode does: embeddings, each layer's norm, projections and convolution in fp32 torch,
its SSU through ``kernel.step`` on a state of the chosen dtype (an 8-bit state with its row
scales, quantised at every write), then the final norm and the logits. The math is transformers'
own Mamba2 (tests/test_quality.py holds the logits to its forward's).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import attrs

from ..contract.errors import ConfigError


def _number(value) -> float:
    """A number of config.json: transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _rms_norm(h, weight, eps: float):
    return weight * (h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt())


@attrs.define(eq=False)
class Mamba2LM:
    """The weights and shapes of a Mamba2 language model (transformers' ``Mamba2ForCausalLM``
    layout: ``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``, ``lm_head``)."""

    config: dict = attrs.field(repr=False)
    tensors: dict = attrs.field(repr=False)
    nheads: int = attrs.field(init=False)
    headdim: int = attrs.field(init=False)
    dstate: int = attrs.field(init=False)
    ngroups: int = attrs.field(init=False)
    num_layers: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        c = self.config
        if c.get("model_type") != "mamba2":
            raise ConfigError(
                f"Mamba2LM takes a mamba2 checkpoint, got model_type {c.get('model_type')!r}; give a folder that "
                'transformers\' Mamba2ForCausalLM.save_pretrained wrote (config.json model_type "mamba2")'
            )
        self.nheads, self.headdim = c["num_heads"], c["head_dim"]
        self.dstate, self.ngroups = c["state_size"], c["n_groups"]
        self.num_layers = c["num_hidden_layers"]
        limit = [_number(v) for v in (c.get("time_step_limit") or (0.0, float("inf")))]
        if limit != [0.0, float("inf")]:
            raise ConfigError(
                f"Mamba2LM: time_step_limit {limit} is not served (it decodes with the default (0, inf) only); "
                "use a checkpoint without a time-step clamp, or decode it with transformers (ssu compare)"
            )

    @classmethod
    def load(cls, folder: str, device: str = "cpu") -> "Mamba2LM":
        """The model saved in ``folder`` by transformers' ``save_pretrained`` (fp32 weights)."""
        try:
            from safetensors.torch import load_file
        except ImportError as exc:  # pragma: no cover - comes with transformers
            raise ConfigError("Mamba2LM.load needs safetensors: pip install safetensors") from exc
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        tensors = {k: v.float().to(device) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        if "lm_head.weight" not in tensors:  # tied embeddings
            tensors["lm_head.weight"] = tensors["backbone.embeddings.weight"]
        return cls(config, tensors)

    def layer(self, i: int, name: str, optional: bool = False):
        """Layer ``i``'s tensor ``name`` (``None`` for an ``optional`` one the checkpoint lacks)."""
        key = f"backbone.layers.{i}.{name}"
        return self.tensors.get(key) if optional else self.tensors[key]

    def decoder(self, ssu_config: Any, state_dtype: str, batch: int, device: str = "cpu") -> "Decoder":
        """A :class:`Decoder` of ``batch`` sequences, each starting from a zero state, its SSU on a
        kernel of ``ssu_config`` (an :class:`ssu.Config`, whose backend must adopt an engine's
        cache) stepping a cache of ``state_dtype`` that the decoder allocates, as an engine does."""
        import torch

        from ..contract.dtypes import to_torch
        from ..contract.problem import Problem
        from ..runtime.kernel import open_kernel
        from ..state.quant import is_quantized

        problem = Problem(
            nheads=self.nheads,
            headdim=self.headdim,
            dstate=self.dstate,
            ngroups=self.ngroups,
            state_dtype=state_dtype,
            input_dtype="fp32",
            num_slots=batch,
            max_batch=batch,
            device=device,
        )
        kernel = open_kernel(ssu_config, problem)
        # the cache is the decoder's own, adopted as an engine's is: (layers, slots, H, P, N) at the
        # state dtype, with an 8-bit cache's row scales (layers, slots, H, P)
        shape = (self.num_layers, batch, self.nheads, self.headdim, self.dstate)
        cache = torch.zeros(shape, dtype=to_torch(state_dtype), device=device)
        scales = torch.zeros(shape[:-1], device=device) if is_quantized(state_dtype) else None
        return Decoder(self, kernel, cache, scales, batch, device)


class _Layer(NamedTuple):
    """One Mamba2 layer's tensors, looked up once for every step."""

    norm: Any
    in_proj: Any
    in_bias: Any
    conv: Any  # (conv_dim, K)
    conv_bias: Any
    A: Any  # -exp(A_log)
    D: Any
    dt_bias: Any
    gate_norm: Any
    out_proj: Any
    out_bias: Any

    @classmethod
    def of(cls, lm: "Mamba2LM", i: int) -> "_Layer":
        import torch

        def get(name: str, optional: bool = False):
            return lm.layer(i, name, optional)

        return cls(
            get("norm.weight"), get("mixer.in_proj.weight"), get("mixer.in_proj.bias", True),
            get("mixer.conv1d.weight")[:, 0, :], get("mixer.conv1d.bias", True), -torch.exp(get("mixer.A_log")),
            get("mixer.D"), get("mixer.dt_bias"), get("mixer.norm.weight"), get("mixer.out_proj.weight"),
            get("mixer.out_proj.bias", True),
        )  # fmt: skip


@attrs.define(eq=False)
class Decoder:
    """One batch of sequences decoding a token each a step, on ``cache`` (and an 8-bit cache's
    ``scales``), the kernel's adopted state; :meth:`states` reads every layer's SSM state back as
    fp32, :meth:`load` writes states (and convolution windows) into it."""

    lm: Mamba2LM
    kernel: Any
    cache: Any = attrs.field(repr=False)
    scales: Any = attrs.field(repr=False)
    batch: int
    device: str
    state: Any = attrs.field(init=False, repr=False)
    conv: list = attrs.field(init=False)
    slots: Any = attrs.field(init=False)
    _layers: list = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        import torch

        lm = self.lm
        self._layers = [_Layer.of(lm, i) for i in range(lm.num_layers)]
        self.conv = [
            torch.zeros(self.batch, layer.conv.shape[0], layer.conv.shape[1], device=self.device)
            for layer in self._layers
        ]
        self.slots = torch.arange(self.batch, dtype=torch.int32, device=self.device)
        self.state = self.kernel.adopt_state(self.cache, self.scales)

    def step(self, tokens):
        """Logits (batch, vocab) after one token (batch,) a sequence."""
        import torch.nn.functional as F

        lm = self.lm
        eps = lm.config["layer_norm_epsilon"]
        H, P, N, G = lm.nheads, lm.headdim, lm.dstate, lm.ngroups
        b = self.batch
        h = lm.tensors["backbone.embeddings.weight"][tokens]
        for i, layer in enumerate(self._layers):
            d_inner = layer.gate_norm.shape[0]
            proj = F.linear(_rms_norm(h, layer.norm, eps), layer.in_proj, layer.in_bias)
            gate, xbc, dt = proj.split([d_inner, d_inner + 2 * G * N, H], dim=-1)
            window = self.conv[i]
            window[:, :, :-1] = window[:, :, 1:].clone()
            window[:, :, -1] = xbc
            xbc = (window * layer.conv).sum(-1)
            xbc = F.silu(xbc + layer.conv_bias if layer.conv_bias is not None else xbc)
            x, B, C = xbc.split([d_inner, G * N, G * N], dim=-1)
            y = self.kernel.step(
                self.state,
                x.reshape(b, H, P),
                dt.contiguous(),
                layer.A,
                B.reshape(b, G, N),
                C.reshape(b, G, N),
                self.slots,
                D=layer.D,
                z=None,
                dt_bias=layer.dt_bias,
                dt_softplus=True,
                out=None,
                layer=i,
                dst_slots=None,
            ).reshape(b, d_inner)
            y = _rms_norm((y * F.silu(gate)).reshape(b, G, d_inner // G), 1.0, eps).reshape(b, d_inner)
            h = h + F.linear(layer.gate_norm * y, layer.out_proj, layer.out_bias)
        h = _rms_norm(h, lm.tensors["backbone.norm_f.weight"], eps)
        return F.linear(h, lm.tensors["lm_head.weight"])

    def feed(self, tokens):
        """Step through ``tokens`` (batch, T) one column at a time; the logits after the last."""
        logits = None
        for t in range(tokens.shape[1]):
            logits = self.step(tokens[:, t])
        return logits

    def generate(self, logits, count: int):
        """Greedy continuation of ``count`` tokens a sequence from the ``logits`` of the last token fed."""
        import torch

        out = []
        for _ in range(count):
            token = logits.argmax(-1)
            out.append(token)
            if len(out) < count:
                logits = self.step(token)
        return torch.stack(out, 1)

    def states(self) -> list:
        """Every layer's SSM state, fp32 (batch, H, P, N), as the cache reads back."""
        return [self.kernel.read_state(self.state, self.slots, layer=i) for i in range(self.lm.num_layers)]

    def snapshot(self) -> tuple:
        """``(states, windows)``: copies of every layer's SSM state (fp32, as the cache reads back)
        and convolution window, for :meth:`load`."""
        return self.states(), [w.clone() for w in self.conv]

    def load(self, snapshot: tuple) -> None:
        """Write a :meth:`snapshot` (of any decoder of the same model and batch) into this decoder,
        its states stored at this decoder's dtype: a prefill computed elsewhere, stored once."""
        states, windows = snapshot
        for i in range(self.lm.num_layers):
            self.conv[i].copy_(windows[i])
            self.kernel.write_state(self.state, self.slots, states[i], layer=i)
