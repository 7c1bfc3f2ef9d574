"""Discovery, statuses and loading with fake distributions: broken, duplicate, clashing,
incompatible, disabled, reserved, misspelled hooks."""

from __future__ import annotations

import sys

import pytest

import ssu
from ssu.state import slot_state
from ssu.plugins.registry import Registry

from fakes import good_backend


def status(registry: Registry, name: str, probe: bool = True):
    return registry.info(name, probe=probe)


def test_discovery_imports_nothing(fake_site):
    fake_site.add("ssu-backend-lazy", {"lazy": "lazy_mod"}, modules={"lazy_mod": "raise RuntimeError('imported!')"})
    registry = fake_site.registry()
    infos = {i.name: i for i in registry.list()}
    assert infos["lazy"].status == "installed"
    assert infos["lazy"].distribution == "ssu-backend-lazy"
    assert "lazy_mod" not in sys.modules
    assert [i.name for i in registry.list()][-1] == "reference"


def test_available_and_unavailable(fake_site):
    fake_site.add("ssu-backend-good", {"good": "good_mod"}, modules={"good_mod": good_backend("good")})
    fake_site.add(
        "ssu-backend-nogpu", {"nogpu": "nogpu_mod"}, modules={"nogpu_mod": good_backend("nogpu", available=False)}
    )
    registry = fake_site.registry()
    assert status(registry, "good").status == "available"
    info = status(registry, "nogpu")
    assert info.status == "unavailable"
    assert "no frobnicator here" in info.reason and "install a frobnicator" in info.reason
    assert info.capabilities is not None and info.description == "fake backend nogpu"


def test_broken_keeps_the_import_error(fake_site):
    fake_site.add(
        "ssu-backend-broken", {"broken": "broken_mod"}, modules={"broken_mod": "import does_not_exist_anywhere\n"}
    )
    registry = fake_site.registry()
    info = status(registry, "broken")
    assert info.status == "broken"
    assert "does_not_exist_anywhere" in info.reason and "ssu-backend-broken" in info.reason
    with pytest.raises(ssu.BackendBrokenError, match="does_not_exist_anywhere"):
        registry.load("broken")
    assert status(registry, "reference").status == "available"  # the host survives


def test_duplicate_entry_points_of_one_distribution_collapse(fake_site):
    fake_site.add("ssu-backend-dup", {"dup": "dup_mod"}, modules={"dup_mod": good_backend("dup")})
    fake_site.add("ssu-backend-dup", {"dup": "dup_mod"}, info_name="ssu_backend_dup_editable")
    registry = fake_site.registry()
    assert [i.name for i in registry.list()].count("dup") == 1
    assert status(registry, "dup").status == "available"


def test_name_clash_names_both_distributions(fake_site):
    fake_site.add("ssu-backend-fast", {"fast": "fast_a"}, modules={"fast_a": good_backend("fast")})
    fake_site.add("other-fast-kernels", {"fast": "fast_b"}, modules={"fast_b": good_backend("fast")})
    with pytest.warns(ssu.SSUWarning, match="more than one distribution"):
        registry = fake_site.registry()
        info = status(registry, "fast")
    assert info.status == "broken"
    assert "ssu-backend-fast" in info.reason and "other-fast-kernels" in info.reason
    with pytest.raises(ssu.BackendBrokenError, match="other-fast-kernels"):
        ssu.open(ssu.Config(backend="fast"), _problem(), registry=registry)


def test_reference_name_is_reserved(fake_site):
    fake_site.add("evil-dist", {"reference": "evil_mod"}, modules={"evil_mod": good_backend("reference")})
    registry = fake_site.registry()
    with pytest.warns(ssu.SSUWarning, match="reserved"):
        found = registry.discover()
    assert found["reference"].distribution == "ssu-core"


@pytest.mark.parametrize("api, why", [("2.0", "major differs"), ("1.99", "newer than"), ("one", "not MAJOR.MINOR")])
def test_incompatible_plugin_api(fake_site, api, why):
    fake_site.add(
        "ssu-backend-future", {"future": "future_mod"}, modules={"future_mod": good_backend("future", api=api)}
    )
    registry = fake_site.registry()
    info = status(registry, "future")
    assert info.status == "incompatible"
    assert why in info.reason
    with pytest.raises(ssu.BackendIncompatibleError, match=why):
        ssu.open(ssu.Config(backend="future"), _problem(), registry=registry)


def test_older_minor_api_is_compatible(fake_site):
    fake_site.add("ssu-backend-old", {"old": "old_mod"}, modules={"old_mod": good_backend("old", api="1.0")})
    assert status(fake_site.registry(), "old").status == "available"


@pytest.mark.parametrize(
    "env, word",
    [({"SSU_DISABLE_PLUGINS": "off"}, "SSU_DISABLE_PLUGINS"), ({"SSU_PLUGINS": "reference"}, "SSU_PLUGINS")],
)
def test_disabled_before_import(fake_site, env, word):
    fake_site.add("ssu-backend-off", {"off": "off_mod"}, modules={"off_mod": "raise RuntimeError('imported!')"})
    registry = fake_site.registry(env=env)
    info = status(registry, "off")
    assert info.status == "disabled" and word in info.reason
    assert "off_mod" not in sys.modules
    with pytest.raises(ssu.BackendDisabledError, match=word):
        ssu.open(ssu.Config(backend="off"), _problem(), registry=registry)


def test_misspelled_hook_fails_loudly(fake_site):
    source = good_backend("typo") + "\n@ssu.hookimpl\ndef ssu_warm_up(ctx, state, step):\n    pass\n"
    fake_site.add("ssu-backend-typo", {"typo": "typo_mod"}, modules={"typo_mod": source})
    info = status(fake_site.registry(), "typo")
    assert info.status == "broken"
    assert "ssu_warm_up" in info.reason and "typo" in info.reason


def test_wrong_hook_argument_fails_loudly(fake_site):
    source = good_backend("badarg") + "\n@ssu.hookimpl\ndef ssu_warmup(ctx, state, steps):\n    pass\n"
    fake_site.add("ssu-backend-badarg", {"badarg": "badarg_mod"}, modules={"badarg_mod": source})
    info = status(fake_site.registry(), "badarg")
    assert info.status == "broken" and "steps" in info.reason


def test_missing_required_hook(fake_site):
    source = good_backend("partial").replace(
        "ssu_commit, ssu_read_state, ssu_write_state", "ssu_commit, ssu_write_state"
    )
    fake_site.add("ssu-backend-partial", {"partial": "partial_mod"}, modules={"partial_mod": source})
    info = status(fake_site.registry(), "partial")
    assert info.status == "broken" and "ssu_read_state" in info.reason


def test_declared_name_must_match_entry_point(fake_site):
    fake_site.add("ssu-backend-liar", {"liar": "liar_mod"}, modules={"liar_mod": good_backend("honest")})
    info = status(fake_site.registry(), "liar")
    assert info.status == "broken" and "'honest'" in info.reason


def test_in_process_registration():
    import ssu.reference as ref_module  # noqa: F401

    registry = Registry(entry_points=[])
    plugin = _InProcess()
    assert registry.register(plugin) == "inproc"
    assert registry.info("inproc", probe=True).status == "available"
    with pytest.raises(ssu.BackendBrokenError, match="already taken"):
        registry.register(_InProcess())
    registry.unregister("inproc")
    assert "inproc" not in registry.discover()


class _InProcess:
    @ssu.hookimpl
    def ssu_backend(self):
        from ssu.reference.math import make_step

        return ssu.BackendSpec(name="inproc", api_version=ssu.PLUGIN_API_VERSION, factory=make_step)

    ssu_allocate_state = staticmethod(slot_state.ssu_allocate_state)
    ssu_read_state = staticmethod(slot_state.ssu_read_state)
    ssu_write_state = staticmethod(slot_state.ssu_write_state)


def _problem():
    from fakes import small_problem

    return small_problem()
