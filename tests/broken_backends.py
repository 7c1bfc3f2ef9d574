"""Deliberately wrong backends: each must fail the conformance kit. All delegate to the reference
and then break exactly one rule of docs/spec.md."""

from __future__ import annotations

import torch

import ssu
from ssu import slot_state
from ssu.reference.math import make_step


class _Base:
    NAME = "?"

    @ssu.hookimpl
    def ssu_backend(self):
        return ssu.BackendSpec(
            name=self.NAME,
            api_version=ssu.PLUGIN_API_VERSION,
            factory=self.factory,
            capabilities=ssu.Capabilities(devices={"cpu"}, max_tokens_per_step=4, speculative=True),
        )

    def factory(self, ctx):
        return make_step(ctx)

    ssu_allocate_state = staticmethod(slot_state.ssu_allocate_state)
    ssu_commit = staticmethod(slot_state.ssu_commit)
    ssu_read_state = staticmethod(slot_state.ssu_read_state)
    ssu_write_state = staticmethod(slot_state.ssu_write_state)


class WrongGate(_Base):
    """Gates with sigmoid(z) instead of z * sigmoid(z)."""

    NAME = "wrong-gate"

    def factory(self, ctx):
        step = make_step(ctx)

        def wrong(
            state,
            x,
            dt,
            A,
            B,
            C,
            slots,
            D=None,
            z=None,
            dt_bias=None,
            dt_softplus=False,
            out=None,
            layer=0,
            dst_slots=None,
        ):
            out = step(state, x, dt, A, B, C, slots, D, None, dt_bias, dt_softplus, out, layer, dst_slots)
            if z is not None:
                out.copy_((out.float() * torch.sigmoid(z.float())).to(out.dtype))
            return out

        return wrong


class TouchesNeighbour(_Base):
    """Also writes the slot after each sequence's own slot."""

    NAME = "touches-neighbour"

    def factory(self, ctx):
        step = make_step(ctx)
        S = ctx.problem.num_slots

        def wrong(
            state,
            x,
            dt,
            A,
            B,
            C,
            slots,
            D=None,
            z=None,
            dt_bias=None,
            dt_softplus=False,
            out=None,
            layer=0,
            dst_slots=None,
        ):
            out = step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)
            real = slots[slots >= 0].long()
            state.buffers["ssm"][layer, (real + 1) % S] *= 0.999
            return out

        return wrong


class IgnoresPadRows(_Base):
    """Treats the pad id as slot 0: reads and writes slot 0 for padded rows."""

    NAME = "ignores-pad-rows"

    def factory(self, ctx):
        step = make_step(ctx)
        pad = ctx.problem.pad_slot_id

        def wrong(
            state,
            x,
            dt,
            A,
            B,
            C,
            slots,
            D=None,
            z=None,
            dt_bias=None,
            dt_softplus=False,
            out=None,
            layer=0,
            dst_slots=None,
        ):
            return step(
                state,
                x,
                dt,
                A,
                B,
                C,
                torch.where(slots == pad, torch.zeros_like(slots), slots),
                D,
                z,
                dt_bias,
                dt_softplus,
                out,
                layer,
                dst_slots,
            )

        return wrong


class CommitsWrongToken(_Base):
    """Keeps the state after num_accepted - 1 tokens (at least one)."""

    NAME = "commits-wrong-token"

    @ssu.hookimpl
    def ssu_commit(self, ctx, state, slots, num_accepted):
        T = ctx.problem.tokens_per_step
        slot_state.commit(
            state, slots, torch.where(num_accepted > 1, num_accepted - 1, torch.full_like(num_accepted, T))
        )


BROKEN = [WrongGate, TouchesNeighbour, IgnoresPadRows, CommitsWrongToken]
