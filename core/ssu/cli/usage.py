"""The command line's own error: a wrong option or combination of options (exit code 2)."""

from __future__ import annotations

import argparse
import re
import sys

from ..contract.errors import SSUError


class UsageError(SSUError):
    """A command-line option or combination of options the command cannot run with."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``prog: error: ...; see prog --help``)
    and exit code 2, like every other error of the command line."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        """Print argparse's message with a pointer to --help and exit with the usage status (2)."""
        sys.stderr.write(f"{self.prog}: error: {message}; see {self.prog} --help\n")
        raise SystemExit(2)


_DEVICE = re.compile(r"device=(['\"])([^'\"]+)\1")


def spoken(text: str) -> str:
    """A library message in the command line's words: the option a user types for what the library
    names as an argument (``device='cuda'`` -> ``--device cuda``)."""
    return _DEVICE.sub(r"--device \2", text)
