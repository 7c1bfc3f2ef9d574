"""The exceptions of ``ssu``: one base class, three families, each message carrying its remedy (and
the wording of counts in messages: :func:`counted`).

Every error the framework raises on purpose derives from :class:`SSUError`, so an engine can catch
the family it cares about. Messages always say what was wrong and what to do about it.
"""

from __future__ import annotations

from typing import Optional


class SSUError(Exception):
    """Base class of every error raised by ``ssu`` on purpose."""


class ConfigError(SSUError, ValueError):
    """A config file, config value, backend option or problem description is invalid."""


class BackendError(SSUError, RuntimeError):
    """A backend cannot be resolved, imported, or used for the requested problem."""


class UnknownBackendError(BackendError, LookupError):
    """The named backend is neither installed nor a known first-party backend."""


class BackendNotInstalledError(BackendError, LookupError):
    """The named backend is a known first-party backend whose distribution is not installed."""


class BackendBrokenError(BackendError):
    """The backend is installed but its plugin module failed to import or register."""


class BackendUnavailableError(BackendError):
    """The backend is installed and loads, but cannot run here or cannot serve this problem.

    ``resolution`` (an :class:`ssu.plugins.resolve.Resolution`, when the error ends a resolution) holds
    the reason for every candidate, so that ``explain`` can show them."""

    def __init__(self, message: str, resolution=None) -> None:
        super().__init__(message)
        self.resolution = resolution


class InputError(SSUError, ValueError):
    """A tensor passed to ``step``/``commit``/``read_state``/``write_state`` does not match the problem."""


class NotServedError(InputError):
    """The call is of a kind ssu does not serve: a Mamba-1 layer's (its inputs have no head
    dimension, or its A, D or dt_bias vary along the head dimension). Raised by the drop-in call
    before anything is written; an engine plugin sends such calls to the engine's own SSU."""


class BackendDisabledError(BackendError):
    """The backend is installed but switched off by ``SSU_PLUGINS`` / ``SSU_DISABLE_PLUGINS``."""


class BackendIncompatibleError(BackendError):
    """The backend declares a plugin API version this core cannot serve."""


class SSUWarning(UserWarning):
    """Something was skipped rather than failing (a clashing or reserved entry point, say)."""


def counted(n: int, noun: str, plural: Optional[str] = None) -> str:
    """``n`` and ``noun`` in the number it takes: ``1 layer``, ``4 layers`` (``plural``: where
    adding an s is not the plural).

    >>> counted(1, "layer"), counted(0, "corner"), counted(2, "layer-step")
    ('1 layer', '0 corners', '2 layer-steps')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
