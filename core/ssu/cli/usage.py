"""The command line's own error: a wrong option or combination of options (exit code 2)."""

from __future__ import annotations

import argparse
import sys

from ..errors import SSUError


class UsageError(SSUError):
    """A command-line option or combination of options the command cannot run with."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``prog: error: ...; see prog --help``)
    and exit code 2, like every other error of the command line."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        """Print argparse's message with a pointer to --help and exit with the usage status (2)."""
        sys.stderr.write(f"{self.prog}: error: {message}; see {self.prog} --help\n")
        raise SystemExit(2)
