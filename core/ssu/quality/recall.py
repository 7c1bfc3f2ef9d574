"""The recall task: key-value pairs kept in a Mamba2 state across a long run of filler tokens.

A sequence, in a vocabulary of 64 ids::

    BOS  k v  k v  ...   every key once, in a random order, each followed by a random value
    f f f ... f          ``gap`` filler ids drawn at random
    QUERY  k0 v  k1 v ...  the recital: every key in ascending order, each with its value

A prompt ends at QUERY; a model's greedy continuation is the recital. Its keys follow from their
fixed order; its values only from what the pairs wrote into the state ``gap`` and more steps
earlier, through every filler step since. So a state dtype that loses what a state holds, over
one write or over thousands of re-written steps, loses answers.
"""

from __future__ import annotations

from typing import Optional

import attrs

#: ids of the vocabulary
PAD, BOS, QUERY = 0, 1, 2
KEY0, VALUE0, FILLER0, VOCAB = 8, 24, 40, 64


@attrs.frozen
class RecallTask:
    """The task's sizes: ``keys`` pairs a sequence, values drawn from ``values`` ids, fillers from
    ``fillers`` ids (the vocabulary's layout fixes their upper bounds)."""

    keys: int = attrs.field(default=8, validator=attrs.validators.in_(range(1, VALUE0 - KEY0 + 1)))
    values: int = attrs.field(default=16, validator=attrs.validators.in_(range(1, FILLER0 - VALUE0 + 1)))
    fillers: int = attrs.field(default=24, validator=attrs.validators.in_(range(1, VOCAB - FILLER0 + 1)))

    @property
    def answer_len(self) -> int:
        """Tokens of a recital: a key and its value for every key."""
        return 2 * self.keys

    def sequences(self, n: int, gap: int, seed: int = 0, generator: Optional[object] = None):
        """``(prompts, answers)``: ``n`` prompts (n, 2 + 2 * keys + gap) int64 ending at QUERY, and
        their recitals (n, 2 * keys). Drawn from ``generator`` (a torch.Generator) or ``seed``."""
        import torch

        if n < 1 or gap < 0:
            raise ValueError(f"RecallTask.sequences: n must be >= 1 and gap >= 0, got n={n}, gap={gap}")
        g = generator if generator is not None else torch.Generator().manual_seed(seed)
        order = torch.argsort(torch.rand(n, self.keys, generator=g), dim=1)
        values = torch.randint(0, self.values, (n, self.keys), generator=g)
        pairs = torch.stack([KEY0 + order, VALUE0 + torch.gather(values, 1, order)], 2).reshape(n, -1)
        filler = FILLER0 + torch.randint(0, self.fillers, (n, gap), generator=g)
        keys = KEY0 + torch.arange(self.keys).expand(n, -1)
        answers = torch.stack([keys, VALUE0 + values], 2).reshape(n, -1)
        prompts = torch.cat([torch.full((n, 1), BOS), pairs, filler, torch.full((n, 1), QUERY)], 1)
        return prompts, answers

    def accuracy(self, recitals, answers) -> float:
        """The fraction of values a batch of recitals (n, 2 * keys) gives right."""
        return (recitals[:, 1::2] == answers[:, 1::2]).float().mean().item()
