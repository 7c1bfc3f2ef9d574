"""Running the conformance checks on a backend: hypothesis draws the cases of :mod:`.cases`, each
check runs on every one, and a failure is shrunk to a minimal case before it is reported.

:func:`run_check` is the one loop behind ``ssu verify`` (:func:`run_conformance`) and the pytest
suite (:func:`ssu.testing.assert_conformant`): at one profile both run the same cases (each check's draws come
from a fixed seed of its own, whatever hypothesis profile is loaded), so a failure seen by one is
seen by the other, on any machine with the same hypothesis release.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections import Counter
from typing import Callable, Iterable, Optional

import attrs

from ..contract.errors import InputError, SSUError
from ..checking.harness import CheckFailure, open_backend
from .cases import PROFILES, Case, Profile, cases, corner_cases, real_cases
from .catalogue import CHECKS
from .expect import CheckSkipped
from .rules import describe as describe_rule


@attrs.frozen
class CheckReport:
    """One check on one backend: ``status`` is ``pass``, ``fail`` or ``skip``.

    ``ran``: the cases that ran to the end; ``skipped``: why others did not apply (reason ->
    count); ``refused``: problems the backend's ``ssu_supports`` turned down (reason -> count);
    ``failure``: what was wrong, on the minimal case hypothesis found."""

    check: str
    status: str
    ran: tuple = ()
    skipped: tuple = ()
    refused: tuple = ()
    failure: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether the check ran and passed (a skipped check has not passed)."""
        return self.status == "pass"

    @property
    def detail(self) -> str:
        """Why it failed or was skipped (empty for a pass)."""
        if self.status == "fail":
            return self.failure
        if self.status == "skip":
            return "; ".join(reason for reason, _ in self.skipped) or "nothing ran"
        return ""

    def coverage(self) -> str:
        """What the cases that ran spanned: shapes, tokens, dtypes, layouts, pad ids, options."""
        if not self.ran:
            return "no case ran"
        from ..contract.errors import counted

        problems = [c.problem for c in self.ran]
        real = sum(bool(c.label) and not c.label.startswith("corner") for c in self.ran)
        corners = sum(c.label.startswith("corner") for c in self.ran)

        def span(values) -> str:
            values = sorted(set(values))
            return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"

        def kinds(values) -> str:
            return "/".join(str(v) for v in sorted(set(values), key=lambda v: (isinstance(v, str), v)))

        return ", ".join(
            [
                f"{counted(len(self.ran), 'case')} ({real} at real shapes, {counted(corners, 'corner')})",
                f"H {span(p.nheads for p in problems)}",
                f"P {span(p.headdim for p in problems)}",
                f"N {span(p.dstate for p in problems)}",
                f"G {span(p.ngroups for p in problems)}",
                f"T {span(p.tokens_per_step for p in problems)}",
                f"state {kinds(p.state_dtype for p in problems)}",
                f"input {kinds(p.input_dtype for p in problems)}",
                f"layouts {kinds(c.layout for c in self.ran)}",
                f"pad ids {kinds(p.pad_slot_id for p in problems)}",
            ]
        )


class _Failed(AssertionError):
    """What hypothesis sees of a failed case (the message is the report's)."""


class _ShrunkEnough(BaseException):
    """Shrinking has run the profile's ``shrink_examples`` cases: the smallest failure found so far
    is the one reported (a BaseException, so that hypothesis stops at once)."""


class _DeviceFault(BaseException):
    """A device fault in a case: it ends the check at once (hypothesis does not shrink a
    BaseException that is not an Exception), since the CUDA context will not run another kernel."""


#: the check that raised a device fault in this process, and what it raised (None: none did). After
#: a device-side assert a CUDA context answers every later call with the same error, so the checks
#: after it would all fail for that one check's cause: they are reported as not run, naming it.
device_fault: Optional[tuple] = None


def _record_fault(check: str, exc: BaseException) -> None:
    global device_fault
    device_fault = (check, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the GPU reporting a fault of a kernel (a device-side assert, an illegal
    address): one that leaves the process's CUDA context unusable."""
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text


def breaks(rule: str) -> str:
    """The line of a failure that names the rule it breaks (nothing for no rule)."""
    return f"\n  breaks {describe_rule(rule)}" if rule else ""


def _verdict(loaded, problem, options) -> Optional[str]:
    """Why the backend's ``ssu_supports`` turns ``problem`` down (None: accepted)."""
    verdict = loaded.hook.ssu_supports(problem=problem, options=options)
    if verdict is not None and not verdict.ok:
        return "; ".join(verdict.reasons) or "rejected by its ssu_supports hook"
    return None


def narrowed(capabilities, state_dtypes: Optional[Iterable[str]], backend: str):
    """``capabilities`` with only ``state_dtypes`` (None: all it declares), so that the checks draw
    problems of those dtypes only: a backend's author narrows the kit to the dtype at hand.
    Raises ValueError for a dtype the backend does not declare, naming those it does."""
    if state_dtypes is None:
        return capabilities
    wanted = frozenset(state_dtypes)
    missing = sorted(wanted - capabilities.state_dtypes)
    if missing or not wanted:
        declared = ", ".join(sorted(capabilities.state_dtypes))
        what = f"state dtype(s) {', '.join(missing)}" if missing else "no state dtype"
        raise ValueError(f"backend {backend!r} does not declare {what}; it declares {declared}")
    return attrs.evolve(capabilities, state_dtypes=wanted)


def run_check(
    backend: str,
    check: str,
    *,
    profile: Profile,
    device: str,
    registry,
    options: Optional[dict] = None,
    max_examples: Optional[int] = None,
    state_dtypes: Optional[Iterable[str]] = None,
) -> CheckReport:
    """Run one check on the profile's cases (with ``state_dtypes``, only problems of those state
    dtypes); never raises for what the backend does wrong."""
    import torch
    from hypothesis import HealthCheck, given, reject, seed, settings
    from hypothesis.errors import Unsatisfiable

    from ..plugins.resolve import validated_options
    from ..plugins.config import Config

    spec = CHECKS[check]
    loaded = registry.load(backend)
    caps = narrowed(loaded.spec.capabilities, state_dtypes, backend)
    started = time.perf_counter()
    why_not = spec.applies(caps, device)
    if why_not:
        return CheckReport(check, "skip", skipped=((why_not, 1),), seconds=0.0)
    if device_fault is not None:
        cause, what = device_fault
        reason = (
            f"not run: check {cause!r} raised a device fault ({what}), after which CUDA answers every call of "
            f"this process with it; run this check alone: ssu verify --backend {backend} --check {check}"
        )
        return CheckReport(check, "skip", skipped=((reason, 1),), seconds=0.0)
    backend_options = validated_options(loaded, Config(backend=backend, backends={backend: options} if options else {}))
    ran: list[Case] = []
    skipped: Counter = Counter()
    refused: Counter = Counter()
    failure: list[str] = []
    shrinking = [0]  # cases run since the first failure

    def run_case(case: Case) -> None:
        if failure:
            shrinking[0] += 1
            if shrinking[0] > profile.shrink_examples:
                raise _ShrunkEnough()
        reason = _verdict(loaded, case.problem, backend_options)
        if reason:
            refused[reason] += 1
            if case.label:
                return  # an explicit real shape the backend turns down: counted, not retried
            reject()
        try:
            kernel = open_backend(backend, case.problem, registry, options)
        except SSUError as exc:
            message = f"backend {backend!r} refused a problem inside its declared capabilities: {exc}"
            failure[:] = [f"{message}{breaks(spec.rule)}\n  case: {case.describe()}"]
            raise _Failed(failure[0]) from None
        try:
            spec.function(kernel, case, torch.Generator().manual_seed(case.seed))
        except CheckSkipped as exc:
            skipped[str(exc)] += 1
            return
        except (CheckFailure, InputError) as exc:
            kind = "" if isinstance(exc, CheckFailure) else "refused a valid call: "
            failure[:] = [f"{kind}{exc}{breaks(getattr(exc, 'rule', '') or spec.rule)}\n  case: {case.describe()}"]
            raise _Failed(failure[0]) from None
        except Exception as exc:  # a crashing backend fails the check; it does not crash the run
            if is_device_fault(exc):
                _record_fault(check, exc)
                failure[:] = [
                    f"device fault: {type(exc).__name__}: {exc}\n  case: {case.describe()}\n  (the CUDA context of "
                    "this process is unusable from here on; the checks after this one are not run in it)"
                ]
                raise _DeviceFault(failure[0]) from None
            failure[:] = [f"raised {type(exc).__name__}: {exc}{breaks(spec.rule)}\n  case: {case.describe()}"]
            raise _Failed(failure[0]) from None
        ran.append(case)

    test = given(case=cases(caps, device, profile, speculative=spec.speculative))(run_case)
    test = seed(zlib.crc32(check.encode()))(test)  # each check its own cases, the same ones every run
    # every setting that decides the draws is given here, so that no hypothesis profile changes
    # them (its "ci" profile, loaded where a CI variable is set, derandomizes)
    test = settings(
        max_examples=max_examples or profile.examples,
        derandomize=False,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )(test)
    try:
        test()  # drawn cases first: a failure there is shrunk to a minimal case
    except _DeviceFault:  # no shrinking: every later call of this process would fail with the same fault
        pass
    except _ShrunkEnough:  # the last failure recorded is the smallest one shrinking reached
        pass
    except _Failed:
        pass
    except Unsatisfiable:  # every drawn problem refused: reported below with the reasons
        pass
    except Exception as exc:  # hypothesis' own errors
        if not failure:
            failure.append(f"{type(exc).__name__}: {exc}")
    explicit = real_cases(caps, device, profile, speculative=spec.speculative) if spec.real_shapes else []
    if profile.corners:
        explicit += corner_cases(caps, device, profile, speculative=spec.speculative)
    for case in explicit if not failure else []:  # then the real model shapes and the corners, as they are
        try:
            run_case(case)
        except (_Failed, _DeviceFault):
            break
    seconds = time.perf_counter() - started
    rows = dict(ran=tuple(ran), skipped=tuple(skipped.items()), refused=tuple(refused.items()), seconds=seconds)
    if failure:
        return CheckReport(check, "fail", failure=failure[-1], **rows)
    if not ran:
        if refused and not skipped:
            reasons = "; ".join(reason for reason, _ in refused.items())
            return CheckReport(check, "fail", failure=f"every drawn problem was refused: {reasons}", **rows)
        return CheckReport(check, "skip", **rows)
    return CheckReport(check, "pass", **rows)


def resolve_profile(name_or_profile) -> Profile:
    """A :class:`Profile` from its name (``smoke``, ``quick``, ``default``, ``thorough``) or itself."""
    if isinstance(name_or_profile, Profile):
        return name_or_profile
    try:
        return PROFILES[name_or_profile]
    except KeyError:
        raise ValueError(f"unknown profile {name_or_profile!r}; the profiles are {', '.join(PROFILES)}") from None


#: the profile ``ssu verify`` takes on the CPU when none is asked for: every check, with its corner
#: cases, on small drawn shapes (the reference passes it in about 10 s on two cores, ``default`` in
#: about 50 s); on any other device it takes ``default``
CPU_PROFILE = "quick"


def device_profile(device: str) -> tuple[str, str]:
    """(profile name, why) of the profile ``ssu verify`` runs on ``device`` when none is named."""
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        return CPU_PROFILE, "chosen for the CPU: small drawn shapes, a run of seconds"
    return "default", f"chosen for {kind}"


def run_conformance(
    backend: str,
    *,
    device: str = "cpu",
    registry=None,
    options: Optional[dict] = None,
    profile="default",
    checks: Optional[list] = None,
    max_examples: Optional[int] = None,
    on_report: Optional[Callable[[CheckReport], None]] = None,
    state_dtypes: Optional[Iterable[str]] = None,
    on_start: Optional[Callable[[str], None]] = None,
) -> list[CheckReport]:
    """Run the checks (default: all) on ``backend``; ``on_start`` sees each check's name as it
    starts and ``on_report`` each report as it is made; ``state_dtypes`` narrows the drawn problems
    to those state dtypes (each one the backend declares)."""
    from ..plugins.registry import default_registry

    registry = default_registry() if registry is None else registry
    chosen = resolve_profile(profile)
    with _one_thread_on_cpu(device):
        return _run_checks(
            backend, device, registry, options, chosen, checks, max_examples, on_report, state_dtypes, on_start
        )


@contextlib.contextmanager
def _one_thread_on_cpu(device: str):
    """On the CPU, torch runs the checks on one thread: the kit's tensors are small, and OpenMP's
    workers spin between small operations, which on a machine with one other busy process made a
    check up to fifty times slower (one thread is as fast on an idle one)."""
    import torch

    if str(device).startswith("cuda"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_checks(
    backend, device, registry, options, chosen, checks, max_examples, on_report, state_dtypes, on_start
) -> list:
    narrowed(registry.load(backend).spec.capabilities, state_dtypes, backend)  # a dtype it lacks: before any check
    reports = []
    for name in checks or list(CHECKS):
        if on_start is not None:
            on_start(name)
        report = run_check(
            backend,
            name,
            profile=chosen,
            device=device,
            registry=registry,
            options=options,
            max_examples=max_examples,
            state_dtypes=state_dtypes,
        )
        reports.append(report)
        if on_report is not None:
            on_report(report)
    return reports
