"""A correct backend written against plugin API 1.0, as its authors would have written it from
that version's guide: no ``guards_slots`` (its step and commit trust the ids and counts they are
given), no destination slots, a commit that moves cursors by whatever count it is handed. A newer
core must keep it conformant: with validation on, the core guards what it does not."""

from __future__ import annotations

import torch

import ssu
from ssu.state import slot_state
from ssu.reference.math import make_step


class ApiOneZero:
    """The reference's math and versioned-slot layout behind the plugin API 1.0 contract."""

    NAME = "api-one-zero"

    @ssu.hookimpl
    def ssu_backend(self):
        return ssu.BackendSpec(
            name=self.NAME,
            api_version="1.0",
            factory=self.factory,
            capabilities=ssu.Capabilities(devices={"cpu"}, max_tokens_per_step=4, speculative=True),
            description="a backend of plugin API 1.0",
        )

    @staticmethod
    def factory(ctx):
        step = make_step(ctx)

        def step_1_0(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0):
            return step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer)

        return step_1_0

    @ssu.hookimpl
    def ssu_commit(self, ctx, state, slots, num_accepted):
        """Every row but a pad row moves its slot's cursor by its count, whatever the count."""
        p = ctx.problem
        cursor = state.buffers["cursor"]
        sink = torch.full_like(slots, p.num_slots)  # the layout's spare cursor entry
        rows = torch.where(slots == p.pad_slot_id, sink, slots).long()
        moved = (cursor[rows] + num_accepted.to(cursor.dtype)) % slot_state.versions(p)
        cursor.index_put_((rows,), moved.to(cursor.dtype))

    ssu_allocate_state = staticmethod(slot_state.ssu_allocate_state)
    ssu_read_state = staticmethod(slot_state.ssu_read_state)
    ssu_write_state = staticmethod(slot_state.ssu_write_state)
