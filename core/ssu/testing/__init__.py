"""The ssu conformance kit: prove that a backend computes docs/spec.md exactly, before production does.

- ``pytest --ssu-backend NAME`` (this package's pytest plugin, registered through the ``pytest11``
  entry point and inactive unless that option is given) runs the conformance suite against any
  installed backend; ``--ssu-profile smoke|quick|default|thorough`` sets how much it covers and
  ``--ssu-examples N`` how many problems hypothesis draws per check.
- :func:`assert_conformant` runs the same checks from Python (a backend's own test file).
- ``ssu verify --backend NAME`` runs the same cases from the command line with a readable report
  (without ``--profile``, at ``quick`` on the CPU and ``default`` elsewhere).

Problems are drawn within the capabilities the backend declares, so the suite tests exactly what
the backend claims. Needs ``hypothesis`` (``pip install ssu-core[test]``).
"""

from __future__ import annotations

from .checks import CHECK_NAMES, assert_conformant

__all__ = ["CHECK_NAMES", "assert_conformant"]
