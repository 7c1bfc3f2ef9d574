"""What a configuration is checked for before any problem is known (ssu.plugins.preflight): the names it
gives, their option tables and values, whether each named backend imports, and, for an engine,
whether each can step an engine's cache and whether any is installed at all. Each error says where
the name came from."""

from __future__ import annotations

import pytest

import ssu
from ssu.plugins.config import load_config
from ssu.plugins.preflight import preflight

from fakes import good_backend


def config_of(backend, tmp_path, options: str = "", env_source: bool = False):
    if env_source:
        return load_config(search=False, env={"SSU_BACKEND": backend})
    (tmp_path / "ssu.toml").write_text(f"[ssu]\nbackend = {backend!r}\n{options}".replace("'", '"'))
    return load_config(tmp_path / "ssu.toml", env={})


def test_a_typo_is_named_with_where_it_came_from(fake_site, tmp_path):
    registry = fake_site.registry()
    with pytest.raises(ssu.UnknownBackendError, match=r"^SSU_BACKEND: unknown backend 'refrence'.*'reference'"):
        preflight(config_of("refrence", tmp_path, env_source=True), registry)
    with pytest.raises(ssu.UnknownBackendError, match=r"ssu.toml: backend: unknown backend 'tritn'"):
        preflight(config_of(["tritn", "reference"], tmp_path), registry)


def test_a_bad_option_or_an_options_table_of_no_backend_is_an_error(fake_site, tmp_path):
    fake_site.add("ssu-backend-good", {"good": "good_mod"}, modules={"good_mod": good_backend("good")})
    registry = fake_site.registry()
    with pytest.raises(ssu.ConfigError, match="ssu.backends.god: no backend named 'god'"):
        preflight(config_of("good", tmp_path, "[ssu.backends.god]\nx = 1\n"), registry)
    with pytest.raises(ssu.ConfigError, match="ssu.backends.good: backend 'good' takes no options"):
        preflight(config_of("good", tmp_path, "[ssu.backends.good]\nx = 1\n"), registry)
    assert preflight(config_of("good", tmp_path), registry) == ()


def test_a_broken_backend_is_an_error_where_it_is_named(fake_site, tmp_path):
    fake_site.add("ssu-backend-bad", {"bad": "bad_mod"}, modules={"bad_mod": "raise ImportError('no libfoo')"})
    registry = fake_site.registry()
    with pytest.raises(ssu.BackendBrokenError, match="ssu.toml: backend: .*no libfoo"):
        preflight(config_of(["reference", "bad"], tmp_path), registry)
    assert preflight(config_of("reference", tmp_path), registry) == ()  # installed, not named: not imported


def test_a_disabled_backend_is_a_note_for_a_file_and_an_error_for_an_engine(fake_site, tmp_path):
    fake_site.add("ssu-backend-good", {"good": "good_mod"}, modules={"good_mod": good_backend("good")})
    registry = fake_site.registry(env={"SSU_DISABLE_PLUGINS": "good"})
    config = config_of(["good", "reference"], tmp_path)
    (note,) = preflight(config, registry)
    assert "SSU_DISABLE_PLUGINS" in note
    with pytest.raises(ssu.BackendDisabledError, match="SSU_DISABLE_PLUGINS"):
        preflight(config, registry, engine=True)


def test_an_engine_needs_one_named_backend_installed(fake_site, tmp_path):
    registry = fake_site.registry()  # reference alone
    with pytest.raises(ssu.BackendNotInstalledError, match="SSU_BACKEND: no named backend is installed.*ssu-backend"):
        preflight(config_of("triton", tmp_path, env_source=True), registry, engine=True)
    assert preflight(config_of("triton", tmp_path, env_source=True), registry) == ()  # a file may name it
    (note,) = preflight(config_of(["triton", "reference"], tmp_path), registry, engine=True)
    assert note == "backend 'triton' is not installed: passed over"


@pytest.mark.parametrize(
    "name, why", [("triton-replay", "keeps state beside"), ("flashinfer-replayssm", "does not step an engine's")]
)
def test_an_engine_refuses_a_backend_that_cannot_step_its_cache(tmp_path, name, why):
    config = config_of(name, tmp_path, env_source=True)
    assert preflight(config) == ()
    with pytest.raises(
        ssu.BackendError, match=rf"^SSU_BACKEND: backend '{name}' {why}.*\(such as reference, triton, flash"
    ):
        preflight(config, engine=True)


#: a backend that keeps state beside an adopted cache (it implements ssu_sync_state), first under auto
BESIDE = """
import attrs
import ssu
from ssu import reference
from ssu.reference import ssu_adopt_state, ssu_allocate_state, ssu_commit, ssu_engine_call, ssu_read_state
from ssu.reference import ssu_write_state

@ssu.hookimpl
def ssu_backend():
    return attrs.evolve(reference.ssu_backend(), name="beside", priority=10)

@ssu.hookimpl
def ssu_sync_state(ctx, state, slots):
    return None
"""


def test_auto_for_an_engine_needs_a_backend_that_steps_its_cache(fake_site, tmp_path):
    """``auto`` is checked where the engine loads the plugin, as a named list is: with no enabled
    backend able to step an engine's cache it stops the engine; otherwise the backends it passes
    over are notes."""
    fake_site.add("ssu-backend-beside", {"beside": "beside_mod"}, modules={"beside_mod": BESIDE})
    config = config_of("auto", tmp_path, env_source=True)
    (note,) = preflight(config, fake_site.registry(), engine=True)
    assert note.startswith("auto passes over backend beside: keeps state beside the engine's cache"), note
    assert preflight(config, fake_site.registry()) == ()
    alone = fake_site.registry(env={"SSU_PLUGINS": "beside"})
    with pytest.raises(
        ssu.BackendError,
        match=r"^SSU_BACKEND: auto: no enabled backend can step an engine's cache in place \(reference: not in "
        r"SSU_PLUGINS='beside'.*; beside: keeps state beside .*\); install or enable one",
    ):
        preflight(config, alone, engine=True)
    assert preflight(config, alone) == ()  # outside an engine, auto's problems are resolved at each first call


def test_auto_for_an_engine_checks_the_options_of_every_backend_it_may_pick(fake_site, tmp_path):
    fake_site.add("ssu-backend-good", {"good": "good_mod"}, modules={"good_mod": good_backend("good")})
    config = config_of("auto", tmp_path, "[ssu.backends.good]\nx = 1\n")
    with pytest.raises(ssu.ConfigError, match="ssu.backends.good: backend 'good' takes no options"):
        preflight(config, fake_site.registry(), engine=True)
