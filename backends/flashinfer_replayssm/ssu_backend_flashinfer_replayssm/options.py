"""Options of the ``flashinfer-replayssm`` backend: ``[ssu.backends.flashinfer-replayssm]``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import attrs

from ssu.contract.errors import ConfigError
from ssu.contract.options import choice, in_range

ALGORITHMS = ("auto", "monolith", "two-kernel")
MAX_WINDOW = 16
CACHE_ENV = "SSU_REPLAYSSM_TUNING_CACHE"


def _batches(value) -> tuple:
    """``tuning_batches``: a list of positive batch sizes (empty: FlashInfer's own buckets)."""
    if not isinstance(value, (list, tuple)) or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in value
    ):
        raise ConfigError(
            f"tuning_batches={value!r} is not valid; give a list of positive batch sizes, e.g. [64, 128, 256]"
        )
    return tuple(sorted(set(value)))


def _path(value) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(f"tuning_cache={value!r} is not valid; give a file path (string)")
    return str(value)


@attrs.frozen
class ReplayOptions:
    """``max_window``: tokens the ring keeps before the checkpoint is written (tokens_per_step to
    16; the state is written once every ``max_window`` accepted tokens or so).
    ``algorithm``: FlashInfer's kernel choice (``auto`` lets its autotuner pick per batch bucket;
    ``monolith`` one kernel; ``two-kernel`` precompute + main, with scratch).
    ``tuning_cache``: the JSON file FlashInfer's autotuner results are saved to and loaded from
    (default ``$SSU_REPLAYSSM_TUNING_CACHE`` or ``~/.cache/ssu/flashinfer-replayssm-tuning.json``).
    ``autotune``: warmup runs FlashInfer's autotuner for ``algorithm = "auto"`` (minutes at a
    large ``max_batch``, once: the results are cached); false leaves the choice to FlashInfer's
    built-in rule (two-kernel when batch x heads >= the GPU's SM count, else monolith).
    ``tuning_batches``: the batch sizes the autotuner profiles (e.g. ``[64, 128, 256]``; others
    use the nearest profiled one); empty: FlashInfer's own buckets up to ``max_batch``, which at
    a large ``max_batch`` profile for minutes.
    ``commit_on_last_layer``: with speculation off, the step of the group's last layer moves the
    ring cursors (true), or the engine calls ``kernel.commit(state, slots, ones)`` after it
    (false)."""

    max_window: int = attrs.field(default=15, validator=in_range(1, MAX_WINDOW))
    algorithm: str = attrs.field(default="auto", validator=choice(*ALGORITHMS))
    tuning_cache: Optional[str] = attrs.field(default=None, converter=_path)
    autotune: bool = True
    tuning_batches: tuple[int, ...] = attrs.field(default=(), converter=_batches)
    commit_on_last_layer: bool = True

    def tuning_cache_path(self) -> Path:
        """Where FlashInfer's tuning results for this backend live."""
        if self.tuning_cache:
            return Path(self.tuning_cache).expanduser()
        env = os.environ.get(CACHE_ENV)
        if env:
            return Path(env).expanduser()
        return Path.home() / ".cache" / "ssu" / "flashinfer-replayssm-tuning.json"

    def ring_length(self, tokens_per_step: int) -> int:
        """L: ring rows per slot, ``max_window + T``."""
        return self.max_window + tokens_per_step
