"""The conformance check of calls in sequence: steps, commits, ``sync``, ``write_state``,
``read_state`` and ``check`` mixed over three layers and a pool of slots, with ids outside the
cache (and, speculative, counts outside 1..T) in some calls between clean ones.

A float64 model follows the logical state of every slot of every layer and the fault record
(the smallest key since the last ``check``, docs/spec.md "Pad rows, and ids that name no slot").
What a backend keeps between calls (drafts, commits not yet folded in, rings, the record) is
free in form, but every read, every step's outputs, every engine tensor after a ``sync`` and
every ``check`` must agree with the model, whichever calls came between: a fault that a later
clean call erases, a ``sync`` of some slots that loses the others' committed states, a commit
one layer's step clears for every layer, or a ``write_state`` that leaves an older draft in
force all show as a disagreement.

Each value the model holds was read, written or stepped some calls ago; the budgets widen by
one state budget per step since (the backend rounds its states to the cache dtype at each step,
the model does not), which is far below what each of those faults moves.
"""

from __future__ import annotations

from typing import Optional

from ..state import faults
from ..checking import oracle
from ..contract.errors import InputError
from ..checking.harness import (
    CheckFailure,
    cache_rows,
    engine_cache,
    engine_scales,
    expect_close,
    logical_states,
    prepared,
)
from ..checking.inputs import pick_slots, random_states
from .cases import Case, step_call, weights
from .expect import budgets, draw_slots, expect_unchanged

#: the layers of the state a run steps (commit moves them all)
LAYERS = 3
#: the calls a run draws from, each as often as its count here
CALLS = ("step",) * 4 + ("read", "write", "sync", "check")


def check_sequences(kernel, case: Case, gen) -> None:
    """A run of ``10 + case.steps`` calls drawn from :data:`CALLS` (a step steps every layer,
    and commits when speculative; some steps meet an id outside the cache or a bad count), then
    ``sync`` of every slot and a read of every slot of every layer, all against the model (see
    the module docstring); slots outside the pool stay bit-identical, the engine's pages too."""
    import torch

    run = _Run(kernel, case, gen)
    try:
        for _ in range(10 + case.steps):
            call = CALLS[int(torch.randint(len(CALLS), (1,), generator=gen))]
            getattr(run, call)()
        run.finish()
    except CheckFailure as exc:
        raise CheckFailure(f"{exc}\n  calls before it: {run.history()}", exc.rule) from None


class _Run:
    """One run: the kernel, its state (allocated, or an engine's cache adopted), the pool of
    slots the calls use, and the model."""

    def __init__(self, kernel, case: Case, gen) -> None:
        import torch

        p = self.p = kernel.problem
        self.kernel, self.case, self.gen = kernel, case, gen
        self.out_tol, self.state_tol = budgets(kernel)
        caps = kernel.capabilities
        self.adopt = caps.adopt_state and bool(torch.randint(2, (1,), generator=gen))
        self.pages = self.scale_pages = []
        if self.adopt:
            self.caches, self.pages = engine_cache(p, LAYERS, gen)
            self.scales, self.scale_pages = engine_scales(p, LAYERS, gen)
            self.state = kernel.adopt_state(self.caches, scales=self.scales or None)
            self.before = [logical_states(kernel, self.state, layer).clone() for layer in range(LAYERS)]
        else:
            self.state, self.before = prepared(kernel, gen, layers=LAYERS)
        self.pages_before = [page.clone() for page in self.pages + self.scale_pages]
        self.index_dtype = draw_slots(case, gen).dtype
        self.pads = case.pad_rows
        real = case.batch - self.pads
        # the model lives on the host (pool, states, ages), whatever the kernel's device
        self.pool = pick_slots(p, min(p.num_slots - int(p.pad_in_cache), real + 2), gen).long().cpu()
        self.rows = min(real, len(self.pool))
        self.weights = [weights(case, gen) for _ in range(LAYERS)]
        # the model: each layer's logical states (float64), steps since each was read or written,
        # what last set it, and the smallest fault key since the last check
        self.want = [values.double().cpu() for values in self.before]
        self.age = [torch.zeros(p.num_slots, dtype=torch.long) for _ in range(LAYERS)]
        self.last = [dict() for _ in range(LAYERS)]
        self.fault: Optional[int] = None
        self.faults_drawn = kernel.config.validate != "full" and (kernel.config.validate or caps.guards_slots)
        self.calls: list[str] = []

    # the calls ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Every layer stepped with one batch from the pool (pad rows last), then a commit when
        speculative; a third of the steps put an id outside the cache in one row (speculative:
        or a count outside 1..T in the commit)."""
        import torch

        from .id_checks import _outside_ids

        p, gen = self.p, self.gen
        order = torch.randperm(len(self.pool), generator=gen)[: self.rows]
        real = self.pool[order]
        ids = torch.cat([real, torch.full((self.pads,), p.pad_slot_id)]).to(self.index_dtype).to(p.device)
        bad_row, bad_count = None, None
        if self.faults_drawn and self.rows and int(torch.randint(3, (1,), generator=gen)) == 0:
            bad_row = int(torch.randint(self.rows, (1,), generator=gen))
            if p.speculative and int(torch.randint(2, (1,), generator=gen)):
                bad_count = (0, p.tokens_per_step + 1)[int(torch.randint(2, (1,), generator=gen))]
            else:
                candidates = _outside_ids(p, 3, self.index_dtype)
                bad_id = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
                ids[bad_row] = bad_id
                self._recorded(faults.encode(bad_row, faults.SLOTS, bad_id))
        served = torch.ones(len(ids), dtype=torch.bool)
        served[self.rows :] = False
        if bad_row is not None and bad_count is None:
            served[bad_row] = False
        slots = ids.long().cpu()
        layers = range(LAYERS)
        if not p.speculative and not self.kernel.capabilities.layers_share_commit:
            layers = torch.randperm(LAYERS, generator=gen).tolist()
        steps = {}
        for layer in layers:
            start = torch.zeros(len(ids), p.nheads, p.headdim, p.dstate, dtype=torch.float64)
            start[served] = self.want[layer][slots[served]]
            inputs, call = step_call(self.case, ids, gen, self.weights[layer])
            states, outs = oracle.step_math64(p, start.float().to(p.device), inputs)
            result = self.kernel.step(self.state, layer=layer, **call)
            age = int(self.age[layer][slots[served]].max()) if bool(served.any()) else 0
            self._note(f"step layer {layer} slots {self._ids(ids)}")
            self._close(f"outputs of layer {layer}", oracle.with_token_axis(p, result), outs,
                        self.out_tol + age * self.state_tol, layer, slots, served)  # fmt: skip
            steps[layer] = states
        pick = torch.zeros(len(ids), dtype=torch.long)
        if p.speculative:
            accepted = torch.randint(1, p.tokens_per_step + 1, (len(ids),), generator=gen, dtype=torch.int32)
            if bad_count is not None:
                accepted[bad_row] = bad_count
                self._recorded(faults.encode(bad_row, faults.NUM_ACCEPTED, bad_count))
                served[bad_row] = False
            elif bad_row is not None:
                self._recorded(faults.encode(bad_row, faults.SLOTS, int(ids[bad_row])))
            self.kernel.commit(self.state, ids, accepted.to(p.device))
            self._note(f"commit {accepted.tolist()}")
            pick = accepted.long().clamp(1, p.tokens_per_step) - 1
        rows = torch.arange(len(ids))[served]
        for layer, states in steps.items():
            self.want[layer][slots[served]] = states.double().cpu()[rows, pick[served]]
            self.age[layer][slots[served]] += 1
            for slot in slots[served].tolist():
                self.last[layer][slot] = "commit" if p.speculative else "step"

    def read(self) -> None:
        """``read_state`` of some slots of one layer: the model's states within the budget; the
        model then takes the values read (its age back to 0)."""
        layer, slots = self._layer(), self._some()
        got = self._checked(lambda: self.kernel.read_state(self.state, slots.to(self.p.device), layer))
        self._note(f"read layer {layer} slots {slots.tolist()}")
        self._states_close(f"read_state of layer {layer}", got, layer, slots)
        self.want[layer][slots] = got.double().cpu()
        self.age[layer][slots] = 0

    def write(self) -> None:
        """``write_state`` of new states into some slots of one layer (a prefill): what the slots
        held before, drafts and commits included, is gone."""
        layer, slots = self._layer(), self._some()
        values = random_states(self.p, len(slots), self.gen)
        self._checked(lambda: self.kernel.write_state(self.state, slots.to(self.p.device), values, layer))
        self._note(f"write layer {layer} slots {slots.tolist()}")
        self.want[layer][slots] = values.double().cpu()
        self.age[layer][slots] = 1  # its rounding to the cache dtype
        for slot in slots.tolist():
            self.last[layer][slot] = "write"

    def sync(self) -> None:
        """``sync`` of some slots (or every slot): an adopted cache's engine tensors then hold the
        synced slots' states, and no slot's logical state moves."""
        import torch

        every = bool(torch.randint(2, (1,), generator=self.gen))
        slots = None if every else self._some()
        self._checked(lambda: self.kernel.sync(self.state, None if slots is None else slots.to(self.p.device)))
        self._note("sync every slot" if slots is None else f"sync slots {slots.tolist()}")
        if slots is not None:
            for layer in range(LAYERS):
                for slot in set(self.pool.tolist()) - set(slots.tolist()):
                    kind = self.last[layer].get(slot, "")
                    if not kind.endswith("after sync"):
                        self.last[layer][slot] = f"{kind} after sync"
        if self.adopt:
            named = self.pool if slots is None else slots
            for layer in range(LAYERS):
                got = self._engine_rows(layer, named)
                self._states_close(f"the engine's cache of layer {layer} after sync", got, layer, named,
                                   "adopted/in-place")  # fmt: skip

    def check(self) -> None:
        """``kernel.check()`` raises the model's smallest key since the last check, or nothing."""
        self._note("check")
        self._checked(self.kernel.check)

    def finish(self) -> None:
        """``sync`` of every slot, every pool slot of every layer read, nothing else changed."""
        import torch

        self._checked(lambda: self.kernel.sync(self.state))
        self._note("sync every slot")
        for layer in range(LAYERS):
            got = self.kernel.read_state(self.state, self.pool.to(self.p.device), layer)
            self._states_close(f"read_state of layer {layer} at the end", got, layer, self.pool)
        expect_unchanged(self.kernel, self.state, [b.to(self.p.device) for b in self.before],
                         {layer: self.pool.to(self.p.device) for layer in range(LAYERS)})  # fmt: skip
        for layer in range(LAYERS) if self.adopt else ():
            got = self._engine_rows(layer, self.pool)
            self._states_close(f"the engine's cache of layer {layer} at the end", got, layer, self.pool,
                               "adopted/in-place")  # fmt: skip
        others = torch.ones(self.p.num_slots, dtype=torch.bool, device=self.p.device)
        others[self.pool.to(self.p.device)] = False
        if self.p.pad_in_cache:
            others[self.p.pad_slot_id] = False  # a null block: a backend may use it as a sink
        for now, before in zip(self.pages + self.scale_pages, self.pages_before):
            if not (torch.equal(now[:, 1:], before[:, 1:]) and torch.equal(now[others, 0], before[others, 0])):
                raise CheckFailure("the engine's pages changed outside the pool's slot blocks", "adopted/in-place")
        self._checked(self.kernel.check)

    def _engine_rows(self, layer: int, slots):
        """The states an adopted cache's engine tensors hold for ``slots`` of ``layer`` (fp32)."""
        scales = self.scales[layer] if self.scales else None
        return cache_rows(self.p, self.caches[layer], scales, slots.to(self.p.device))

    # the model's side ----------------------------------------------------------------------------
    def _recorded(self, key: int) -> None:
        self.fault = key if self.fault is None else min(self.fault, key)

    def _checked(self, call):
        """``call()`` (a read, a write, a sync, a check: each checks the record first): it raises
        the model's pending fault, which a second ``call()`` then does not; else it raises none."""
        if self.fault is not None:
            want = faults.message(self.fault, self.p)
            self.fault = None
            try:
                call()
            except InputError as exc:
                if want not in str(exc):
                    raise CheckFailure(f"the fault record reported {exc}; the smallest key since the last check "
                                       f"was: {want}", "guarded/key") from None  # fmt: skip
            else:
                raise CheckFailure(f"a call was refused earlier and not reported since, but nothing was reported "
                                   f"(expected: {want})", "bookkeeping/faults-kept")  # fmt: skip
        try:
            return call()
        except InputError as exc:
            raise CheckFailure(f"a fault was reported that no call since the last check made: {exc}",
                               "pad/any-id") from None  # fmt: skip

    def _states_close(self, what: str, got, layer: int, slots, rule: str = "") -> None:
        import torch

        served = torch.ones(len(slots), dtype=torch.bool)
        age = int(self.age[layer][slots].max()) if len(slots) else 0
        self._close(what, got, self.want[layer][slots], self.state_tol * (1 + age), layer, slots, served, rule)

    def _close(self, what: str, got, want, tol: float, layer: int, slots, served, rule: str = "") -> None:
        """Within ``tol`` of the model; a failure names the rule the slot that is furthest off
        points to (what last set it, and what came after)."""
        try:
            expect_close(what, got.double().cpu(), want.double().cpu(), tol)
        except CheckFailure as exc:
            raise CheckFailure(str(exc), rule or self._suspect(layer, slots, served, got, want)) from None

    def _suspect(self, layer: int, slots, served, got, want) -> str:
        """The rule a disagreement on ``slots`` of ``layer`` most likely breaks: that of the row
        furthest from the model, by what last set its slot's state."""
        import torch

        diff = (got.double().cpu() - want.double().cpu()).abs().flatten(1).amax(1)
        diff[~served] = -1.0
        slot = int(slots[int(torch.argmax(diff))])
        kind = self.last[layer].get(slot, "")
        if kind.endswith("after sync"):
            return "bookkeeping/sync-some"
        if kind == "write":
            return "bookkeeping/write-replaces"
        if kind == "commit":
            return "bookkeeping/commit-per-layer"
        return "bookkeeping"

    # drawing -----------------------------------------------------------------------------------
    def _layer(self) -> int:
        import torch

        return int(torch.randint(LAYERS, (1,), generator=self.gen))

    def _some(self):
        """One to all of the pool's slots, in random order (int64, host)."""
        import torch

        count = int(torch.randint(1, len(self.pool) + 1, (1,), generator=self.gen))
        return self.pool[torch.randperm(len(self.pool), generator=self.gen)[:count]]

    def _ids(self, ids) -> list:
        return ["pad" if i == self.p.pad_slot_id else i for i in ids.tolist()]

    def _note(self, call: str) -> None:
        self.calls.append(call)

    def history(self) -> str:
        """The calls of the run so far (the last 12)."""
        shown = self.calls[-12:]
        return ("... " if len(self.calls) > len(shown) else "") + "; ".join(shown)
