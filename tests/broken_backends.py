"""Deliberately wrong backends: each must fail the conformance kit. All delegate to the reference
and then break exactly one rule of docs/spec.md."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

import ssu
from ssu.state import quant, slot_state
from ssu.reference.math import make_step, per_head
from ssu.runtime.validation import contiguous_strides


class _Base:
    """The reference under another name; ``CAPABILITIES`` overrides what it declares and
    ``CAUGHT_BY`` names the conformance checks that must fail on it."""

    NAME = "?"
    CAPABILITIES: dict = {}
    CAUGHT_BY = ("step",)

    @ssu.hookimpl
    def ssu_backend(self):
        declared = dict(devices={"cpu"}, max_tokens_per_step=8, speculative=True)
        declared.update(self.CAPABILITIES)
        return ssu.BackendSpec(
            name=self.NAME,
            api_version=ssu.PLUGIN_API_VERSION,
            factory=self.factory,
            capabilities=ssu.Capabilities(**declared),
        )

    def factory(self, ctx):
        step = make_step(ctx)
        return _calling(lambda call: self.wrong(ctx, step, call))

    def wrong(self, ctx, step, call: dict):
        """The broken step: ``call`` holds the step's arguments by name."""
        return step(**call)

    ssu_allocate_state = staticmethod(slot_state.ssu_allocate_state)
    ssu_commit = staticmethod(slot_state.ssu_commit)
    ssu_read_state = staticmethod(slot_state.ssu_read_state)
    ssu_write_state = staticmethod(slot_state.ssu_write_state)


def _calling(body):
    """A step callable with the contract's signature that hands its arguments to ``body`` as a dict."""

    def step(
        state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0, dst_slots=None
    ):
        return body(
            dict(
                state=state,
                x=x,
                dt=dt,
                A=A,
                B=B,
                C=C,
                slots=slots,
                D=D,
                z=z,
                dt_bias=dt_bias,
                dt_softplus=dt_softplus,
                out=out,
                layer=layer,
                dst_slots=dst_slots,
            )
        )

    return step


class WrongGate(_Base):
    """Gates with sigmoid(z) instead of z * sigmoid(z)."""

    NAME = "wrong-gate"

    def wrong(self, ctx, step, call):
        z = call["z"]
        out = step(**dict(call, z=None))
        if z is not None:
            out.copy_((out.float() * torch.sigmoid(z.float())).to(out.dtype))
        return out


class TouchesNeighbour(_Base):
    """Also writes the slot after each sequence's own slot."""

    NAME = "touches-neighbour"

    def wrong(self, ctx, step, call):
        out = step(**call)
        slots = call["slots"]
        real = slots[(slots >= 0) & (slots < ctx.problem.num_slots)].long()
        call["state"].buffers["ssm"][call["layer"], (real + 1) % ctx.problem.num_slots] *= 0.999
        return out


class IgnoresPadRows(_Base):
    """Treats the pad id as slot 0: reads and writes slot 0 for padded rows."""

    NAME = "ignores-pad-rows"

    def wrong(self, ctx, step, call):
        slots = call["slots"]
        call["slots"] = torch.where(slots == ctx.problem.pad_slot_id, torch.zeros_like(slots), slots)
        return step(**call)


class CommitsWrongToken(_Base):
    """Keeps the state after num_accepted - 1 tokens (at least one)."""

    NAME = "commits-wrong-token"
    CAUGHT_BY = ("decode",)

    @ssu.hookimpl
    def ssu_commit(self, ctx, state, slots, num_accepted):
        T = ctx.problem.tokens_per_step
        slot_state.commit(
            state, slots, torch.where(num_accepted > 1, num_accepted - 1, torch.full_like(num_accepted, T))
        )


class AssumesContiguous(_Base):
    """Reads x, B and C as if they were contiguous (wrong for row-strided and strided views)."""

    NAME = "assumes-contiguous"

    def wrong(self, ctx, step, call):
        for name in ("x", "B", "C"):
            t = call[name]
            call[name] = t.as_strided(t.shape, contiguous_strides(t.shape), t.storage_offset())
        return step(**call)


class WrongAfterFourTokens(_Base):
    """Scales the output of every token after the fourth of a step by 1.01."""

    NAME = "wrong-after-four-tokens"

    def wrong(self, ctx, step, call):
        out = step(**call)
        if ctx.problem.multi_token and out.shape[1] > 4:
            out[:, 4:] = (out[:, 4:].float() * 1.01).to(out.dtype)
        return out


class IgnoresDstateBeyond16(_Base):
    """Computes each output from the first 16 state columns only."""

    NAME = "ignores-dstate-beyond-16"

    def wrong(self, ctx, step, call):
        C = call["C"].clone()
        C[..., 16:] = 0
        call["C"] = C
        return step(**call)


class DtBiasOnlyWithSoftplus(_Base):
    """Adds dt_bias only when softplus is applied."""

    NAME = "dt-bias-only-with-softplus"

    def wrong(self, ctx, step, call):
        if not call["dt_softplus"]:
            call["dt_bias"] = None
        return step(**call)


class PadHardCodedMinusOne(_Base):
    """Treats -1 as the pad id, whatever the problem's pad id is."""

    NAME = "pad-hard-coded-minus-one"
    CAPABILITIES = dict(any_pad_slot_id=True, guards_slots=True)

    def factory(self, ctx):
        minus_one = attrs.evolve(ctx, problem=attrs.evolve(ctx.problem, pad_slot_id=-1))
        return make_step(minus_one)


class ClampsDtAt20(_Base):
    """Clamps the time step (after dt_bias and softplus) at 20."""

    NAME = "clamps-dt-at-20"

    def wrong(self, ctx, step, call):
        dt, A, D, dt_bias = per_head(call["x"], call["dt"], call["A"], call["D"], call["dt_bias"])
        d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        if call["dt_softplus"]:
            d = F.softplus(d)
        call.update(dt=d.clamp(max=20.0), A=A, D=D, dt_bias=None, dt_softplus=False)
        return step(**call)


class Fp32OutputWhenNone(_Base):
    """Returns an fp32 output when ``out`` is None, whatever the input dtype."""

    NAME = "fp32-output-when-none"

    def wrong(self, ctx, step, call):
        if call["out"] is None:
            call["out"] = torch.empty(call["x"].shape, dtype=torch.float32, device=call["x"].device)
        return step(**call)


class Bf16PrecisionFp32State(_Base):
    """Keeps an fp32 state cache at bf16 precision (rounds every state it writes), bf16 inputs."""

    NAME = "bf16-precision-fp32-state"
    CAPABILITIES = dict(speculative=False, max_tokens_per_step=1, state_dtypes={"fp32"}, input_dtypes={"bf16"})

    def wrong(self, ctx, step, call):
        out = step(**call)
        S, pad = ctx.problem.num_slots, ctx.problem.pad_slot_id
        slots = call["slots"].long()
        dst = slots if call["dst_slots"] is None else call["dst_slots"].long()
        keep = (slots >= 0) & (slots < S) & (slots != pad) & (dst >= 0) & (dst < S) & (dst != pad)
        write = call["state"].views[call["layer"]].write
        rows = dst[keep]
        write[rows, 0] = write[rows, 0].to(torch.bfloat16).float()
        return out


class _QuantizesWrongly(_Base):
    """Writes an int8 state by a wrong rule (:meth:`quantize`) during its steps; ``write_state``
    stays right."""

    CAPABILITIES = dict(state_dtypes={"int8"})

    def quantize(self, values, state_dtype):
        raise NotImplementedError

    def wrong(self, ctx, step, call):
        right = quant.quantize
        quant.quantize = self.quantize
        try:
            return step(**call)
        finally:
            quant.quantize = right


class RoundsInt8TowardZero(_QuantizesWrongly):
    """Truncates an int8 state's values instead of rounding them to nearest."""

    NAME = "rounds-int8-toward-zero"

    def quantize(self, values, state_dtype):
        values = values.float()
        scale = values.abs().amax(dim=-1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.trunc(values / safe[..., None]).to(torch.int8), scale


class OneScalePerHead(_QuantizesWrongly):
    """Gives every row of a head the head's scale (its largest row's) instead of its own."""

    NAME = "one-scale-per-head"

    def quantize(self, values, state_dtype):
        values = values.float()
        head = values.abs().amax(dim=(-2, -1), keepdim=True) / 127
        safe = torch.where(head > 0, head, torch.ones_like(head))
        q = torch.round(values / safe).clamp_(-127, 127).to(torch.int8)
        return q, head[..., 0].expand(values.shape[:-1]).contiguous()


BROKEN = [
    WrongGate,
    TouchesNeighbour,
    IgnoresPadRows,
    CommitsWrongToken,
    AssumesContiguous,
    WrongAfterFourTokens,
    IgnoresDstateBeyond16,
    DtBiasOnlyWithSoftplus,
    PadHardCodedMinusOne,
    ClampsDtAt20,
    Fp32OutputWhenNone,
    Bf16PrecisionFp32State,
    RoundsInt8TowardZero,
    OneScalePerHead,
]
