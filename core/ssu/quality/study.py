"""The figures of a state dtype: the recall task's accuracy, greedy-token agreement with fp32
states, and the state's drift from fp32 over long decodes, for a :class:`~.model.Mamba2LM`.

Every figure compares decoders that differ only in their state dtype: the same weights, the same
tokens, fp32 arithmetic everywhere else; the fp32-state decoder is the yardstick. How the prompt
reaches the state is chosen by ``prefill``:

- ``"steps"``: every prompt token is a decode step at the state dtype (each one re-writes the
  whole state: the hardest case, as in a long generation);
- ``"once"``: the prompt runs at fp32 and its final states are stored once at the state dtype (an
  engine's prefill writing the cache), the recital then decoded at the state dtype.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs

from .model import Mamba2LM
from .recall import RecallTask

PREFILLS = ("steps", "once")


@attrs.frozen
class RecitalRow:
    """One state dtype's recitals at one gap: the task's accuracy (values right), the fraction of
    recital tokens equal to the fp32-state decoder's, and the fraction of whole recitals equal."""

    state_dtype: str
    gap: int
    prefill: str
    accuracy: float
    agreement: float
    same_recitals: float

    @classmethod
    def of(cls, state_dtype: str, gap: int, prefill: str, task: RecallTask, got, answers, fp32) -> "RecitalRow":
        """The row of recitals ``got`` against the ``answers`` and the fp32 decoder's recitals."""
        same = got == fp32
        return cls(
            state_dtype, gap, prefill, task.accuracy(got, answers), same.float().mean().item(),
            same.all(1).float().mean().item(),
        )  # fmt: skip


def recitals(
    lm: Mamba2LM,
    ssu_config: Any,
    state_dtypes: Sequence[str],
    gaps: Iterable[int],
    n: int = 32,
    seed: int = 0,
    prefill: str = "steps",
    task: RecallTask = RecallTask(),
    device: str = "cpu",
) -> list:
    """:class:`RecitalRow` for each gap and state dtype (fp32 first, the yardstick), on ``n``
    sequences drawn from ``seed``."""
    import torch

    if prefill not in PREFILLS:
        raise ValueError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}")
    rows = []
    with torch.inference_mode():
        for gap in gaps:
            prompts, answers = task.sequences(n, gap, seed=seed + gap)
            prompts, answers = prompts.to(device), answers.to(device)
            yardstick = lm.decoder(ssu_config, "fp32", n, device)
            last = yardstick.feed(prompts)
            after_prompt = yardstick.snapshot()
            fp32_recitals = yardstick.generate(last, task.answer_len)
            for dtype in ["fp32", *[d for d in state_dtypes if d != "fp32"]]:
                if dtype == "fp32":
                    got = fp32_recitals
                else:
                    decoder = lm.decoder(ssu_config, dtype, n, device)
                    if prefill == "steps":
                        last_d = decoder.feed(prompts)
                    else:
                        decoder.load(after_prompt)
                        last_d = last
                    got = decoder.generate(last_d, task.answer_len)
                rows.append(RecitalRow.of(dtype, gap, prefill, task, got, answers, fp32_recitals))
    return rows


@attrs.frozen
class DriftRow:
    """One state dtype's distance from the fp32-state decoder after ``steps`` decode steps on the
    same tokens: the relative state error ``|h - h_fp32| / |h_fp32|`` (Frobenius, per sequence
    and layer; median and largest) and the fraction of steps so far whose greedy token (argmax of
    the logits) equals the fp32 decoder's."""

    state_dtype: str
    steps: int
    median_error: float
    max_error: float
    token_agreement: float


@attrs.frozen
class LongRun:
    """:func:`long_run`'s figures: the drift at each checkpoint, and the recitals after the run
    (one :class:`RecitalRow` a state dtype, fp32 first, gap: the run's filler)."""

    drift: list
    recitals: list


def long_run(
    lm: Mamba2LM,
    ssu_config: Any,
    state_dtypes: Sequence[str],
    checkpoints: Sequence[int] = (1000, 4000, 16000),
    n: int = 8,
    seed: int = 0,
    task: RecallTask = RecallTask(),
    device: str = "cpu",
) -> LongRun:
    """Decoders of every state dtype stepped in lockstep through one prompt of the task, its
    pairs then filler to ``max(checkpoints)`` decode steps, :class:`DriftRow` taken at each
    checkpoint; then each decoder recites from its own state (prefill ``"steps"``)."""
    import torch

    length = max(checkpoints)
    gap = length - 2 - 2 * task.keys
    if gap < 0:
        raise ValueError(f"long_run: the longest checkpoint must be at least {2 + 2 * task.keys} steps")
    prompts, answers = task.sequences(n, gap, seed=seed)
    prompts, answers = prompts.to(device), answers.to(device)
    dtypes = [d for d in state_dtypes if d != "fp32"]
    drift_rows = []
    with torch.inference_mode():
        decoders = {d: lm.decoder(ssu_config, d, n, device) for d in ["fp32", *dtypes]}
        agree = dict.fromkeys(dtypes, 0)
        last = {}
        for t in range(prompts.shape[1]):
            last = {d: decoder.step(prompts[:, t]) for d, decoder in decoders.items()}
            greedy = last["fp32"].argmax(-1)
            for d in dtypes:
                agree[d] += (last[d].argmax(-1) == greedy).sum().item()
            if t + 1 in checkpoints:
                truth = decoders["fp32"].states()
                for d in dtypes:
                    errors = torch.stack(
                        [
                            (got - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
                            for got, ref in zip(decoders[d].states(), truth)
                        ]
                    )
                    drift_rows.append(
                        DriftRow(d, t + 1, errors.median().item(), errors.max().item(), agree[d] / (n * (t + 1)))
                    )
        recited = {d: decoder.generate(last[d], task.answer_len) for d, decoder in decoders.items()}
    rows = [RecitalRow.of(d, gap, "steps", task, got, answers, recited["fp32"]) for d, got in recited.items()]
    return LongRun(drift_rows, rows)
