"""The rules of docs/spec.md the conformance kit holds a backend to, each under a short id.

A failed check names the rule it found broken (:class:`ssu.checking.harness.CheckFailure`'s ``rule``): one
rule where the check can tell which (a fault record naming the wrong argument), else the group of
rules a wrong value may come from (an output off the oracle: the recurrence). The mutation suite
of the repository breaks every rule here, one backend each, and the kit fails every one of them.
"""

from __future__ import annotations

#: rule id -> the rule, with the section of docs/spec.md it comes from
RULES = {
    "layout/strided-views": '"Shapes and names": the tensors of a call may be any strided views (a row of x taken from '
    "a wider projection output, a transposed B).",
    "layout/token-stride": '"Shapes and names": the token axis of a speculative step\'s x, dt, B, C and z has any '
    "stride (a view); nothing may assume it dense.",
    "one-token/dt-bias": '"One token": d = dt[b, h] + dt_bias[h], added before softplus.',
    "one-token/softplus": '"One token": softplus(v) = log(1 + e^v), computed in fp32 like the rest of the step.',
    "one-token/softplus-threshold": '"One token": softplus(v) is v itself above 20, v being dt + dt_bias.',
    "one-token/softplus-flag": '"One token": softplus applies only when dt_softplus is set.',
    "one-token/decay": '"One token": s = exp(A[h] d) s + d x B: the decay multiplies the old state only.',
    "one-token/inflow": '"One token": the inflow is d x[b, h, p] B[b, g, n].',
    "one-token/readout": '"One token": y[p] = sum over n of the new s[p, n] C[b, g, n].',
    "one-token/skip": '"One token": y gains D[h] x[b, h, p] (no D: nothing).',
    "one-token/gate": '"One token": y = (readout + D x) z sigmoid(z): the gate z sigmoid(z) multiplies the sum.',
    "one-token/groups": '"Shapes and names": head h reads group h // (H / G).',
    "one-token/store-rounding": '"One token": the new s is stored rounded to the cache dtype to nearest: no lean '
    "toward zero or away from it (stochastic rounding of an fp16 cache only where the backend declares it).",
    "step/out-none": '"Error budgets" and "Shapes and names": with out = None the step allocates a new output of '
    "x's dtype and shape.",
    "step/out-returned": '"Error budgets": a given out is written and is the tensor returned.',
    "layers/independent": '"States: allocated or adopted": a State holds a group of layers, each with its own '
    "states; a call on one layer reads and writes that layer alone.",
    "pad/reads-zero": '"Pad rows, and ids that name no slot": a pad row reads a zero state.',
    "pad/writes-nothing": '"Pad rows, and ids that name no slot": a pad row writes no state, whatever its destination.',
    "pad/output-written": '"Pad rows, and ids that name no slot": a pad row still writes its output row, y from '
    "a zero state.",
    "pad/any-id": '"Pad rows, and ids that name no slot": pad_slot_id may be any integer (negative, past the cache, '
    "or a null block inside it), and is never a fault.",
    "destinations/write-dst": '"One token": the new s is stored in dst_slots[b] when given, not in the slot read.',
    "destinations/pad-dst": '"Pad rows, and ids that name no slot": a row whose destination is the pad id reads its '
    "state, writes its output and writes no state.",
    "guarded/recorded": '"Pad rows, and ids that name no slot": a backend declaring guards_slots records each id '
    "outside the cache in the fault record.",
    "guarded/key": '"Pad rows, and ids that name no slot": the record holds the smallest key row << 34 | argument '
    "<< 32 | low 32 bits of the id.",
    "guarded/argument-code": '"Pad rows, and ids that name no slot": the argument field is 0 for slots, 1 for '
    "dst_slots, 2 for num_accepted.",
    "guarded/no-touch": '"Pad rows, and ids that name no slot": a row with an id outside the cache is served as a '
    "pad row: nothing outside the cache, and no slot, is read or written for it.",
    "guarded/index-dtype": '"Shapes and names": slots are int32 or int64; an int64 id outside the cache is guarded '
    "like any other, never wrapped into a slot.",
    "spec/step-leaves-state": '"Several tokens per sequence": a speculative step leaves the logical state of every '
    "slot unchanged.",
    "spec/token-order": '"Several tokens per sequence": the T tokens are applied in order.',
    "spec/per-token-outputs": '"Several tokens per sequence": out holds the output after each of the T tokens.',
    "spec/starts-from-committed": '"Several tokens per sequence": a step starts from the logical (committed) '
    "state of its slots.",
    "commit/accepted-count": '"Several tokens per sequence": commit makes each slot\'s state the one after its first '
    "num_accepted[b] tokens.",
    "commit/every-layer": '"Several tokens per sequence": commit moves every layer of the state group at once.',
    "commit/count-guard": '"Several tokens per sequence": a count outside 1..T leaves that slot as it was.',
    "commit/count-recorded": '"Several tokens per sequence": a count outside 1..T is recorded like an id outside the '
    "cache (argument 2).",
    "commit/pad-rows": '"Several tokens per sequence": a pad row of a commit leaves every slot as it was.',
    "adopted/in-place": '"States: allocated or adopted": steps read and write the engine\'s tensors (and an 8-bit '
    "cache's scales) in place: no copy, the same storage.",
    "adopted/slot-stride": '"States: allocated or adopted": each slot\'s block is contiguous and the slot stride is '
    "free (a view into larger pages).",
    "state-io/write-rounding": '"States: allocated or adopted": write_state installs states rounded to the cache '
    "dtype (to nearest).",
    "state-io/read-dequantised": '"Quantised states": read_state returns the dequantised fp32 state.',
    "state-io/read-slots": '"States: allocated or adopted": read_state(slots) returns the state of slots[i] in row i.',
    "state-io/read-owns": '"States: allocated or adopted": read_state returns a tensor of its own: editing it changes '
    "no state, and no later call changes it.",
    "state-io/write-current": '"States: allocated or adopted": write_state installs the logical state, which '
    "read_state then returns.",
    "warmup/state-intact": '"Bounds measured on one H200" (warmup) and docs/writing-a-backend.md: warmup leaves every '
    "state value exactly as it was.",
    "quantised/row-scale": '"Quantised states": one scale per (slot, head, row of P): max over the row\'s N values / '
    "QMAX.",
    "quantised/fresh-scale": '"Quantised states": each write computes the scale afresh from the row it writes; a '
    "scale grows and shrinks with its row.",
    "quantised/round-nearest": '"Quantised states": q = round(h / scale) to nearest, ties to even (int8).',
    "quantised/scale-format": '"Quantised states": the stored scale is max |h| / QMAX and a value reads as q * scale.',
    "quantised/fp8-saturation": '"Quantised states": an fp8_e4m3 row spans +-448 (QMAX 448): its largest value '
    "maps to 448, not to a saturated smaller bound.",
    "quantised/pad-untouched": '"Quantised states": pad rows, refused rows and slots outside the call leave values '
    "and scales untouched.",
    "quantised/scales-with-values": '"Quantised states": the scales are versioned and written with the values.',
    "budgets/state-precision": '"Error budgets": an fp32 state is held to fp32 rounding whatever the inputs.',
    "budgets/chained-tokens": '"Error budgets": the T tokens of a step chain in fp32; the only rounding of a new '
    "state is the one to the cache dtype.",
    "budgets/output-from-fp32": '"Error budgets": outputs come from the fp32 state before it is rounded to the cache.',
    "engine/packed-start-column": '"Packed (vLLM)": a sequence starts from slots[n, max(num_accepted[n] - 1, 0)].',
    "engine/packed-per-token-dst": '"Packed (vLLM)": the state after each token t goes to dst_slots[n, t].',
    "engine/packed-offsets": '"Packed (vLLM)": sequence n owns the rows cu_seqlens[n] to cu_seqlens[n + 1] - 1.',
    "engine/packed-zero-length": '"Packed (vLLM)": a sequence of zero tokens reads, writes and outputs nothing.',
    "engine/packed-pad-start": '"Packed (vLLM)": a sequence whose start cell is the pad id writes no state '
    "whatever its cells say.",
    "engine/packed-pad-cell": '"Packed (vLLM)": a destination cell holding the pad id is not written.',
    "engine/packed-guards": '"What is refused, and what is guarded": a start cell or destination cell outside the '
    "cache, or a count outside 0..W, is served as the spec says and recorded with kind 3.",
    "engine/fault-key": '"Pad rows, and ids that name no slot": an engine call\'s key has the row field code << 26 '
    "| sequence << 7 | token, with the code of the argument (0 slot table, 1 destination table, ...).",
    "engine/verify-buffer-rows": '"Verify (SGLang)": the state after token t of row b goes to buffer[buffer_rows[b], '
    "t].",
    "engine/verify-step-index": '"Verify (SGLang)": the state after token t is stored at step t; steps past T are '
    "not written.",
    "engine/verify-parents": '"Verify (SGLang)": token t continues from the state after token parents[b, t] when '
    "0 <= parents[b, t] < t.",
    "engine/verify-update-state": '"Verify (SGLang)": with update_state the slot takes the state after token T - 1 '
    "(rounded to the cache only); without it the cache is left exactly as it was.",
    "engine/verify-pad-rows": '"Verify (SGLang)": a pad row stores nothing, follows no parents and writes its outputs.',
    "engine/verify-guards": '"What is refused, and what is guarded": a verify row whose slot or buffer row lies '
    "outside the cache or buffer is served as the spec says and recorded with kind 3.",
    "engine/index-layout": '"Packed (vLLM)": slots and dst_slots are (N, W) tables with any strides; '
    '"Shapes and names": the tensors of a call (a tree\'s parent table too) may be any strided views.',
    "engine/index-dtype": '"Shapes and names": slots and dst_slots are int32 or int64 (the engine forms\' tables, '
    "counts and offsets too), each read in its own dtype.",
    "engine/defaults": '"Packed (vLLM)" and "Verify (SGLang)": dst_slots defaults to slots (token t stores in '
    "slots[n, t]), no num_accepted starts every sequence from column 0, buffer_rows defaults to slots.",
    "engine/optional-inputs": '"Engine call forms": both forms take the per-head parameters as a step does: no z, no '
    "gate; no D, no skip; no dt_bias, + 0; softplus only when dt_softplus is set.",
    "engine/packed-unowned-out": '"Packed (vLLM)": rows of out that no sequence owns are not written.',
    "engine/packed-offsets-guard": '"What is refused, and what is guarded": offsets that do not ascend within the '
    "call's tokens or give a sequence more than W tokens are recorded (code 3, token 0, value cu_seqlens[n + 1]) "
    "and no state of that sequence is written.",
    "engine/fault-table": '"What is refused, and what is guarded": ids are checked where they are used, each value '
    "recorded only when its table says: a start cell of a sequence with a token, valid offsets and a valid count; "
    "a destination cell of an existing token of a sequence not padded; a count when the offsets are valid, with no "
    "tokens too; a parent at t >= 1 of a row storing into a buffer row; a buffer row of a row whose slot is a slot "
    "of the cache.",
    "engine/verify-parent-guard": '"What is refused, and what is guarded": a parent at or after its own token is '
    "recorded (code 4, token t, the parent) and not followed; a negative parent is no fault: the token continues "
    "from token t - 1.",
    "engine/verify-buffer-layout": '"Verify (SGLang)": each (H, P, N) block of the buffer is contiguous; its row and '
    "step strides are free (a buffer sliced from a larger one), for stores and for parents read back alike.",
    "engine/buffer-dtype": '"Verify (SGLang)": the buffer has its own dtype, whatever the cache\'s: each stored '
    "state is rounded to the buffer's dtype and parents are read back from it (or unrounded).",
    "bookkeeping/per-state": '"States: allocated or adopted": a State holds the states of its layers; two States of '
    "one kernel never share them (a step of one never moves the other).",
    "bookkeeping/per-kernel": '"One token": each kernel computes the equations for its own problem (its H and G), '
    "whatever other kernels of the backend were opened before.",
    "bookkeeping/faults-kept": '"Pad rows, and ids that name no slot": the record holds the smallest key of every '
    "call since the last check(); a later call with valid ids leaves it as it is.",
    "bookkeeping/sync-some": '"States: allocated or adopted": sync(slots) makes those slots\' engine tensors current '
    "and leaves the logical state of every other slot as it was, commits not yet folded in included.",
    "bookkeeping/commit-per-layer": '"Several tokens per sequence": a commit moves every layer; each layer\'s next '
    "step starts from its committed state, whichever layers were stepped before it.",
    "bookkeeping/write-replaces": '"States: allocated or adopted": write_state replaces whatever a slot held: its '
    "committed state, and any draft or commit a backend keeps beside it.",
    "tiles/batch-tail": '"One token": every row of the batch is served, whatever the batch size.',
    "tiles/heads-tail": '"One token": every head h < H is served, whatever H.',
    "tiles/dstate-tail": '"One token": the readout sums over every n < N, whatever N.',
    "tiles/headdim-tail": '"One token": every row p < P reads its own x[b, h, p], whatever P.',
}

#: a rule group (the part of a rule id before "/") -> what it covers, and the section of
#: docs/spec.md it comes from: what a failure names when a check cannot tell the rules of the
#: group apart (an output off the oracle may break any rule of the recurrence)
GROUPS = {
    "layout": 'the layout of a call\'s tensors ("Shapes and names")',
    "one-token": 'the recurrence of one token and its output ("One token")',
    "step": 'the output tensor of a step ("Shapes and names", "Error budgets")',
    "layers": 'the layers of a State ("States: allocated or adopted")',
    "pad": 'pad rows ("Pad rows, and ids that name no slot")',
    "destinations": 'destination slots ("One token", "Pad rows, and ids that name no slot")',
    "guarded": 'ids outside the cache and the fault record ("Pad rows, and ids that name no slot")',
    "spec": 'speculative steps ("Several tokens per sequence")',
    "commit": 'commits ("Several tokens per sequence")',
    "adopted": 'adopted caches ("States: allocated or adopted")',
    "state-io": 'read_state and write_state ("States: allocated or adopted")',
    "warmup": "warmup (docs/writing-a-backend.md)",
    "quantised": '8-bit states ("Quantised states")',
    "budgets": 'error budgets ("Error budgets")',
    "engine": 'the engine call forms ("Engine call forms")',
    "bookkeeping": 'what a backend keeps between calls ("States: allocated or adopted", "One token")',
    "tiles": 'every row, head and value of a step served ("One token")',
}


def describe(rule: str) -> str:
    """``rule`` (an id of :data:`RULES` or of :data:`GROUPS`) with what it says, for a report."""
    if rule in RULES:
        return f"{rule}: {RULES[rule]}"
    if rule in GROUPS:
        return f"{rule}: {GROUPS[rule]}"
    return rule
