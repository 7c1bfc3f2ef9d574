"""Options of the ``flashinfer`` backend: ``[ssu.backends.flashinfer]`` in ssu.toml."""

from __future__ import annotations

import attrs

from ssu.contract.dtypes import INDEX_DTYPES, dtype_in
from ssu.contract.errors import ConfigError
from ssu.contract.options import choice, in_range

ALGORITHMS = ("auto", "simple", "vertical", "horizontal")


def _index_dtypes(value) -> tuple:
    """The slot index dtypes' canonical names, in any spelling ssu knows (``torch.int64``); at least one."""
    what = f"warmup_index_dtypes={list(value)!r}"
    names = tuple(dict.fromkeys(dtype_in(v, INDEX_DTYPES, what=what, kind="a slot index dtype") for v in value))
    if not names:
        raise ConfigError(f'{what} is not valid; use a non-empty list of "int32", "int64"')
    return names


@attrs.frozen
class FlashInferOptions:
    """``algorithm``: FlashInfer's SSU algorithm (``auto`` lets FlashInfer pick per call;
    ``vertical``/``horizontal`` need SM90 for one token and SM100 for several).
    ``stochastic_rounding``: for an fp16 state cache only, with ``philox_rounds`` Philox rounds.
    ``warmup_index_dtypes``: slot index dtypes whose modules warmup compiles."""

    algorithm: str = attrs.field(default="auto", validator=choice(*ALGORITHMS))
    stochastic_rounding: bool = False
    philox_rounds: int = attrs.field(default=10, validator=in_range(1, 10))
    warmup_index_dtypes: list[str] = attrs.field(default=("int32",), converter=_index_dtypes)
