"""Options of the ``flashinfer`` backend: ``[ssu.backends.flashinfer]`` in ssu.toml."""

from __future__ import annotations

import attrs

from ssu.contract.errors import ConfigError
from ssu.contract.options import choice, in_range

ALGORITHMS = ("auto", "simple", "vertical", "horizontal")


def _index_dtypes(instance, attribute, value) -> None:
    bad = [v for v in value if v not in ("int32", "int64")]
    if bad or not value:
        raise ConfigError(f'{attribute.name}={list(value)!r} is not valid; use a non-empty list of "int32", "int64"')


@attrs.frozen
class FlashInferOptions:
    """``algorithm``: FlashInfer's SSU algorithm (``auto`` lets FlashInfer pick per call;
    ``vertical``/``horizontal`` need SM90 for one token and SM100 for several).
    ``stochastic_rounding``: for an fp16 state cache only, with ``philox_rounds`` Philox rounds.
    ``warmup_index_dtypes``: slot index dtypes whose modules warmup compiles."""

    algorithm: str = attrs.field(default="auto", validator=choice(*ALGORITHMS))
    stochastic_rounding: bool = False
    philox_rounds: int = attrs.field(default=10, validator=in_range(1, 10))
    warmup_index_dtypes: list[str] = attrs.field(default=("int32",), converter=tuple, validator=_index_dtypes)
