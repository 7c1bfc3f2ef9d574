"""Resolution: the four distinct errors with remedies, fallback lists, auto, options, explain."""

from __future__ import annotations

import pytest

import ssu
from ssu.plugins.resolve import explain

from fakes import good_backend, small_problem

OPTIONS_BACKEND = (
    good_backend("tuned")
    + """
import attrs
from ssu.contract.options import choice

@attrs.frozen
class TunedOptions:
    algorithm: str = attrs.field(default="auto", validator=choice("auto", "simple", "vertical"))
    num_warps: int = 4
    rounding_rounds: int = 10

OPTIONS = TunedOptions


@ssu.hookimpl
def ssu_supports(problem, options):
    if options.algorithm == "vertical" and problem.state_dtype != "fp32":
        return ssu.Verdict.reject("algorithm 'vertical' needs an fp32 state")
    return ssu.ACCEPT
"""
)


@pytest.fixture
def site(fake_site):
    fake_site.add("ssu-backend-good", {"good": "r_good"}, modules={"r_good": good_backend("good", priority=5)})
    fake_site.add(
        "ssu-backend-better", {"better": "r_better"}, modules={"r_better": good_backend("better", priority=9)}
    )
    fake_site.add(
        "ssu-backend-nogpu",
        {"nogpu": "r_nogpu"},
        modules={"r_nogpu": good_backend("nogpu", priority=20, available=False)},
    )
    fake_site.add("ssu-backend-broken", {"broken": "r_broken"}, modules={"r_broken": "import no_such_module_xyz\n"})
    fake_site.add("ssu-backend-tuned", {"tuned": "r_tuned"}, modules={"r_tuned": OPTIONS_BACKEND})
    return fake_site


def open_with(registry, backend, problem=None, **config):
    return ssu.open(ssu.Config(backend=backend, **config), problem or small_problem(), registry=registry)


def test_explicit_name_is_selected(site):
    kernel = open_with(site.registry(), "good")
    assert kernel.backend == "good"
    assert "-> good: selected" in kernel.explain()


def test_unknown_name_suggests_and_lists(site):
    with pytest.raises(ssu.UnknownBackendError) as info:
        open_with(site.registry(), "goood")
    message = str(info.value)
    assert "did you mean 'good'" in message and "ssu backends" in message
    assert "better" in message and "reference" in message


def test_first_party_not_installed_gives_pip_command(site):
    with pytest.raises(
        ssu.BackendNotInstalledError, match=r"pip install --find-links <wheel folder> ssu-backend-flashinfer-replayssm"
    ):
        open_with(site.registry(), "flashinfer-replayssm")


def test_broken_gives_import_error(site):
    with pytest.raises(ssu.BackendBrokenError, match="no_such_module_xyz"):
        open_with(site.registry(), "broken")


def test_unavailable_gives_reason_and_remedy(site):
    with pytest.raises(ssu.BackendUnavailableError, match="no frobnicator here; install a frobnicator"):
        open_with(site.registry(), "nogpu")


def test_unsupported_problem_gives_reason(site):
    with pytest.raises(ssu.BackendUnavailableError, match="tokens_per_step=8 exceeds the maximum 4"):
        open_with(site.registry(), "good", small_problem(speculative=True, tokens_per_step=8))
    with pytest.raises(ssu.BackendUnavailableError, match="device 'cuda' not supported"):
        open_with(site.registry(), "good", small_problem(device="cuda"))


def test_named_backend_is_never_replaced(site):
    registry = site.registry()
    for name in ("nogpu", "broken"):
        with pytest.raises(ssu.BackendError):
            open_with(registry, name)


def test_fallback_list_tries_in_order_and_explains(site):
    kernel = open_with(site.registry(), ["nogpu", "flashinfer", "broken", "good", "better"])
    assert kernel.backend == "good"
    text = kernel.explain()
    assert "x nogpu: rejected: " in text and "no frobnicator" in text
    assert "pip install --find-links <wheel folder> ssu-backend-flashinfer" in text and "no_such_module_xyz" in text
    assert ". better: not tried" in text
    assert ". reference: not requested: would serve this problem" in text  # every other backend's verdict


def test_typo_in_fallback_list_is_an_error(site):
    with pytest.raises(ssu.UnknownBackendError, match="did you mean 'better'"):
        open_with(site.registry(), ["bettr", "reference"])


def test_all_rejected_lists_every_reason(site):
    with pytest.raises(ssu.BackendUnavailableError) as info:
        open_with(site.registry(), ["nogpu", "broken"])
    assert "nogpu" in str(info.value) and "no_such_module_xyz" in str(info.value)


def test_auto_uses_priority_and_reference_last(site):
    registry = site.registry()
    kernel = open_with(registry, "auto")
    assert kernel.backend == "better"  # nogpu has a higher priority but is unavailable
    text = kernel.explain()
    assert text.index("nogpu") < text.index("better") and "broken" in text
    only_ref = site.registry(env={"SSU_PLUGINS": "reference,nogpu"})
    assert open_with(only_ref, "auto").backend == "reference"


def test_options_validated_by_backend_class(site):
    registry = site.registry()
    kernel = open_with(registry, "tuned", backends={"tuned": {"algorithm": "simple", "num_warps": 8}})
    assert kernel.options.algorithm == "simple" and kernel.options.num_warps == 8
    with pytest.raises(
        ssu.ConfigError, match=r"ssu\.backends\.tuned\.num_wraps: unknown option \(did you mean 'num_warps'\?\)"
    ):
        open_with(registry, "tuned", backends={"tuned": {"num_wraps": 8}})
    with pytest.raises(ssu.ConfigError, match=r"ssu\.backends\.tuned\.num_warps: expected an integer, got 'eight'"):
        open_with(registry, "tuned", backends={"tuned": {"num_warps": "eight"}})
    with pytest.raises(ssu.ConfigError, match="'diagonal' is not valid; use one of 'auto', 'simple', 'vertical'"):
        open_with(registry, "tuned", backends={"tuned": {"algorithm": "diagonal"}})


def test_support_hook_rejects_with_reason(site):
    with pytest.raises(ssu.BackendUnavailableError, match="algorithm 'vertical' needs an fp32 state"):
        open_with(
            site.registry(), "tuned", small_problem(state_dtype="bf16"), backends={"tuned": {"algorithm": "vertical"}}
        )


def test_options_for_backend_without_options_class(site):
    with pytest.raises(ssu.ConfigError, match="takes no options"):
        open_with(site.registry(), "good", backends={"good": {"x": 1}})


def test_options_table_for_unknown_backend(site):
    with pytest.raises(
        ssu.ConfigError, match=r"ssu\.backends\.tunde: no backend named 'tunde' \(did you mean 'tuned'\?\)"
    ):
        open_with(site.registry(), "good", backends={"tunde": {}})


def test_explain_never_raises(site):
    resolution = explain(ssu.Config(backend=["nogpu", "broken"]), small_problem(), site.registry())
    assert resolution.selected is None
    assert "nogpu" in resolution.explain() and "broken" in resolution.explain()


NOTED_BACKEND = (
    good_backend("noted")
    + """

@ssu.hookimpl
def ssu_supports(problem, options):
    return ssu.Verdict.accept(f"adds {problem.nheads} KiB a slot")
"""
)


def test_notes_of_an_accepting_verdict_are_explained(fake_site):
    fake_site.add("ssu-backend-noted", {"noted": "r_noted"}, modules={"r_noted": NOTED_BACKEND})
    registry = fake_site.registry()
    kernel = open_with(registry, "noted")
    assert "-> noted: selected: adds 4 KiB a slot" in kernel.explain()
    others = explain(ssu.Config(backend="reference"), small_problem(), registry).explain()
    assert "noted: not requested: would serve this problem; adds 4 KiB a slot" in others
    assert ssu.Verdict.accept().ok and ssu.Verdict.accept() == ssu.ACCEPT
