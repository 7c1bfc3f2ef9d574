"""The command line's own error: a wrong option or combination of options (exit code 2)."""

from __future__ import annotations

import argparse
import re
import sys

from ..contract.errors import SSUError


class UsageError(SSUError):
    """A command-line option or combination of options the command cannot run with."""


#: a value that starts like a negative number (``-1``, ``-1,8``, ``-0.5``)
_MINUS_DIGIT = re.compile(r"-\.?\d")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``prog: error: ...; see prog --help``)
    and exit code 2, like every other error of the command line."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse's entry point
        """argparse's, with an option's value that starts with a minus and a digit joined to the
        option (``--batches -1,8`` -> ``--batches=-1,8``): argparse takes only a plain negative
        number for a value and reads ``-1,8`` as an unknown option, where the option's own check
        says what is wrong with the value."""
        args = list(sys.argv[1:] if args is None else args)
        valued = {s for action in self._actions if action.nargs is None for s in action.option_strings}
        joined, i = [], 0
        while i < len(args):
            if args[i] == "--":
                joined += args[i:]
                break
            if args[i] in valued and i + 1 < len(args) and _MINUS_DIGIT.match(args[i + 1]):
                joined.append(f"{args[i]}={args[i + 1]}")
                i += 2
                continue
            joined.append(args[i])
            i += 1
        return super().parse_known_args(joined, namespace)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        """Print argparse's message with a pointer to --help and exit with the usage status (2)."""
        sys.stderr.write(f"{self.prog}: error: {message}; see {self.prog} --help\n")
        raise SystemExit(2)


_DEVICE = re.compile(r"device=(['\"])([^'\"]+)\1")


def spoken(text: str) -> str:
    """A library message in the command line's words: the option a user types for what the library
    names as an argument (``device='cuda'`` -> ``--device cuda``)."""
    return _DEVICE.sub(r"--device \2", text)
