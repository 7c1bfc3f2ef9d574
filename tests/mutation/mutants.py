"""Mutants of the ``independent`` backend: each a subclass overriding one method with one small,
realistic bug that breaks one rule of docs/spec.md.

Every mutant has a class docstring stating its bug, ``RULE`` (a key of ``ssu.conformance.rules.RULES``), ``NAME``
(``mut-`` and its class name in kebab case) and ``SHOWN_BY``: a function ``(registry, name) ->
observation`` that makes one fixed call through ``ssu.open`` (:mod:`demos`), so that comparing the
mutant's observation with the ``independent`` backend's shows the bug without the conformance kit.
:data:`MUTANTS` lists them all.
"""

from __future__ import annotations

import re

import torch

import demos
from independent import (
    E_BUFFER_ROWS,
    E_DST_TABLE,
    E_OFFSETS,
    E_PARENTS,
    E_SLOT_TABLE,
    ENGINE_ARGUMENT,
    QMAX,
    SLOTS_ARGUMENT,
    SOFTPLUS_THRESHOLD,
    ARGUMENT_SHIFT,
    ROW_SHIFT,
    Deferred,
    Independent,
)
from ssu.contract.dtypes import to_torch


def _kebab(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", name).lower()


def show(scenario, **knobs):
    """``SHOWN_BY``: ``scenario(registry, name, **knobs)`` of :mod:`demos`."""

    def shown_by(registry, name):
        return scenario(registry, name, **knobs)

    shown_by.__doc__ = f"demos.{scenario.__name__}({', '.join(f'{k}={v!r}' for k, v in knobs.items())})"
    return staticmethod(shown_by)


def _dense_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _as_dense(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage from its first element read with dense row-major strides: what a kernel that
    ignores a view's strides sees."""
    return torch.as_strided(t, t.shape, _dense_strides(t.shape), t.storage_offset())


class Mutant(Independent):
    """A mutant of :class:`Independent`; its name is ``mut-`` and the class name in kebab case."""

    RULE = ""
    SHOWN_BY = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.NAME = "mut-" + _kebab(cls.__name__)


# shapes and layouts -----------------------------------------------------------------------------
class ReadsXAsDense(Mutant):
    """Reads x as if it were a dense tensor, ignoring its strides (a slice of a projection reads the wrong values)."""

    RULE = "layout/strided-views"
    SHOWN_BY = show(demos.step, layout="projection")

    def with_token_axis(self, p, tensors):
        x = tensors[0]
        dense = torch.as_strided(x, x.shape, _dense_strides(x.shape), x.storage_offset())
        return super().with_token_axis(p, [dense, *tensors[1:]])


class ReadsBCRowMajor(Mutant):
    """Reads each (G, N) block of B and C as row-major, honouring only the batch stride (a transposed view misreads)."""

    RULE = "layout/strided-views"
    SHOWN_BY = show(demos.step, layout="transposed")

    def per_head_rows(self, p, BC):
        N = BC.shape[-1]
        blocks = torch.as_strided(BC, BC.shape, (BC.stride(0), N, 1), BC.storage_offset())
        return super().per_head_rows(p, blocks)


class AssumesDenseTokenStride(Mutant):
    """Steps from one token of x to the next by H * P elements, as if each token's row were dense."""

    RULE = "layout/token-stride"
    SHOWN_BY = show(demos.speculative, layout="token-rows")

    def with_token_axis(self, p, tensors):
        x = tensors[0]
        if p.multi_token:
            H, P = x.shape[-2:]
            x = torch.as_strided(x, x.shape, (x.stride(0), H * P, x.stride(2), x.stride(3)), x.storage_offset())
        return super().with_token_axis(p, [x, *tensors[1:]])


# the math of one token --------------------------------------------------------------------------
class DtBiasIgnored(Mutant):
    """Leaves dt_bias out of the time step."""

    RULE = "one-token/dt-bias"
    SHOWN_BY = show(demos.step)

    def effective_dt(self, dt, dt_bias, dt_softplus):
        return super().effective_dt(dt, None, dt_softplus)


class DtBiasAfterSoftplus(Mutant):
    """Adds dt_bias after softplus instead of before it."""

    RULE = "one-token/dt-bias"
    SHOWN_BY = show(demos.step)

    def effective_dt(self, dt, dt_bias, dt_softplus):
        d = super().effective_dt(dt, None, dt_softplus)
        return d if dt_bias is None else d + dt_bias.float()


class SoftplusInInputDtype(Mutant):
    """Adds dt_bias and applies softplus in dt's dtype (bf16 or fp16) rather than in fp32."""

    RULE = "one-token/softplus"
    SHOWN_BY = show(demos.step, problem_fields=dict(input_dtype="bf16"))

    def effective_dt(self, dt, dt_bias, dt_softplus):
        d = dt if dt_bias is None else dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            d = self.softplus(d)
        return d.float()


class SoftplusThresholdOnRawDt(Mutant):
    """Tests softplus's threshold on dt before the bias and then returns that raw dt, dropping dt_bias above 20."""

    RULE = "one-token/softplus-threshold"
    SHOWN_BY = show(demos.step, dt=25.0)

    def effective_dt(self, dt, dt_bias, dt_softplus):
        d = super().effective_dt(dt, dt_bias, dt_softplus)
        if not dt_softplus:
            return d
        return torch.where(dt.float() > SOFTPLUS_THRESHOLD, dt.float(), d)


class SoftplusSaturatesAt20(Mutant):
    """Clamps softplus's argument at 20 to avoid overflow and drops the identity above it, so d never exceeds ~20."""

    RULE = "one-token/softplus-threshold"
    SHOWN_BY = show(demos.step, dt=30.0)

    def softplus(self, v):
        return torch.log1p(torch.exp(v.clamp(max=SOFTPLUS_THRESHOLD)))


class SoftplusAlwaysApplied(Mutant):
    """Applies softplus whether or not dt_softplus asks for it."""

    RULE = "one-token/softplus-flag"
    SHOWN_BY = show(demos.step, softplus=False, dt=0.3)

    def effective_dt(self, dt, dt_bias, dt_softplus):
        return super().effective_dt(dt, dt_bias, True)


class DecayAfterInflow(Mutant):
    """Decays the state after adding the token's inflow: exp(A d) (s + d x B) instead of exp(A d) s + d x B."""

    RULE = "one-token/decay"
    SHOWN_BY = show(demos.step)

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        d = self.effective_dt(dt, dt_bias, dt_softplus)
        xf = x.float()
        s = self.decay(A, d)[:, :, None, None] * (s + self.inflow(d, xf, self.per_head_rows(p, B)))
        y = self.readout(s, self.per_head_rows(p, C))
        return s, self.gate(self.skip(y, D, xf), z)


class LinearisedDecay(Mutant):
    """Approximates the decay exp(A d) by its first-order expansion 1 + A d."""

    RULE = "one-token/decay"
    SHOWN_BY = show(demos.step)

    def decay(self, A, d):
        return 1.0 + A.float() * d


class InflowWithoutDt(Mutant):
    """Adds x B to the state without the time step d."""

    RULE = "one-token/inflow"
    SHOWN_BY = show(demos.step)

    def inflow(self, d, x, Bh):
        return super().inflow(torch.ones_like(d), x, Bh)


class ReadoutBeforeUpdate(Mutant):
    """Reads the output out of the state before the token's update instead of after it."""

    RULE = "one-token/readout"
    SHOWN_BY = show(demos.step)

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        d = self.effective_dt(dt, dt_bias, dt_softplus)
        xf = x.float()
        y = self.readout(s, self.per_head_rows(p, C))
        s = self.decay(A, d)[:, :, None, None] * s + self.inflow(d, xf, self.per_head_rows(p, B))
        return s, self.gate(self.skip(y, D, xf), z)


class ReadoutWithB(Mutant):
    """Reads the output with B instead of C."""

    RULE = "one-token/readout"
    SHOWN_BY = show(demos.step)

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        return super().token_update(p, s, x, dt, A, B, B, D, z, dt_bias, dt_softplus)


class SkipMissing(Mutant):
    """Leaves out the skip connection D x."""

    RULE = "one-token/skip"
    SHOWN_BY = show(demos.step)

    def skip(self, y, D, x):
        return y


class SkipAfterGate(Mutant):
    """Adds D x after the gate instead of before it."""

    RULE = "one-token/gate"
    SHOWN_BY = show(demos.step)

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        d = self.effective_dt(dt, dt_bias, dt_softplus)
        xf = x.float()
        s = self.decay(A, d)[:, :, None, None] * s + self.inflow(d, xf, self.per_head_rows(p, B))
        y = self.readout(s, self.per_head_rows(p, C))
        return s, self.skip(self.gate(y, z), D, xf)


class GateSigmoidOnly(Mutant):
    """Gates with sigmoid(z) instead of z sigmoid(z)."""

    RULE = "one-token/gate"
    SHOWN_BY = show(demos.step)

    def gate(self, y, z):
        return y if z is None else y * torch.sigmoid(z.float())


class GroupsInterleaved(Mutant):
    """Gives head h the group h mod G instead of h // (H / G)."""

    RULE = "one-token/groups"
    SHOWN_BY = show(demos.step)

    def group_of_head(self, p, device):
        return torch.arange(p.nheads, device=device) % p.ngroups


# out --------------------------------------------------------------------------------------------
class OutNoneInFp32(Mutant):
    """Allocates an fp32 output when out is None, whatever x's dtype."""

    RULE = "step/out-none"
    SHOWN_BY = show(demos.step, out=False, problem_fields=dict(input_dtype="bf16"))

    def output_for(self, x, out):
        return torch.empty(x.shape, dtype=torch.float32, device=x.device) if out is None else out


class OutNoneWithTokenAxis(Mutant):
    """Returns a one-token step's output with the token axis it computes with, (b, 1, H, P), when out is None."""

    RULE = "step/out-none"
    SHOWN_BY = show(demos.step, out=False)

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        result = super().step(ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)
        return result.unsqueeze(1) if out is None and not ctx.problem.multi_token else result


class OutputBufferReused(Mutant):
    """Keeps one output tensor per shape on the backend object and returns it from every call with out=None, so a
    later call overwrites what an earlier call returned."""

    RULE = "step/out-none"
    SHOWN_BY = staticmethod(demos.output_kept)

    def output_for(self, x, out):
        if out is not None:
            return out
        kept = self.__dict__.setdefault("_outputs", {})
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in kept:
            kept[key] = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return kept[key]


class OutputIntoFreshTensor(Mutant):
    """Writes the output into a fresh tensor and returns it, leaving a given out unwritten."""

    RULE = "step/out-returned"
    SHOWN_BY = show(demos.step)

    def output_for(self, x, out):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# layers -----------------------------------------------------------------------------------------
class LayerIgnored(Mutant):
    """Reads and writes layer 0 whatever layer the call names."""

    RULE = "layers/independent"
    SHOWN_BY = show(demos.step, layer=1)

    def store_of(self, state, layer):
        return state.views[0]


class DraftsShareLayerZero(Mutant):
    """Keeps every layer's drafts in layer 0's slice of the draft buffer, so the last layer stepped wins them all."""

    RULE = "layers/independent"
    SHOWN_BY = show(demos.speculative)

    def layer_store(self, buffers, layer, current, current_scale):
        return super().layer_store(buffers, 0, current, current_scale)


class WriteStateIgnoresLayer(Mutant):
    """Installs write_state's values in layer 0 whatever layer is asked for."""

    RULE = "layers/independent"
    SHOWN_BY = show(demos.roundtrip, layer=1)

    def write_state(self, ctx, state, slots, values, layer):
        super().write_state(ctx, state, slots, values, 0)


class CommitMovesLayerZeroOnly(Mutant):
    """Commits only layer 0's drafts; the other layers of the state keep their old states."""

    RULE = "commit/every-layer"
    SHOWN_BY = show(demos.speculative)

    def commit(self, ctx, state, slots, num_accepted):
        p = ctx.problem
        moved = self.commit_rows(ctx, slots, num_accepted)
        idx = slots[moved].long()
        if not p.speculative or idx.numel() == 0:
            return
        drafts = self.choose_version(num_accepted[moved], p.tokens_per_step)
        self.commit_layer(p, self.store_of(state, 0), idx, drafts)


# pad rows ---------------------------------------------------------------------------------------
class PadReadsClampedSlot(Mutant):
    """Reads every row's start state at its id clamped into the cache, so a pad row reads a slot's state, not zero."""

    RULE = "pad/reads-zero"
    SHOWN_BY = show(demos.step)

    def start_states(self, p, store, ids, reads):
        return self.read_slot_state(p, store, ids.long().clamp(0, p.num_slots - 1))


class NullBlockReadAsZero(Mutant):
    """Reads a pad row's start state from the null block when the pad id names one, assuming it holds zeros; rows
    that store nothing write into that block, so a pad row reads what an earlier row left there (aliasing)."""

    RULE = "pad/reads-zero"
    SHOWN_BY = show(demos.step, adopt=True, problem_fields=dict(pad_slot_id=0))

    def start_states(self, p, store, ids, reads):
        if p.pad_in_cache:
            reads = reads | self.is_pad(p, ids)
        return super().start_states(p, store, ids, reads)


class PadOutputZeroed(Mutant):
    """Writes 0 as a pad row's output (as mamba_ssm does) instead of y from a zero state."""

    RULE = "pad/output-written"
    SHOWN_BY = show(demos.step)

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        out = super().step(ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)
        out[self.is_pad(ctx.problem, slots)] = 0
        return out


class PadOutputSkipped(Mutant):
    """Leaves a pad row's output as it was (a kernel that returns early for pad rows)."""

    RULE = "pad/output-written"
    SHOWN_BY = show(demos.step)

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        before = None if out is None else out.clone()
        result = super().step(ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)
        pad = self.is_pad(ctx.problem, slots)
        result[pad] = float("nan") if before is None else before[pad]
        return result


class OnlyMinusOneIsPad(Mutant):
    """Recognises only -1 as the pad id, whatever the problem's pad id is."""

    RULE = "pad/any-id"
    SHOWN_BY = show(demos.step, problem_fields=dict(pad_slot_id=-7))

    def is_pad(self, p, ids):
        return ids == -1


class PadPastTheEndIsOutside(Mutant):
    """Exempts the pad id from the outside-the-cache test only when it is negative, so a pad id past the cache's end
    is recorded as a fault."""

    RULE = "pad/any-id"
    SHOWN_BY = show(demos.step, problem_fields=dict(pad_slot_id=9))

    def outside_cache(self, p, ids):
        negative_pad = self.is_pad(p, ids) & (ids < 0)
        return ((ids < 0) | (ids >= p.num_slots)) & ~negative_pad


class PadRowWritesDestination(Mutant):
    """Lets a pad row write its state (from a zero start) to its destination when that names a slot."""

    RULE = "pad/writes-nothing"
    SHOWN_BY = show(demos.step, slots=(4, 1, "pad"), dst=(0, "pad", 3))

    def step_targets(self, ctx, slots, reads, dst_slots):
        if dst_slots is None:
            return slots, reads
        return dst_slots, self.rows_writing(ctx, dst_slots)


# destinations -----------------------------------------------------------------------------------
class WritesSourceNotDestination(Mutant):
    """Writes a row's new state to the slot it read, ignoring dst_slots."""

    RULE = "destinations/write-dst"
    SHOWN_BY = show(demos.step, slots=(4, 1, 2), dst=(0, 3, 5))

    def step_targets(self, ctx, slots, reads, dst_slots):
        _, writes = super().step_targets(ctx, slots, reads, dst_slots)
        return slots, writes


class PadDestinationWritesSource(Mutant):
    """Writes a row whose destination is the pad id back to its own slot instead of writing nothing."""

    RULE = "destinations/pad-dst"
    SHOWN_BY = show(demos.step, slots=(4, 1, 2), dst=(0, "pad", 5))

    def step_targets(self, ctx, slots, reads, dst_slots):
        if dst_slots is None:
            return slots, reads
        targets = torch.where(self.is_pad(ctx.problem, dst_slots), slots, dst_slots)
        return targets, reads & self.rows_writing(ctx, targets)


# guarded ids and the fault record ---------------------------------------------------------------
class OutsideIdsNotRecorded(Mutant):
    """Serves a row whose id lies outside the cache as a pad row but does not record it."""

    RULE = "guarded/recorded"
    SHOWN_BY = show(demos.step, slots=(4, 1, 9, 2))

    def rows_reading(self, ctx, slots):
        return self.names_slot(ctx.problem, slots)


class RecordsLastOffendingRow(Mutant):
    """Records the largest key of a call's refused rows instead of the smallest, naming the last such row."""

    RULE = "guarded/key"
    SHOWN_BY = show(demos.step, slots=(4, -3, 9, 2))

    def record_fault(self, ctx, bad, rows, argument, values):
        if not bool(bad.any()):
            return
        keys = self.fault_key(rows, argument, values)
        keys = torch.broadcast_to(keys, bad.shape)[bad]
        torch.minimum(ctx.faults, keys.max().reshape(1), out=ctx.faults)


class FaultValueNotMasked(Mutant):
    """Puts the refused id into its key without masking it to 32 bits, so a negative id sign-extends over the row
    and argument fields."""

    RULE = "guarded/key"
    SHOWN_BY = show(demos.step, slots=(4, 1, -3, 2))

    def fault_key(self, rows, argument, values):
        return (rows.to(torch.int64) << ROW_SHIFT) | (argument << ARGUMENT_SHIFT) | values.to(torch.int64)


class DestinationFaultAsSlots(Mutant):
    """Records a destination outside the cache under argument 0 (slots) instead of 1 (dst_slots)."""

    RULE = "guarded/argument-code"
    SHOWN_BY = show(demos.step, slots=(4, 1, 2), dst=(0, 11, 5))

    def rows_writing(self, ctx, dst_slots):
        self.record_id_faults(ctx, dst_slots, SLOTS_ARGUMENT)
        return self.names_slot(ctx.problem, dst_slots)


class OutsideIdsWrittenClamped(Mutant):
    """Masks only pad rows out of a step's write and clamps the ids into the cache, so a row whose id lies outside
    the cache writes its state into slot 0 or the last slot."""

    RULE = "guarded/no-touch"
    SHOWN_BY = show(demos.step, slots=(4, 1, 9, 2))

    def step_targets(self, ctx, slots, reads, dst_slots):
        p = ctx.problem
        targets, _ = super().step_targets(ctx, slots, reads, dst_slots)
        writes = ~self.is_pad(p, slots) & ~self.is_pad(p, targets)
        return targets.clamp(0, p.num_slots - 1), writes


class OutsideIdsReadClamped(Mutant):
    """Reads a row whose id lies outside the cache at that id clamped into the cache instead of from a zero state."""

    RULE = "guarded/no-touch"
    SHOWN_BY = show(demos.step, slots=(4, 1, 9, 2))

    def start_states(self, p, store, ids, reads):
        outside = self.outside_cache(p, ids)
        safe = torch.where(outside, ids.clamp(0, p.num_slots - 1), ids)
        return super().start_states(p, store, safe, reads | outside)


class IdsTruncatedToInt32(Mutant):
    """Converts slot ids to int32 before using them, so an int64 id 2^32 + k outside the cache becomes slot k."""

    RULE = "guarded/index-dtype"
    SHOWN_BY = show(demos.step, slots=(4, 1, 2**32 + 3, 2), index=torch.int64)

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        slots = slots.to(torch.int32)
        dst_slots = None if dst_slots is None else dst_slots.to(torch.int32)
        return super().step(ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)


# speculative steps ------------------------------------------------------------------------------
class SpeculativeStepWritesLastToken(Mutant):
    """Also stores a speculative step's last token state as the current state, changing it before the commit."""

    RULE = "spec/step-leaves-state"
    SHOWN_BY = show(demos.speculative, commit=False)

    def store_drafts(self, p, store, ids, writes, token, values):
        super().store_drafts(p, store, ids, writes, token, values)
        if token == p.tokens_per_step - 1:
            self.store_states(p, store, ids, writes, values)


class TokensBackToFront(Mutant):
    """Applies a speculative step's tokens from the last to the first."""

    RULE = "spec/token-order"
    SHOWN_BY = show(demos.speculative)

    def with_token_axis(self, p, tensors):
        if p.multi_token:
            tensors = [t if t is None or i == 5 else t.flip(1) for i, t in enumerate(tensors)]
        return super().with_token_axis(p, tensors)


class OutputsAtLastToken(Mutant):
    """Writes every token's output at the last token's position of out (index -1 for the token index)."""

    RULE = "spec/per-token-outputs"
    SHOWN_BY = show(demos.speculative)

    def emit_output(self, outs, token, y):
        outs[:, -1] = y.to(outs.dtype)


class StartsFromNewestDraft(Mutant):
    """Starts a speculative step from the newest draft of the slot (the last step's last token) rather than from
    its committed state."""

    RULE = "spec/starts-from-committed"
    SHOWN_BY = show(demos.speculative)

    def start_states(self, p, store, ids, reads):
        if store.drafts is None:
            return super().start_states(p, store, ids, reads)
        s = torch.zeros(ids.shape[0], p.nheads, p.headdim, p.dstate, dtype=torch.float32, device=ids.device)
        idx = ids[reads].long()
        newest = store.drafts[idx, -1]
        s[reads] = self.dequantize_row(newest, store.draft_scale[idx, -1]) if p.quantized else newest.float()
        return s


# commits ----------------------------------------------------------------------------------------
class CommitKeepsOneTooMany(Mutant):
    """Keeps the state after num_accepted + 1 tokens (the last draft at most)."""

    RULE = "commit/accepted-count"
    SHOWN_BY = show(demos.speculative)

    def choose_version(self, num_accepted, tokens):
        return num_accepted.long().clamp(max=tokens - 1)


class CommitKeepsEveryToken(Mutant):
    """Keeps the state after all T tokens whatever num_accepted says."""

    RULE = "commit/accepted-count"
    SHOWN_BY = show(demos.speculative)

    def choose_version(self, num_accepted, tokens):
        return torch.full_like(num_accepted.long(), tokens - 1)


class CommitTrustsCounts(Mutant):
    """Moves every real slot whatever its count, so a count of 0 takes the last draft (index -1) and one above T
    indexes past the drafts."""

    RULE = "commit/count-guard"
    SHOWN_BY = show(demos.speculative, accepted=(0, 1, 1, 3))

    def commit_rows(self, ctx, slots, num_accepted):
        p = ctx.problem
        rows = torch.arange(slots.shape[0], device=slots.device)
        self.record_fault(ctx, self.outside_cache(p, slots), rows, SLOTS_ARGUMENT, slots)
        return self.names_slot(p, slots)


class CountFaultNotRecorded(Mutant):
    """Leaves a slot whose count lies outside 1..T as it was, but does not record the count."""

    RULE = "commit/count-recorded"
    SHOWN_BY = show(demos.speculative, accepted=(0, 1, 1, 3))

    def commit_rows(self, ctx, slots, num_accepted):
        p = ctx.problem
        rows = torch.arange(slots.shape[0], device=slots.device)
        self.record_fault(ctx, self.outside_cache(p, slots), rows, SLOTS_ARGUMENT, slots)
        counted = (num_accepted >= 1) & (num_accepted <= p.tokens_per_step)
        return self.names_slot(p, slots) & counted


class CommitMovesPadRows(Mutant):
    """Moves pad rows too, so a pad id of -1, used as a tensor index, commits the last slot's stale drafts."""

    RULE = "commit/pad-rows"
    SHOWN_BY = show(demos.speculative)

    def commit_rows(self, ctx, slots, num_accepted):
        moved = super().commit_rows(ctx, slots, num_accepted)
        counted = (num_accepted >= 1) & (num_accepted <= ctx.problem.tokens_per_step)
        return moved | (self.is_pad(ctx.problem, slots) & counted)


# adopted caches ---------------------------------------------------------------------------------
class AdoptsACopy(Mutant):
    """Steps a private copy of an adopted cache, so the engine's tensors never change."""

    RULE = "adopted/in-place"
    SHOWN_BY = show(demos.step, adopt=True)

    def adopt(self, ctx, cache, scales):
        state = super().adopt(ctx, cache, scales)
        state.views = tuple(
            store._replace(
                current=store.current.clone(),
                current_scale=None if store.current_scale is None else store.current_scale.clone(),
            )
            for store in state.views
        )
        return state


class AdoptedScalesCopied(Mutant):
    """Stacks an adopted 8-bit cache's per-layer scales into one new tensor, so steps write that copy and the
    engine's scales go stale."""

    RULE = "adopted/in-place"
    SHOWN_BY = show(demos.step, adopt=True, problem_fields=dict(state_dtype="int8"))

    def adopt(self, ctx, cache, scales):
        copied = tuple(torch.stack(list(scales))) if scales else scales
        state = super().adopt(ctx, cache, copied)
        state.scales = tuple(scales)
        return state


class IgnoresSlotStride(Mutant):
    """Treats an adopted cache (and its scales) as dense slot blocks, ignoring the slot stride of the view."""

    RULE = "adopted/slot-stride"
    SHOWN_BY = show(demos.step, adopt=True)

    def adopt(self, ctx, cache, scales):
        def dense(t):
            return torch.as_strided(t, t.shape, _dense_strides(t.shape), t.storage_offset())

        state = super().adopt(ctx, tuple(dense(c) for c in cache), tuple(dense(s) for s in scales))
        state.cache, state.scales = tuple(cache), tuple(scales)
        return state


# read_state and write_state ---------------------------------------------------------------------
class WriteStateTruncatesBf16(Mutant):
    """Rounds the values write_state installs in a bf16 cache toward zero instead of to nearest."""

    RULE = "state-io/write-rounding"
    SHOWN_BY = show(demos.roundtrip, problem_fields=dict(state_dtype="bf16"))

    def write_state(self, ctx, state, slots, values, layer):
        if ctx.problem.state_dtype == "bf16":
            bits = values.float().contiguous().view(torch.int32) & -65536
            values = bits.view(torch.float32)
        super().write_state(ctx, state, slots, values, layer)


class ReadStateNotDequantised(Mutant):
    """Returns an 8-bit cache's raw values from read_state, without their row scales."""

    RULE = "state-io/read-dequantised"
    SHOWN_BY = show(demos.roundtrip, problem_fields=dict(state_dtype="int8"))

    def read_state(self, ctx, state, slots, layer):
        if not ctx.problem.quantized:
            return super().read_state(ctx, state, slots, layer)
        return self.store_of(state, layer).current[slots.long()].float()


class ReadStateInSlotOrder(Mutant):
    """Returns read_state's rows in ascending slot order rather than in the order the slots were asked for."""

    RULE = "state-io/read-slots"
    SHOWN_BY = show(demos.roundtrip, slots=(4, 1))

    def read_state(self, ctx, state, slots, layer):
        return super().read_state(ctx, state, slots.sort().values, layer)


class StepStoreTruncatesBf16(Mutant):
    """Rounds the states a step stores in a bf16 cache toward zero instead of to nearest (within one step's
    budget, a lean over a decode)."""

    RULE = "one-token/store-rounding"
    SHOWN_BY = show(demos.step, problem_fields=dict(state_dtype="bf16"))

    def store_states(self, p, store, ids, writes, values):
        if p.state_dtype == "bf16":
            values = (values.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
        super().store_states(p, store, ids, writes, values)


class ReadStateReusesStagingRows(Mutant):
    """Keeps one staging tensor per shape on the backend and returns it from every read_state, so a later read
    overwrites what an earlier one returned."""

    RULE = "state-io/read-owns"
    SHOWN_BY = show(demos.state_values, kind="held")

    def read_state(self, ctx, state, slots, layer):
        values = super().read_state(ctx, state, slots, layer)
        staging = self.__dict__.setdefault("staging", {})
        rows = staging.setdefault((tuple(values.shape), values.device), torch.empty_like(values))
        return rows.copy_(values)


class ReadStateViewsTheCache(Mutant):
    """Returns a view of an fp32 cache instead of a copy when the slots asked for are one ascending run (no
    gather needed), so editing the result edits the state."""

    RULE = "state-io/read-owns"
    SHOWN_BY = show(demos.state_values, kind="edited")

    def read_state(self, ctx, state, slots, layer):
        store = self.store_of(state, layer)
        ids = slots.long()
        first = int(ids[0]) if ids.numel() else 0
        if store.current.dtype == torch.float32 and torch.equal(ids, torch.arange(first, first + ids.numel())):
            return store.current[first : first + ids.numel()]
        return super().read_state(ctx, state, slots, layer)


class Fp16StoreSaturatesEarly(Mutant):
    """Clamps every state stored in an fp16 cache to +-2^14, far inside fp16's range, as a kernel guarding against
    overflow with too tight a bound."""

    RULE = "state-io/write-rounding"
    SHOWN_BY = show(demos.state_values, kind="large", problem_fields=dict(state_dtype="fp16"))

    def round_to_cache(self, values, dtype):
        if dtype == torch.float16:
            values = values.clamp(-(2.0**14), 2.0**14)
        return super().round_to_cache(values, dtype)


class ZeroRowScaleUnguarded(Mutant):
    """Divides a row by its scale without guarding a zero scale, so a row of zeros in an fp8_e4m3 cache stores
    0 / 0: NaN."""

    RULE = "quantised/row-scale"
    SHOWN_BY = show(demos.state_values, kind="zero-row", problem_fields=dict(state_dtype="fp8_e4m3"))

    def quantize_row(self, values, state_dtype):
        values = values.float()
        qmax = QMAX[state_dtype]
        scale = self.row_scale(values, qmax)
        return self.to_grid(values / scale[..., None], state_dtype, qmax), scale


class WrittenScaleNeverShrinks(Mutant):
    """Keeps a slot's row scale when a new row is smaller (scales only grow), so a slot that held a large
    sequence quantises its next occupant on the old, coarse grid."""

    RULE = "quantised/fresh-scale"
    SHOWN_BY = show(demos.state_values, kind="shrinking", problem_fields=dict(state_dtype="int8"))

    def write_slot_state(self, p, store, idx, values):
        if not p.quantized:
            return super().write_slot_state(p, store, idx, values)
        values = values.float()
        qmax = QMAX[p.state_dtype]
        scale = torch.maximum(self.row_scale(values, qmax), store.current_scale[idx])
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        store.current[idx] = self.to_grid(values / divisor[..., None], p.state_dtype, qmax)
        store.current_scale[idx] = scale


class WriteStateIntoNewestDraft(Mutant):
    """In a speculative state, installs write_state's values as the newest draft instead of the current state."""

    RULE = "state-io/write-current"
    SHOWN_BY = show(demos.roundtrip, problem_fields=dict(speculative=True, tokens_per_step=2))

    def write_state(self, ctx, state, slots, values, layer):
        p = ctx.problem
        store = self.store_of(state, layer)
        if store.drafts is None:
            return super().write_state(ctx, state, slots, values, layer)
        self.write_draft(p, store, slots.long(), p.tokens_per_step - 1, values.float())


# warmup -----------------------------------------------------------------------------------------
class WarmupStepsFirstSlot(Mutant):
    """Warms up by running one step on slot 0 of the state it is given (the first real slot), which moves that
    slot's state."""

    RULE = "warmup/state-intact"
    SHOWN_BY = staticmethod(demos.warmup)

    def warmup(self, ctx, state, step):
        p = ctx.problem
        lead = (1, p.tokens_per_step) if p.multi_token else (1,)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[p.input_dtype]
        x = torch.zeros(*lead, p.nheads, p.headdim, dtype=dtype)
        dt = torch.zeros(*lead, p.nheads, dtype=dtype)
        BC = torch.zeros(*lead, p.ngroups, p.dstate, dtype=dtype)
        first = 1 if p.pad_slot_id == 0 else 0
        step(state, x, dt, -torch.ones(p.nheads), BC, BC, torch.tensor([first]), dt_softplus=True)


class WarmupRestoresThroughBf16(Mutant):
    """Saves every layer's states in bf16 before its trial work and copies them back, so fp32 and fp16 states come
    back rounded."""

    RULE = "warmup/state-intact"
    SHOWN_BY = staticmethod(demos.warmup)

    def warmup(self, ctx, state, step):
        for layer in range(state.num_layers):
            current = self.store_of(state, layer).current
            current.copy_(current.to(torch.bfloat16))


# quantised states -------------------------------------------------------------------------------
class ScalePerHead(Mutant):
    """Gives every row of a head the head's largest magnitude over QMAX as its scale instead of the row's own."""

    RULE = "quantised/row-scale"
    SHOWN_BY = show(demos.step, problem_fields=dict(state_dtype="int8"))

    def row_scale(self, values, qmax):
        head = values.abs().amax(dim=(-2, -1), keepdim=True)[..., 0] / qmax
        return head.expand(values.shape[:-1])


class ScaleNeverShrinks(Mutant):
    """Keeps a slot's old row scale when the new row is smaller, so a decaying row loses resolution."""

    RULE = "quantised/fresh-scale"
    SHOWN_BY = show(demos.step, problem_fields=dict(state_dtype="int8"), dt=0.5)

    def write_slot_state(self, p, store, idx, values):
        if not p.quantized:
            return super().write_slot_state(p, store, idx, values)
        values = values.float()
        qmax = QMAX[p.state_dtype]
        scale = torch.maximum(self.row_scale(values, qmax), store.current_scale[idx])
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        store.current[idx] = self.to_grid(values / divisor[..., None], p.state_dtype, qmax)
        store.current_scale[idx] = scale


class Int8RoundsTowardZero(Mutant):
    """Truncates an int8 state's values toward zero instead of rounding them to nearest."""

    RULE = "quantised/round-nearest"
    SHOWN_BY = show(demos.roundtrip, problem_fields=dict(state_dtype="int8"))

    def to_grid(self, ratio, state_dtype, qmax):
        if state_dtype == "int8":
            return torch.trunc(ratio).clamp(-qmax, qmax).to(torch.int8)
        return super().to_grid(ratio, state_dtype, qmax)


class ScaleStoredAsRowMaximum(Mutant):
    """Stores a row's largest magnitude as its scale instead of that magnitude over QMAX (the 8-bit values right)."""

    RULE = "quantised/scale-format"
    SHOWN_BY = show(demos.roundtrip, problem_fields=dict(state_dtype="int8"))

    def quantize_row(self, values, state_dtype):
        q, scale = super().quantize_row(values, state_dtype)
        return q, scale * QMAX[state_dtype]


class Fp8ClampedToInt8Range(Mutant):
    """Clamps fp8_e4m3 values to +-127 (int8's bound) while scaling rows to 448, so a row's larger values saturate."""

    RULE = "quantised/fp8-saturation"
    SHOWN_BY = show(demos.roundtrip, problem_fields=dict(state_dtype="fp8_e4m3"))

    def to_grid(self, ratio, state_dtype, qmax):
        if state_dtype == "fp8_e4m3":
            return ratio.clamp(-127.0, 127.0).to(torch.float8_e4m3fn)
        return super().to_grid(ratio, state_dtype, qmax)


class PadRowScalesWritten(Mutant):
    """Writes the row scales of every row of a step, a row that stores nothing at its id clamped into the cache, so
    the scales of slot 0 (or the last slot) change under that slot's values."""

    RULE = "quantised/pad-untouched"
    SHOWN_BY = show(demos.step, problem_fields=dict(state_dtype="int8"))

    def store_states(self, p, store, ids, writes, values):
        super().store_states(p, store, ids, writes, values)
        if p.quantized and bool((~writes).any()):
            idx = ids[~writes].long().clamp(0, p.num_slots - 1)
            store.current_scale[idx] = self.row_scale(values[~writes].float(), QMAX[p.state_dtype])


class DraftScalesNotWritten(Mutant):
    """Writes a draft's 8-bit values but not its row scales, so a commit pairs them with stale scales."""

    RULE = "quantised/scales-with-values"
    SHOWN_BY = show(demos.speculative, problem_fields=dict(state_dtype="int8"))

    def write_draft(self, p, store, idx, token, values):
        if not p.quantized:
            return super().write_draft(p, store, idx, token, values)
        store.drafts[idx, token] = self.quantize_row(values, p.state_dtype)[0]


# error budgets ----------------------------------------------------------------------------------
class Fp32StateAtBf16Precision(Mutant):
    """Rounds every state it writes to an fp32 cache through bf16."""

    RULE = "budgets/state-precision"
    SHOWN_BY = show(demos.step, problem_fields=dict(input_dtype="bf16"))

    def round_to_cache(self, values, dtype):
        if dtype == torch.float32:
            values = values.to(torch.bfloat16)
        return values.to(dtype)


class StateInBf16BetweenTokens(Mutant):
    """Holds the state in bf16 between tokens (bf16 registers), rounding it after every token."""

    RULE = "budgets/chained-tokens"
    SHOWN_BY = show(demos.speculative)

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        s, y = super().token_update(p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
        return s.to(torch.bfloat16).float(), y


class OutputFromStoredState(Mutant):
    """Computes the output from the new state rounded to the cache dtype instead of from the fp32 state."""

    RULE = "budgets/output-from-fp32"
    SHOWN_BY = show(demos.step, problem_fields=dict(state_dtype="bf16"))

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        d = self.effective_dt(dt, dt_bias, dt_softplus)
        xf = x.float()
        s = self.decay(A, d)[:, :, None, None] * s + self.inflow(d, xf, self.per_head_rows(p, B))
        if p.quantized:
            stored = self.dequantize_row(*self.quantize_row(s, p.state_dtype))
        else:
            stored = self.round_to_cache(s, {"fp32": torch.float32, "bf16": torch.bfloat16,
                                              "fp16": torch.float16}[p.state_dtype]).float()  # fmt: skip
        y = self.readout(stored, self.per_head_rows(p, C))
        return s, self.gate(self.skip(y, D, xf), z)


# vLLM's packed call -----------------------------------------------------------------------------
class PackedStartsAtCountColumn(Mutant):
    """Starts a packed sequence from column num_accepted of its slot table instead of num_accepted - 1."""

    RULE = "engine/packed-start-column"
    SHOWN_BY = show(demos.packed)

    def packed_start_column(self, ctx, num_accepted, sequences, width, valid):
        column, counted = super().packed_start_column(ctx, num_accepted, sequences, width, valid)
        if num_accepted is None:
            return column, counted
        return torch.where(counted, num_accepted.long().clamp(0, width - 1), column), counted


class PackedIgnoresCounts(Mutant):
    """Starts every packed sequence from column 0 of its slot table, ignoring num_accepted."""

    RULE = "engine/packed-start-column"
    SHOWN_BY = show(demos.packed)

    def packed_start_column(self, ctx, num_accepted, sequences, width, valid):
        column, counted = super().packed_start_column(ctx, num_accepted, sequences, width, valid)
        return torch.zeros_like(column), counted


class PackedStoresLastTokenOnly(Mutant):
    """Stores only a packed sequence's state after its last token, skipping the cells of the tokens before it."""

    RULE = "engine/packed-per-token-dst"
    SHOWN_BY = show(demos.packed)

    def packed_store(self, p, store, cells, keep, s, token, length):
        super().packed_store(p, store, cells, keep & (length == token + 1), s, token, length)


class PackedInclusiveOffsets(Mutant):
    """Reads cu_seqlens[n + 1] as sequence n's last row rather than one past it, giving each sequence one token more."""

    RULE = "engine/packed-offsets"
    SHOWN_BY = show(demos.packed)

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        if cu_seqlens is None:
            return super().packed_sequences(ctx, cu_seqlens, tokens, width)
        cu = cu_seqlens.long()
        first, end = cu[:-1], cu[1:] + 1
        length = end - first
        valid = (first >= 0) & (length >= 0) & (length <= width) & (end <= tokens)
        sequence = torch.arange(first.shape[0], device=cu.device)
        self.record_engine_fault(ctx, ~valid, E_OFFSETS, sequence, torch.zeros_like(sequence), end)
        return first, torch.where(valid, length, torch.zeros_like(length)), valid


class PackedEmptySequenceTakesAToken(Mutant):
    """Gives a packed sequence of zero tokens one token (the row at its offset), so it writes an output row and a
    state it does not own."""

    RULE = "engine/packed-zero-length"
    SHOWN_BY = show(demos.packed)

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        first, length, valid = super().packed_sequences(ctx, cu_seqlens, tokens, width)
        return first, torch.where(valid, length.clamp(min=1), length), valid


class PackedPaddedSequenceWrites(Mutant):
    """Lets a packed sequence whose start cell is the pad id store its states (from a zero start) in its cells."""

    RULE = "engine/packed-pad-start"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, "pad"]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        return super().packed_dst_cells(ctx, cells, live, torch.ones_like(real), sequence, token)


class PackedPadCellWrapsToLastSlot(Mutant):
    """Stores a packed token whose destination cell is a negative pad id at that id used as a tensor index, which
    wraps to the cache's last slots."""

    RULE = "engine/packed-pad-cell"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], [7, "pad", 9], [10, 11, 12]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        keep = super().packed_dst_cells(ctx, cells, live, real, sequence, token)
        return keep | (live & real & self.is_pad(ctx.problem, cells))


class PackedDstFaultNotRecorded(Mutant):
    """Skips a packed token's destination cell outside the cache without recording it."""

    RULE = "engine/packed-guards"
    SHOWN_BY = show(demos.packed, table=[[30, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        return live & real & self.names_slot(ctx.problem, cells)


class PackedStartFaultNotRecorded(Mutant):
    """Serves a packed sequence whose start cell lies outside the cache as padded without recording it."""

    RULE = "engine/packed-guards"
    SHOWN_BY = show(demos.packed, table=[[1, 40, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])

    def packed_start(self, ctx, table, column, has_tokens, sequence):
        start = table.gather(1, column[:, None])[:, 0]
        return start, has_tokens & self.names_slot(ctx.problem, start)


class PackedCountClamped(Mutant):
    """Clamps a packed sequence's count into 0..W instead of padding that sequence and recording the count."""

    RULE = "engine/packed-guards"
    SHOWN_BY = show(demos.packed, accepted=(5, 1, 0, 3))

    def packed_start_column(self, ctx, num_accepted, sequences, width, valid):
        if num_accepted is None:
            return super().packed_start_column(ctx, num_accepted, sequences, width, valid)
        count = num_accepted.long().clamp(0, width)
        return (count - 1).clamp(min=0), torch.ones_like(valid)


class PackedDstFaultUnderStartCode(Mutant):
    """Records a packed destination cell outside the cache with the slot table's code (0), not the destination
    table's (1)."""

    RULE = "engine/fault-key"
    SHOWN_BY = show(demos.packed, table=[[30, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        p = ctx.problem
        writing = live & real
        tokens = torch.full_like(sequence, token)
        self.record_engine_fault(ctx, writing & self.outside_cache(p, cells), E_SLOT_TABLE, sequence, tokens, cells)
        return writing & self.names_slot(p, cells)


class PackedFaultTokenZero(Mutant):
    """Records a packed destination cell outside the cache with token field 0, whatever its column."""

    RULE = "engine/fault-key"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], [7, 40, 9], [10, 11, 12]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        p = ctx.problem
        writing = live & real
        zero = torch.zeros_like(sequence)
        self.record_engine_fault(ctx, writing & self.outside_cache(p, cells), E_DST_TABLE, sequence, zero, cells)
        return writing & self.names_slot(p, cells)


class PackedTableReadAsDense(Mutant):
    """Reads the (N, W) slot table as a dense row-major table (cell (n, t) at n * W + t), ignoring its strides, so
    a transposed table gives each sequence the wrong cells."""

    RULE = "engine/index-layout"
    SHOWN_BY = show(demos.packed, table_layout="transposed")

    def packed_step(self, ctx, state, x, dt, A, B, C, slots, *rest):
        return super().packed_step(ctx, state, x, dt, A, B, C, _as_dense(slots), *rest)


class PackedDstTableWithSlotStrides(Mutant):
    """Indexes the destination table with the slot table's strides (one stride pair for both tables, as when vLLM
    passes one table as both), so a destination table of another layout is misread."""

    RULE = "engine/index-layout"
    SHOWN_BY = show(demos.packed, dst_table=[[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], dst_layout="column-slice")

    def packed_step(self, ctx, state, x, dt, A, B, C, slots, dst_slots, *rest):
        if dst_slots is not None:
            dst_slots = torch.as_strided(dst_slots, dst_slots.shape, slots.stride(), dst_slots.storage_offset())
        return super().packed_step(ctx, state, x, dt, A, B, C, slots, dst_slots, *rest)


class PackedInputsReadDense(Mutant):
    """Steps through the packed x, B and C by their dense token size (H * P and G * N values a row) instead of their
    row strides, so inputs sliced from one projection output (vLLM's xBC) are misread."""

    RULE = "layout/strided-views"
    SHOWN_BY = show(demos.packed, layout="projection")

    def packed_step(self, ctx, state, x, dt, A, B, C, *rest):
        return super().packed_step(ctx, state, _as_dense(x), dt, A, _as_dense(B), _as_dense(C), *rest)


class PackedOutWrittenDense(Mutant):
    """Writes a packed call's outputs as if out were dense (H * P values a row), so an out whose rows lie apart gets
    its values in the wrong places."""

    RULE = "layout/strided-views"
    SHOWN_BY = show(demos.packed, out="strided")

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        view = None if out is None else _as_dense(out)
        result = super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
            view, layer,
        )  # fmt: skip
        return result if out is None else out


class PackedReturnsFreshOut(Mutant):
    """Writes a packed call's outputs into a fresh tensor and returns it, leaving a given out unwritten."""

    RULE = "step/out-returned"
    SHOWN_BY = show(demos.packed)

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        return super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
            None, layer,
        )  # fmt: skip


class PackedZeroesUnownedOutRows(Mutant):
    """Clears a given out before a packed call, so the rows no sequence owns (padding past the last offset) are
    written with zeros."""

    RULE = "engine/packed-unowned-out"
    SHOWN_BY = show(demos.packed, rows=8)

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        if out is not None:
            out.zero_()
        return super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
            out, layer,
        )  # fmt: skip


class PackedOffsetsCountedFromZero(Mutant):
    """Places the packed sequences from row 0 (offsets less cu_seqlens[0]), so offsets that start past row 0 shift
    every sequence onto rows it does not own."""

    RULE = "engine/packed-offsets"
    SHOWN_BY = show(demos.packed, cu=(1, 3, 3, 6, 7), rows=8)

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        shifted = None if cu_seqlens is None else cu_seqlens - cu_seqlens[0]
        return super().packed_sequences(ctx, shifted, tokens, width)


class PackedDstDefaultsToColumnZero(Mutant):
    """Without dst_slots, stores every token's state in column 0 of the slot table (the one-token layout) instead
    of in slots[n, t]."""

    RULE = "engine/defaults"
    SHOWN_BY = show(demos.packed)

    def packed_step(self, ctx, state, x, dt, A, B, C, slots, dst_slots, *rest):
        if dst_slots is None:
            dst_slots = slots[:, :1].expand(-1, slots.shape[1])
        return super().packed_step(ctx, state, x, dt, A, B, C, slots, dst_slots, *rest)


class PackedCountsIgnoredWithoutOffsets(Mutant):
    """Ignores num_accepted when cu_seqlens is absent (its one-token path), starting every sequence from column 0
    instead of column num_accepted - 1."""

    RULE = "engine/packed-start-column"
    SHOWN_BY = show(demos.packed, lengths=(1, 1, 1, 1), offsets=False)

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        counts = None if cu_seqlens is None else num_accepted
        return super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, counts, cu_seqlens, D, z, dt_bias, dt_softplus, out, layer,
        )  # fmt: skip


class PackedAllAcceptedWithoutCounts(Mutant):
    """Without num_accepted, takes every count as W (every draft accepted) and starts each sequence from column
    W - 1 instead of column 0."""

    RULE = "engine/defaults"
    SHOWN_BY = show(demos.packed, accepted=None)

    def packed_start_column(self, ctx, num_accepted, sequences, width, valid):
        if num_accepted is None:
            num_accepted = torch.full((sequences,), width, dtype=torch.int32, device=valid.device)
        return super().packed_start_column(ctx, num_accepted, sequences, width, valid)


class PackedDstFaultStopsSequence(Mutant):
    """Stops storing a packed sequence's states at its first destination cell outside the cache (recorded): the
    tokens after that cell store nothing."""

    RULE = "engine/packed-guards"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], [7, 40, 9], [10, 11, 12]])

    def packed_step(self, ctx, state, x, dt, A, B, C, slots, dst_slots, *rest):
        p = ctx.problem
        cells = slots if dst_slots is None else dst_slots
        bad = self.outside_cache(p, cells).long()
        after = (bad.cumsum(1) - bad) > 0
        cells = torch.where(after, torch.full_like(cells, p.pad_slot_id), cells)
        return super().packed_step(ctx, state, x, dt, A, B, C, slots, cells, *rest)


class PackedUnusedCellRecorded(Mutant):
    """Checks a packed sequence's destination cell in every column the call steps through, token or not, so a bad
    id in a column past the sequence's last token (a cell no token uses) is recorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 40], [4, 5, 6], [7, 8, 9], [10, 11, 12]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        return live & super().packed_dst_cells(ctx, cells, torch.ones_like(live), real, sequence, token)


class PackedEmptyStartCellRecorded(Mutant):
    """Checks the start cell of every packed sequence, so a bad id in the start cell of a sequence with no tokens
    is recorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [40, 5, 6], [7, 8, 9], [10, 11, 12]])

    def packed_start(self, ctx, table, column, has_tokens, sequence):
        start, real = super().packed_start(ctx, table, column, torch.ones_like(has_tokens), sequence)
        return start, real & has_tokens


class PackedPaddedDstCellRecorded(Mutant):
    """Checks the destination cells of a padded packed sequence's tokens (cells it never writes), so a bad id there
    is recorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], ["pad", 40, 9], [10, 11, 12]])

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        p = ctx.problem
        tokens = torch.full_like(sequence, token)
        self.record_engine_fault(ctx, live & self.outside_cache(p, cells), E_DST_TABLE, sequence, tokens, cells)
        return live & real & self.names_slot(p, cells)


class PackedEmptyCountNotRecorded(Mutant):
    """Checks the counts of packed sequences with tokens only, so a count outside 0..W of a sequence with no tokens
    goes unrecorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.packed, accepted=(2, 9, 0, 3))

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        if num_accepted is not None and cu_seqlens is not None:
            empty = (cu_seqlens[1:] - cu_seqlens[:-1]) == 0
            num_accepted = torch.where(empty, torch.zeros_like(num_accepted), num_accepted)
        return super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
            out, layer,
        )  # fmt: skip


class PackedBadCountReadsColumnZero(Mutant):
    """Serves a packed sequence whose count lies outside 0..W from column 0 of its slot table (recording the count)
    instead of padding it, so a bad id in that cell is checked and recorded too, under a smaller key."""

    RULE = "engine/packed-guards"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], [40, 8, 9], [10, 11, 12]], accepted=(2, 1, 9, 3))

    def packed_start_column(self, ctx, num_accepted, sequences, width, valid):
        column, counted = super().packed_start_column(ctx, num_accepted, sequences, width, valid)
        return column, torch.ones_like(counted)


class PackedOffsetsFaultNamesStart(Mutant):
    """Records a packed sequence's bad offsets with the value cu_seqlens[n] (its first row) instead of
    cu_seqlens[n + 1]."""

    RULE = "engine/packed-offsets-guard"
    SHOWN_BY = show(demos.packed, lengths=(4, 0, 2, 1))

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        if cu_seqlens is None:
            return super().packed_sequences(ctx, cu_seqlens, tokens, width)
        cu = cu_seqlens.long()
        first, end = cu[:-1], cu[1:]
        length = end - first
        valid = (first >= 0) & (length >= 0) & (length <= width) & (end <= tokens)
        sequence = torch.arange(first.shape[0], device=cu.device)
        self.record_engine_fault(ctx, ~valid, E_OFFSETS, sequence, torch.zeros_like(sequence), first)
        return first, torch.where(valid, length, torch.zeros_like(length)), valid


class PackedLongSequenceServesW(Mutant):
    """Serves a packed sequence of more than W tokens as its first W tokens (recording its offsets) instead of
    writing no state of it."""

    RULE = "engine/packed-offsets-guard"
    SHOWN_BY = show(demos.packed, lengths=(4, 0, 2, 1))

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        first, length, valid = super().packed_sequences(ctx, cu_seqlens, tokens, width)
        if cu_seqlens is None:
            return first, length, valid
        long = (cu_seqlens[1:] - cu_seqlens[:-1]).long() > width
        return first, torch.where(long, torch.full_like(length, width), length), valid | long


class PackedDescendingOffsetsUnrecorded(Mutant):
    """Checks only that a packed sequence has at most W tokens and lies within the rows, so offsets that descend (a
    negative length) give a sequence no tokens without being recorded."""

    RULE = "engine/packed-offsets-guard"
    SHOWN_BY = show(demos.packed, cu=(0, 2, 5, 1, 1), rows=5)

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        if cu_seqlens is None:
            return super().packed_sequences(ctx, cu_seqlens, tokens, width)
        cu = cu_seqlens.long()
        first, end = cu[:-1], cu[1:]
        length = end - first
        valid = (first >= 0) & (length <= width) & (end <= tokens)
        sequence = torch.arange(first.shape[0], device=cu.device)
        self.record_engine_fault(ctx, ~valid, E_OFFSETS, sequence, torch.zeros_like(sequence), end)
        return first, torch.where(valid, length.clamp(min=0), torch.zeros_like(length)), valid


class PackedLastFaultWins(Mutant):
    """Stores each fault of an engine call over the record (the last one checked wins: offsets, counts, start
    cells, then destination cells token by token) instead of keeping the smallest key."""

    RULE = "guarded/key"
    SHOWN_BY = show(demos.packed, table=[[1, 2, 3], [4, 5, 6], [7, 40, 9], [10, 11, 60]])

    def record_engine_fault(self, ctx, bad, code, sequence, token, values):
        bad, sequence, token, values = torch.broadcast_tensors(bad, sequence, token, values)
        if bool(bad.any()):
            keys = self.fault_key(self.engine_row(code, sequence, token), ENGINE_ARGUMENT, values)
            ctx.faults.fill_(keys[bad].min())


class PackedInt64TableReadAsInt32(Mutant):
    """Reads an int64 slot table through an int32 pointer with the table's element offsets (cell (n, t) is the
    32-bit word n * W + t), so an int64 table gives the wrong ids."""

    RULE = "engine/index-dtype"
    SHOWN_BY = show(demos.packed, index=torch.int64)

    def packed_step(self, ctx, state, x, dt, A, B, C, slots, *rest):
        if slots.dtype == torch.int64:
            slots = slots.contiguous().view(torch.int32).flatten()[: slots.numel()].view(slots.shape)
        return super().packed_step(ctx, state, x, dt, A, B, C, slots, *rest)


class PackedInt64OffsetsReadAsInt32(Mutant):
    """Reads int64 offsets through an int32 pointer (offset n is the 32-bit word n), so int64 cu_seqlens give the
    wrong rows."""

    RULE = "engine/index-dtype"
    SHOWN_BY = show(demos.packed, index=torch.int64)

    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        if cu_seqlens is not None and cu_seqlens.dtype == torch.int64:
            cu_seqlens = cu_seqlens.contiguous().view(torch.int32)[: cu_seqlens.shape[0]]
        return super().packed_sequences(ctx, cu_seqlens, tokens, width)


class PackedChainsStoredStates(Mutant):
    """Continues each packed token from the state as it stored it, read back from the cache (rounded to a bf16
    cache), instead of from the fp32 state."""

    RULE = "budgets/chained-tokens"
    SHOWN_BY = show(demos.packed, problem_fields=dict(state_dtype="bf16"))

    def packed_store(self, p, store, cells, keep, s, token, length):
        super().packed_store(p, store, cells, keep, s, token, length)
        if bool(keep.any()):
            s[keep] = self.read_slot_state(p, store, cells[keep].long())


class PackedSoftplusAlways(Mutant):
    """Applies softplus to dt on every packed call (vLLM's mixer always asks for it), whatever dt_softplus says."""

    RULE = "engine/optional-inputs"
    SHOWN_BY = show(demos.packed, softplus=False)

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        return super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, True, out, layer,
        )  # fmt: skip


class PackedDtBiasDroppedWithoutD(Mutant):
    """Drops dt_bias from a packed call when D is absent (one guard for both optional per-head parameters)."""

    RULE = "engine/optional-inputs"
    SHOWN_BY = show(demos.packed, D=False)

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        bias = None if D is None else dt_bias
        return super().packed_step(
            ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, bias, dt_softplus, out,
            layer,
        )  # fmt: skip


# SGLang's verify call ---------------------------------------------------------------------------
class VerifyIgnoresBufferRows(Mutant):
    """Stores a verify row's intermediate states at the buffer row of its slot, ignoring buffer_rows."""

    RULE = "engine/verify-buffer-rows"
    SHOWN_BY = show(demos.verify, buffer_rows=(2, 0, 1, 3))

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        return super().verify_buffer_rows(ctx, slots, real, buffer, None)


class VerifyStoresOneStepLate(Mutant):
    """Stores the state after token t at buffer step t + 1."""

    RULE = "engine/verify-step-index"
    SHOWN_BY = show(demos.verify)

    def store_intermediate(self, p, buffer, rows, stores, token, s):
        super().store_intermediate(p, buffer, rows, stores, token + 1, s)


class VerifyIgnoresParents(Mutant):
    """Continues every token from the one before it, ignoring parents."""

    RULE = "engine/verify-parents"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 0]] * 4)

    def continue_from(self, s, buffer, rows, parent):
        return s


class VerifyParentsOneBased(Mutant):
    """Reads parents as 1-based: parent k reloads buffer step k - 1, and parent 0 is not followed."""

    RULE = "engine/verify-parents"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 1]] * 4)

    def continue_from(self, s, buffer, rows, parent):
        return super().continue_from(s, buffer, rows, torch.where(parent >= 0, parent - 1, parent))


class VerifyWritesCacheWithoutUpdate(Mutant):
    """Writes each row's final state to its slot even when update_state is False."""

    RULE = "engine/verify-update-state"
    SHOWN_BY = show(demos.verify, update_state=False)

    def verify_final(self, p, store, slots, real, s, update_state, buffer, rows, stores, tokens):
        super().verify_final(p, store, slots, real, s, True, buffer, rows, stores, tokens)


class VerifyFinalThroughBuffer(Mutant):
    """Writes a row's final state to its slot as the buffer holds it (rounded to the buffer's dtype) instead of
    from the fp32 state."""

    RULE = "engine/verify-update-state"
    SHOWN_BY = show(demos.verify, buffer="bf16")

    def verify_final(self, p, store, slots, real, s, update_state, buffer, rows, stores, tokens):
        if update_state and buffer is not None and bool(stores.any()):
            s = s.clone()
            s[stores] = buffer[rows[stores], tokens - 1].float()
        super().verify_final(p, store, slots, real, s, update_state, buffer, rows, stores, tokens)


class VerifyPadRowsStore(Mutant):
    """Stores a pad row's intermediate states in the buffer, at its pad id used as a row index."""

    RULE = "engine/verify-pad-rows"
    SHOWN_BY = show(demos.verify)

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        rows, stores = super().verify_buffer_rows(ctx, slots, real, buffer, buffer_rows)
        if buffer is None:
            return rows, stores
        return rows, stores | self.is_pad(ctx.problem, slots)


class VerifySlotFaultNotRecorded(Mutant):
    """Serves a verify row whose slot lies outside the cache as a pad row without recording it."""

    RULE = "engine/verify-guards"
    SHOWN_BY = show(demos.verify, slots=(3, 0, 20, 5))

    def verify_rows(self, ctx, slots):
        return self.names_slot(ctx.problem, slots)


class VerifyBufferRowFaultNotRecorded(Mutant):
    """Skips the buffer stores of a row whose buffer row lies outside the buffer without recording it."""

    RULE = "engine/verify-guards"
    SHOWN_BY = show(demos.verify, buffer_rows=(2, 0, 1, 9))

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        if buffer is None:
            return super().verify_buffer_rows(ctx, slots, real, buffer, buffer_rows)
        rows = (slots if buffer_rows is None else buffer_rows).long()
        return rows, real & (rows >= 0) & (rows < buffer.shape[0])


class VerifyBufferReadAsDense(Mutant):
    """Indexes the intermediate-state buffer as dense (rows of steps x H x P x N values back to back), ignoring its
    strides, so a buffer sliced from a longer one is written in the wrong places."""

    RULE = "engine/verify-buffer-layout"
    SHOWN_BY = show(demos.verify, buffer_layout="row-slice")

    def verify_step(
        self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
        buffer_rows, parents,
    ):  # fmt: skip
        buffer = None if buffer is None else _as_dense(buffer)
        return super().verify_step(
            ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
            buffer_rows, parents,
        )  # fmt: skip


class VerifyParentReadWithDenseStrides(Mutant):
    """Reads a parent's state back from the buffer with dense strides (blocks of H x P x N values back to back),
    so a buffer whose steps lie apart gives the wrong parent."""

    RULE = "engine/verify-buffer-layout"
    SHOWN_BY = show(demos.verify, buffer_layout="step-gap", parents=[[-1, 0, 0]] * 4)

    def continue_from(self, s, buffer, rows, parent):
        return super().continue_from(s, _as_dense(buffer), rows, parent)


class VerifyParentsReadDense(Mutant):
    """Reads the (b, T) parent table as dense row-major, ignoring its strides, so a transposed table gives each row
    the wrong parents."""

    RULE = "engine/index-layout"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 0], [-1, 0, 1], [-1, 0, 1], [-1, 0, 0]], parents_layout="transposed")

    def verify_parents(self, ctx, parents, stores, tokens):
        return super().verify_parents(ctx, None if parents is None else _as_dense(parents), stores, tokens)


class VerifyOutIntoContiguousCopy(Mutant):
    """Computes a verify call's outputs into out.contiguous() and returns that, so a strided out is neither written
    nor returned."""

    RULE = "step/out-returned"
    SHOWN_BY = show(demos.verify, out="strided")

    def verify_step(
        self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
        buffer_rows, parents,
    ):  # fmt: skip
        out = None if out is None else out.contiguous()
        return super().verify_step(
            ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
            buffer_rows, parents,
        )  # fmt: skip


class VerifyFollowsLateParent(Mutant):
    """Follows a parent at or after its own token but within the call's tokens (recording it) instead of continuing
    from the token before, so the token reloads a buffer step this call has not written yet."""

    RULE = "engine/verify-parent-guard"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 2]] * 4)

    def verify_parents(self, ctx, parents, stores, tokens):
        follow = super().verify_parents(ctx, parents, stores, tokens)
        if parents is None:
            return follow
        parent = parents.long()
        token = torch.arange(tokens, device=stores.device)[None, :]
        late = stores[:, None] & (token >= 1) & (parent >= token) & (parent < tokens)
        return torch.where(late, parent, follow)


class VerifyLateParentNotRecorded(Mutant):
    """Ignores a parent at or after its own token without recording it."""

    RULE = "engine/verify-parent-guard"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 2]] * 4)

    def verify_parents(self, ctx, parents, stores, tokens):
        follow = torch.full((stores.shape[0], tokens), -1, dtype=torch.int64, device=stores.device)
        if parents is None:
            return follow
        parent = parents.long()
        token = torch.arange(tokens, device=stores.device)[None, :]
        taken = stores[:, None] & (token >= 1) & (parent >= 0) & (parent < token)
        return torch.where(taken, parent, follow)


class VerifyNegativeParentRecorded(Mutant):
    """Records a negative parent of a token t >= 1 as a fault (code 4), though it only means that the token
    continues from token t - 1."""

    RULE = "engine/verify-parent-guard"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, -1]] * 4)

    def verify_parents(self, ctx, parents, stores, tokens):
        follow = super().verify_parents(ctx, parents, stores, tokens)
        if parents is not None:
            parent = parents.long()
            token = torch.arange(tokens, device=stores.device)[None, :]
            sequence = torch.arange(stores.shape[0], device=stores.device)[:, None]
            negative = stores[:, None] & (token >= 1) & (parent < 0)
            self.record_engine_fault(ctx, negative, E_PARENTS, sequence, token, parent)
        return follow


class VerifyNegativeParentFollowsTokenZero(Mutant):
    """Clamps parents to 0 before use, so a token t >= 1 whose parent is negative continues from token 0 instead of
    from token t - 1."""

    RULE = "engine/verify-parents"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, -1]] * 4)

    def verify_parents(self, ctx, parents, stores, tokens):
        return super().verify_parents(ctx, None if parents is None else parents.clamp(min=0), stores, tokens)


class VerifyPadRowParentChecked(Mutant):
    """Checks the parents of every verify row, so a bad parent of a pad row (which follows no parents) is recorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 1], [-1, 0, 1], [-1, 2, 0], [-1, 0, 1]])

    def verify_parents(self, ctx, parents, stores, tokens):
        follow = super().verify_parents(ctx, parents, torch.ones_like(stores), tokens)
        return torch.where(stores[:, None], follow, torch.full_like(follow, -1))


class VerifyParentOfTokenZeroChecked(Mutant):
    """Checks the parent of token 0 too, so a row whose first parent is 0 (at its own token, but never followed:
    token 0 starts from the slot) is recorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.verify, parents=[[0, 0, 1]] * 4)

    def verify_parents(self, ctx, parents, stores, tokens):
        follow = super().verify_parents(ctx, parents, stores, tokens)
        if parents is not None:
            first = parents[:, 0].long()
            sequence = torch.arange(stores.shape[0], device=stores.device)
            self.record_engine_fault(ctx, stores & (first >= 0), E_PARENTS, sequence, torch.zeros_like(sequence), first)
        return follow


class VerifyPadRowFollowsParents(Mutant):
    """Lets verify rows that store nothing (a pad row) follow their parents, reloading them from the buffer row
    their id names as an index (the last row for a pad id of -1) instead of continuing from their previous token."""

    RULE = "engine/verify-pad-rows"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 0]] * 4)

    def verify_parents(self, ctx, parents, stores, tokens):
        follow = super().verify_parents(ctx, parents, stores, tokens)
        if parents is None:
            return follow
        parent = parents.long()
        token = torch.arange(tokens, device=stores.device)[None, :]
        return torch.where((token >= 1) & (parent >= 0) & (parent < token), parent, follow)


class VerifyPadRowOutputSkipped(Mutant):
    """Leaves a verify pad row's outputs as they were (a kernel that returns early for pad rows) instead of writing
    y from a zero state."""

    RULE = "engine/verify-pad-rows"
    SHOWN_BY = show(demos.verify, out="given")

    def verify_step(
        self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
        buffer_rows, parents,
    ):  # fmt: skip
        before = None if out is None else out.clone()
        result = super().verify_step(
            ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
            buffer_rows, parents,
        )  # fmt: skip
        pad = self.is_pad(ctx.problem, slots)
        result[pad] = float("nan") if before is None else before[pad]
        return result


class VerifyBufferInCacheDtype(Mutant):
    """Rounds each intermediate state to the cache's dtype before storing it in the buffer, so an fp32 buffer
    beside a bf16 cache holds bf16 values."""

    RULE = "engine/buffer-dtype"
    SHOWN_BY = show(demos.verify, problem_fields=dict(state_dtype="bf16"))

    def store_intermediate(self, p, buffer, rows, stores, token, s):
        if not p.quantized:
            s = self.round_to_cache(s, to_torch(p.state_dtype)).float()
        super().store_intermediate(p, buffer, rows, stores, token, s)


class VerifyParentsLoadedAsBf16(Mutant):
    """Loads a parent's state from the buffer as bf16 whatever the buffer's dtype, so a parent read from an fp32
    buffer loses precision."""

    RULE = "engine/buffer-dtype"
    SHOWN_BY = show(demos.verify, parents=[[-1, 0, 0]] * 4)

    def continue_from(self, s, buffer, rows, parent):
        return super().continue_from(s, buffer.to(torch.bfloat16), rows, parent)


class VerifyBufferRowsDefaultToCallRow(Mutant):
    """Without buffer_rows, stores row b's intermediate states at buffer row b instead of at row slots[b]."""

    RULE = "engine/defaults"
    SHOWN_BY = show(demos.verify)

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        if buffer_rows is None:
            buffer_rows = torch.arange(slots.shape[0], dtype=slots.dtype, device=slots.device)
        return super().verify_buffer_rows(ctx, slots, real, buffer, buffer_rows)


class VerifyUpdateNeedsBuffer(Mutant):
    """Writes a verify row's final state to its slot only when a buffer is given (the store sits in the buffer's
    branch), so update_state without a buffer leaves the cache as it was."""

    RULE = "engine/verify-update-state"
    SHOWN_BY = show(demos.verify, buffer=None)

    def verify_final(self, p, store, slots, real, s, update_state, buffer, rows, stores, tokens):
        super().verify_final(p, store, slots, real, s, update_state and buffer is not None, buffer, rows, stores,
                             tokens)  # fmt: skip


class VerifyClearsBufferRows(Mutant):
    """Clears every step of the buffer rows it stores into before storing the first token, so the steps past T are
    written too."""

    RULE = "engine/verify-step-index"
    SHOWN_BY = show(demos.verify)

    def store_intermediate(self, p, buffer, rows, stores, token, s):
        if token == 0 and bool(stores.any()):
            buffer[rows[stores]] = 0
        super().store_intermediate(p, buffer, rows, stores, token, s)


class VerifyNegativeBufferRowWraps(Mutant):
    """Checks only a buffer row's upper bound, so a negative buffer row is not recorded and stores into the row it
    names counted from the end."""

    RULE = "engine/verify-guards"
    SHOWN_BY = show(demos.verify, buffer_rows=(2, 0, 1, -2))

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        if buffer is None:
            return super().verify_buffer_rows(ctx, slots, real, buffer, buffer_rows)
        rows = (slots if buffer_rows is None else buffer_rows).long()
        inside = rows < buffer.shape[0]
        sequence = torch.arange(rows.shape[0], device=rows.device)
        self.record_engine_fault(ctx, real & ~inside, E_BUFFER_ROWS, sequence, torch.zeros_like(sequence), rows)
        return rows, real & inside


class VerifyPadBufferRowChecked(Mutant):
    """Checks the buffer row of every verify row, so the bad buffer row of a pad row (which stores nothing) is
    recorded."""

    RULE = "engine/fault-table"
    SHOWN_BY = show(demos.verify, buffer_rows=(2, 0, 9, 3))

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        rows, stores = super().verify_buffer_rows(ctx, slots, torch.ones_like(real), buffer, buffer_rows)
        return rows, stores & real


class VerifyGatesWithZeroWithoutZ(Mutant):
    """Gates a verify call's outputs with z = 0 when z is absent (the gate applied unconditionally), so every
    output is zero."""

    RULE = "engine/optional-inputs"
    SHOWN_BY = show(demos.verify, z=False)

    def verify_step(
        self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
        buffer_rows, parents,
    ):  # fmt: skip
        z = torch.zeros_like(x) if z is None else z
        return super().verify_step(
            ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
            buffer_rows, parents,
        )  # fmt: skip


# bookkeeping ------------------------------------------------------------------------------------
class DraftsOnKernel(Mutant):
    """Allocates the speculative drafts once per kernel (in ctx.memo) and shares them between every state of it."""

    RULE = "bookkeeping/per-state"
    SHOWN_BY = staticmethod(demos.two_states)

    def draft_buffers(self, ctx, num_layers):
        key = ("drafts", num_layers)
        if key not in ctx.memo:
            ctx.memo[key] = super().draft_buffers(ctx, num_layers)
        return ctx.memo[key]


class GroupMapOnBackend(Mutant):
    """Memoises the head-to-group map on the backend object by the number of heads alone, so a later kernel with
    the same H and another G uses an earlier kernel's map."""

    RULE = "bookkeeping/per-kernel"
    SHOWN_BY = staticmethod(demos.two_kernels)

    def group_of_head(self, p, device):
        maps = self.__dict__.setdefault("_group_maps", {})
        if p.nheads not in maps:
            maps[p.nheads] = super().group_of_head(p, device)
        return maps[p.nheads]


class FaultRecordPerCall(Mutant):
    """Clears the fault record at the start of each step, as if it held one call's faults: a later
    step with valid ids erases a fault before ``check()`` sees it."""

    RULE = "bookkeeping/faults-kept"
    SHOWN_BY = show(demos.sequence, calls=("step 1 bad", "step 2 3", "check"), speculative=False)

    def rows_reading(self, ctx, slots):
        ctx.faults.fill_(torch.iinfo(torch.int64).max)
        return super().rows_reading(ctx, slots)


class DeferredMutant(Mutant, Deferred):
    """A mutant of :class:`Deferred`, the ``independent`` backend with deferred commits."""

    ABSTRACT = True


class SyncForgetsOthers(DeferredMutant):
    """``sync`` of some slots folds their pending commits in and drops every other slot's."""

    RULE = "bookkeeping/sync-some"
    SHOWN_BY = show(demos.sequence, calls=("step 1 2 3", "sync 2"), adopt=True)

    def sync(self, ctx, state, slots):
        super().sync(ctx, state, slots)
        if "pending" in state.buffers:
            state.buffers["pending"].fill_(-1)


class FirstLayerTakesCommit(DeferredMutant):
    """The first layer stepped after a commit folds its pending drafts in and clears those slots'
    pending drafts in every layer, so the other layers step from the state before the commit."""

    RULE = "bookkeeping/commit-per-layer"
    SHOWN_BY = show(demos.sequence, calls=("step 1 2", "step 1 2"))

    def fold_for_step(self, ctx, state, layer, slots):
        super().fold_for_step(ctx, state, layer, slots)
        if "pending" in state.buffers:
            state.buffers["pending"][:, slots[self.names_slot(ctx.problem, slots)].long()] = -1


class WriteKeepsCommit(DeferredMutant):
    """``write_state`` leaves a slot's pending commit in force: the kept draft later overwrites the
    states written."""

    RULE = "bookkeeping/write-replaces"
    SHOWN_BY = show(demos.sequence, calls=("step 1 2", "write 1 1 2"))

    def forget(self, state, layer, idx):
        pass


# tiles ------------------------------------------------------------------------------------------
class BatchTailDropped(Mutant):
    """Serves the batch in one tile of the largest power of two not above it, dropping the rows past it."""

    RULE = "tiles/batch-tail"
    SHOWN_BY = show(demos.step, slots=(4, 1, 2))

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        out = self.output_for(x, out)
        tile = 1 << (slots.shape[0].bit_length() - 1)

        def head(t):
            return None if t is None else t[:tile]

        super().step(ctx, state, x[:tile], dt[:tile], A, B[:tile], C[:tile], slots[:tile], D, head(z), dt_bias,
                     dt_softplus, out[:tile], layer, head(dst_slots))  # fmt: skip
        return out


class HeadsPastLastFullTileDropped(Mutant):
    """Covers the heads with tiles of 16 and drops a partial tile after a full one: with H > 16 not a multiple of 16
    the last H mod 16 heads keep their state and output 0."""

    RULE = "tiles/heads-tail"
    SHOWN_BY = show(demos.step, problem_fields=dict(nheads=24, ngroups=2))

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        new, y = super().token_update(p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
        covered = max(p.nheads // 16, 1) * 16
        if covered < p.nheads:
            new, y = new.clone(), y.clone()
            new[:, covered:] = s[:, covered:]
            y[:, covered:] = 0.0
        return new, y


class DstateTailChunkDropped(Mutant):
    """Sums the readout over N in chunks of 16 and drops a partial chunk after a full one (N = 17 loses column 16)."""

    RULE = "tiles/dstate-tail"
    SHOWN_BY = show(demos.step, problem_fields=dict(dstate=17))

    def readout(self, s, Ch):
        covered = max(s.shape[-1] // 16, 1) * 16
        return super().readout(s[..., :covered], Ch[..., :covered])


class HeaddimTailTileMisplaced(Mutant):
    """Reads x for the rows of P past 64 from the start of the head (the tail tile's offset left out), so with
    P = 80 rows 64..79 take the values of rows 0..15."""

    RULE = "tiles/headdim-tail"
    SHOWN_BY = show(demos.step, problem_fields=dict(headdim=80))

    def with_token_axis(self, p, tensors):
        x = tensors[0]
        if x.shape[-1] > 64:
            x = x.clone()
            x[..., 64:] = x[..., : x.shape[-1] - 64].clone()
        return super().with_token_axis(p, [x, *tensors[1:]])


#: every mutant, in the order above
MUTANTS = [
    cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Mutant) and cls is not Mutant and "ABSTRACT" not in vars(cls)
]
