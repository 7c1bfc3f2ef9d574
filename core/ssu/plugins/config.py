"""The user's configuration: ``ssu.toml`` (``[ssu]``) or ``pyproject.toml`` (``[tool.ssu]``).

Precedence for the backend: an explicit argument (the CLI's ``--backend``), then the
``SSU_BACKEND`` environment variable, then the file, then the default ``"reference"``.
Per-backend options (``[ssu.backends.<name>]``) stay raw tables here; the chosen backend's own
options class validates its table when it is selected (see :mod:`ssu.contract.options`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import attrs

from ..contract.errors import ConfigError
from ..contract.options import build, prefixed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DEFAULT_BACKEND = "reference"
AUTO = "auto"
ENV_BACKEND = "SSU_BACKEND"


def _backend(value: Any) -> Union[str, tuple]:
    """Normalise ``backend``: a name, ``"auto"``, or a non-empty ordered list of names."""
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",")] if "," in value else [value.strip()]
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise ConfigError(f'backend: expected a name, a list of names or "auto", got {value!r}')
    if not names or any(not isinstance(n, str) or not n.strip() for n in names):
        raise ConfigError(f"backend: names must be non-empty strings, got {value!r}")
    names = [n.strip() for n in names]
    if AUTO in names and len(names) > 1:
        raise ConfigError('backend: "auto" stands alone; it already tries every backend in priority order')
    if len(set(names)) != len(names):
        raise ConfigError(f"backend: {names} names a backend twice")
    return names[0] if len(names) == 1 else tuple(names)


def _validate(value: Any) -> Union[bool, str]:
    if value in (True, False, "full"):
        return value
    raise ConfigError(
        f"validate={value!r} is not valid; use true (checked, cached per input signature), "
        'false (no checks) or "full" (also checks slot values; synchronises the host)'
    )


def _backend_tables(value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise ConfigError(f"backends: expected a table of [ssu.backends.<name>] tables, got {value!r}")
    for name, table in value.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"ssu.backends.{name}: expected a table of options, got {table!r}")
    return {name: dict(table) for name, table in value.items()}


@attrs.frozen
class Config:
    """Validated configuration. ``Config()`` is the default: the ``reference`` backend.

    ``backend`` is one name, a tuple of names tried in order, or ``"auto"``.
    ``validate`` is ``True`` (inputs checked once per input signature), ``False`` (never),
    or ``"full"`` (also slot values and accepted counts on every call; this synchronises).
    ``backends`` maps backend names to their raw option tables.
    ``source`` records where ``backend`` came from (for ``explain``), ``path`` the file read.
    """

    backend: Union[str, tuple[str, ...]] = attrs.field(default=DEFAULT_BACKEND, converter=_backend)
    validate: Union[bool, Literal["full"]] = attrs.field(default=True, converter=_validate)
    backends: dict = attrs.field(factory=dict, converter=_backend_tables)
    source: str = attrs.field(default="default", eq=False, metadata={"internal": True})
    path: Optional[str] = attrs.field(default=None, eq=False, metadata={"internal": True})

    @property
    def candidates(self) -> tuple:
        """The backend names to try, in order (``("auto",)`` for auto)."""
        return self.backend if isinstance(self.backend, tuple) else (self.backend,)

    def options_for(self, name: str) -> dict:
        """The raw option table for backend ``name`` (empty if none)."""
        return self.backends.get(name, {})

    def with_backend(self, backend: Any, source: str) -> "Config":
        """A copy of the configuration that names another backend (or list of backends) and where it came from."""
        return attrs.evolve(self, backend=backend, source=source)


def _read_toml(path: Path) -> dict:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"config file not found: {path} (give an existing file, or none: then ssu.toml, else a pyproject.toml "
            f"with [tool.ssu], in the working directory {Path.cwd()} is read, and without either the defaults apply)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        return tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _spelled(value: Any, dotted: str) -> str:
    """What a TOML value is, as a file spells it, for a message that says it is the wrong kind."""
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return f"an array of tables ([[{dotted}]])"
    if isinstance(value, list):
        return f"an array {value!r}"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    kind = {int: "integer", float: "number"}.get(type(value), type(value).__name__)
    return f"the {kind} {value!r}"


def _must_be_table(path: Path, data: Mapping, key: str, dotted: str) -> Any:
    """``data[key]`` (None if absent), which must be a table: a file holding, say, ``ssu = 3`` or
    ``[[ssu]]`` gets one ConfigError naming the file and the key rather than failing on the value."""
    value = data.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(
            f"{path}: {dotted} must be a table (a [{dotted}] header with keys under it), got {_spelled(value, dotted)}"
        )
    return value


def _table(path: Path, data: dict) -> tuple[dict, str]:
    """The ssu table of a parsed file and its dotted path."""
    if path.name == "pyproject.toml":
        tool = _must_be_table(path, data, "tool", "tool")
        table = None if tool is None else _must_be_table(path, tool, "ssu", "tool.ssu")
        if table is None:
            raise ConfigError(f'{path}: no [tool.ssu] table; add one, e.g. [tool.ssu] backend = "reference"')
        return table, "tool.ssu"
    extra = [k for k in data if k != "ssu"]
    if extra:
        from ..contract.options import did_you_mean

        hint = did_you_mean(extra[0], ["ssu"])
        raise ConfigError(f"{path}: unknown top-level key {extra[0]!r}{hint}; an ssu.toml holds one [ssu] table")
    if "ssu" not in data:
        raise ConfigError(f"{path}: no [ssu] table; start the file with [ssu]")
    return _must_be_table(path, data, "ssu", "ssu"), "ssu"


def find_config_file(directory: Optional[Path] = None) -> Optional[Path]:
    """``ssu.toml`` in ``directory`` (default: the working directory), else a ``pyproject.toml``
    there that has a ``[tool.ssu]`` table, else ``None``. A ``pyproject.toml`` whose ``tool`` or
    ``tool.ssu`` is not a table is found too, so that :func:`load_config` refuses it by name."""
    directory = Path.cwd() if directory is None else directory
    candidate = directory / "ssu.toml"
    if candidate.is_file():
        return candidate
    candidate = directory / "pyproject.toml"
    if candidate.is_file():
        try:
            tool = tomllib.loads(candidate.read_text("utf-8")).get("tool", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
            return None
        if not isinstance(tool, Mapping) or "ssu" in tool:  # a `tool` that is no table: load says so
            return candidate
    return None


def load_config(
    path: Union[str, os.PathLike, None] = None,
    *,
    backend: Any = None,
    env: Optional[Mapping[str, str]] = None,
    search: bool = True,
) -> Config:
    """Load and validate a configuration.

    ``path`` is an ``ssu.toml`` or a ``pyproject.toml``; without one, the working directory is
    searched (``search=False`` skips that). ``backend`` (e.g. the CLI's ``--backend``) beats
    ``SSU_BACKEND`` which beats the file.

    >>> load_config(search=False, env={}).backend
    'reference'
    """
    env = os.environ if env is None else env
    config = Config()
    file = Path(path) if path is not None else (find_config_file() if search else None)
    if file is not None:
        table, dotted = _table(file, _read_toml(file))
        try:
            config = build(Config, {k: v for k, v in table.items()}, dotted)
        except ConfigError as exc:
            raise ConfigError(prefixed(f"{file}: ", str(exc))) from None
        config = attrs.evolve(config, path=str(file))
        if "backend" in table:
            config = attrs.evolve(config, source=f"file {file}")
    if env.get(ENV_BACKEND, "").strip():
        try:
            config = config.with_backend(env[ENV_BACKEND], f"environment {ENV_BACKEND}")
        except ConfigError as exc:
            raise ConfigError(f"{ENV_BACKEND}={env[ENV_BACKEND]!r}: {exc}") from None
    if backend is not None:
        config = config.with_backend(backend, "argument")
    return config
