"""transformers' Mamba2-family models decoding through ssu (``ssu.integrations.transformers``):
the same greedy tokens and final states as transformers' own path in fp32, on the model's own
cache, across turns, padding, batch sizes and beams; every refusal leaves the model unpatched."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

import ssu  # noqa: E402
from ssu.checking import oracle  # noqa: E402
from ssu.integrations import hf_models  # noqa: E402
from ssu.integrations import transformers as integration  # noqa: E402

TOL = oracle.state_tolerance("fp32")


@pytest.fixture(autouse=True)
def fresh():
    ssu.dropin.clear()
    yield
    ssu.dropin.clear()


def prompt(batch=2, length=6, seed=0, vocab=1024):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same(own, through):
    assert torch.equal(own.sequences, through.sequences)
    states_own, states_ssu = own.recurrent_states(), through.recurrent_states()
    assert states_own and len(states_own) == len(states_ssu)
    for a, b in zip(states_own, states_ssu):
        assert oracle.rel_error(b, a) <= TOL


def ssu_calls(patch):
    """Count the calls that reach ssu's drop-in through the patched modeling modules (eagerly, after
    the config's cache lanes, which the reference backend has none of)."""
    counter = [0]
    real = ssu.dropin.after_cache_lanes

    def counting(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)

    return counter, counting


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_greedy_tokens_and_states_equal_transformers_own(arch, monkeypatch):
    model = hf_models.random_model(arch, "tiny", 2)
    ids = prompt()
    own = hf_models.generate(model, ids, 5)
    counter, counting = ssu_calls(None)
    monkeypatch.setattr(ssu.dropin.cache, "after_cache_lanes", counting)
    with integration.patch(model, backend="reference") as patch:
        through = hf_models.generate(model, ids, 5)
    assert counter[0] == 4 * len(patch.mixers) and len(patch.mixers) >= 2  # 4 decode steps per mixer
    assert_same(own, through)
    with hf_models.null_ssu(model):  # and the comparison is not vacuous: the SSU changes the states
        broken = hf_models.generate(model, ids, 5)
    assert max(oracle.rel_error(b, a) for a, b in zip(own.recurrent_states(), broken.recurrent_states())) > 0.1


def test_a_second_turn_continues_on_the_cache_ssu_wrote():
    model = hf_models.random_model("nemotron_h", "tiny", 2)
    ids = prompt()
    with integration.patch(model, backend="reference"):
        first = hf_models.generate(model, ids, 4)
        states = first.recurrent_states()
        pointers = [s.data_ptr() for s in states]
        turn = torch.cat([first.sequences, prompt(length=3, seed=1)], 1)
        second = hf_models.generate(model, turn, 4, **{hf_models.cache_keyword(model): first.cache})
    assert [s.data_ptr() for s in second.recurrent_states()] == pointers  # stepped in place, no copy
    own = hf_models.generate(model, turn, 4)  # transformers alone, from scratch
    assert torch.equal(second.sequences, own.sequences)


def test_generate_and_a_second_turn_use_no_deprecated_cache_name(monkeypatch):
    """The cache is read from a generate output and passed to the next turn under the name the
    installed transformers takes: no FutureWarning, and no deprecation in its log (logged once
    per process, so the log method is replaced for this test)."""
    import logging
    import warnings

    logged = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, *args, **kw: logged.append(args), raising=False)
    model = hf_models.random_model("mamba2", "tiny", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        first = hf_models.generate(model, prompt(), 3)
        turn = torch.cat([first.sequences, prompt(length=3, seed=1)], 1)
        second = hf_models.generate(model, turn, 3, **{hf_models.cache_keyword(model): first.cache})
    assert first.cache is not None and second.recurrent_states()
    assert not [args for args in logged if "deprecated" in str(args)], logged


def test_left_padding_a_changing_batch_and_beams():
    model = hf_models.random_model("mamba2", "tiny", 2)
    ids = prompt(batch=3)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    runs = dict(
        padded=dict(input_ids=ids, attention_mask=mask),
        small=dict(input_ids=ids[:1]),
        beams=dict(input_ids=ids[:2], num_beams=2),
    )
    own = {
        k: hf_models.generate(model, v.pop("input_ids"), 4, **v)
        for k, v in {k: dict(v) for k, v in runs.items()}.items()
    }
    with integration.patch(model, backend="reference"):
        through = {
            k: hf_models.generate(model, v.pop("input_ids"), 4, **v)
            for k, v in {k: dict(v) for k, v in runs.items()}.items()
        }
    for name in runs:
        assert torch.equal(own[name].sequences, through[name].sequences), name


def test_triton_in_the_interpreter():
    pytest.importorskip("triton")
    model = hf_models.random_model("mamba2", "tiny", 1)
    ids = prompt(batch=1, length=4)
    own = hf_models.generate(model, ids, 3)
    with integration.patch(model, backend="triton"):
        through = hf_models.generate(model, ids, 3)
    assert ssu.dropin.cache._kernels and {k.backend for k in ssu.dropin.cache._kernels.values()} == {"triton"}
    assert_same(own, through)


def test_only_the_patched_model_is_routed_and_undo_restores(monkeypatch):
    patched, other = hf_models.random_model("mamba2", "tiny", 2), hf_models.random_model("mamba2", "tiny", 2, seed=1)
    module = sys.modules[type(integration.find_mixers(patched)[0][1]).__module__]
    original = getattr(module, integration.FUNCTION)
    counter, counting = ssu_calls(None)
    monkeypatch.setattr(ssu.dropin.cache, "after_cache_lanes", counting)
    patch = integration.patch(patched, backend="reference")
    assert getattr(module, integration.FUNCTION) is not original and integration.patched(patched) is patch
    hf_models.generate(other, prompt(), 3)
    assert counter[0] == 0  # another model of the same architecture keeps transformers' own SSU
    hf_models.generate(patched, prompt(), 3)
    assert counter[0] == 4
    mixers = [m for _, m in integration.find_mixers(patched)]
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in mixers)  # torch's fast call path
    patch.undo()
    assert getattr(module, integration.FUNCTION) is original and integration.patched(patched) is None
    assert all("forward" not in m.__dict__ for m in mixers)
    patch.undo()  # a second undo does nothing


def test_refusals_leave_the_model_unpatched():
    from transformers import AutoConfig, AutoModelForCausalLM

    mamba1 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("mamba", hidden_size=16, state_size=4, num_hidden_layers=1, vocab_size=32)
    )
    with pytest.raises(integration.UnsupportedModelError, match="Mamba-1 mixers .* not serve"):
        integration.patch(mamba1)
    model = hf_models.random_model("nemotron_h", "tiny", 1)
    module = sys.modules[type(integration.find_mixers(model)[0][1]).__module__]
    original = getattr(module, integration.FUNCTION)
    with pytest.raises(
        ssu.ConfigError,
        match=r"mixer .* cannot be served: backend 'flashinfer' is installed but "
        r"unavailable on cpu",
    ):
        integration.patch(model, backend="flashinfer")
    assert getattr(module, integration.FUNCTION) is original and integration.patched(model) is None
    assert not any("forward" in m.__dict__ for _, m in integration.find_mixers(model))
    with integration.patch(model, backend="reference"):
        with pytest.raises(ssu.ConfigError, match="is patched already"):
            integration.patch(model, backend="reference")
    with pytest.raises(ssu.ConfigError, match="Mamba-1 architecture"):
        hf_models.random_model("jamba", "tiny", 1)
    with pytest.raises(integration.UnsupportedModelError, match="has no Mamba2 mixer"):
        integration.patch(torch.nn.Linear(2, 2))


def test_compare_prints_both_paths_and_the_ssu_call_where_it_runs(capsys):
    from ssu.cli.main import main

    assert main(["compare", "--arch", "mamba2", "--layers", "2", "--new-tokens", "4", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "SSU call us" in out and "above zeros" in out
    assert "ssu (reference)" in out and "transformers" in out and "zeros (no SSU)" in out
    assert "tokens: 4/4 equal (100.0 %)" in out
    # 3 one-token steps after the prefill, 2 layers, 3 turns
    assert "one layer's SSU call in the decode steps through ssu:" in out and "(18 calls of 2 layers)" in out
    assert "kernel alone" not in out  # a device time is measured on CUDA only


def test_timed_calls_keep_each_decode_call_and_put_the_function_back():
    model = hf_models.random_model("mamba2", "tiny", 2)
    ids = hf_models.prompt_ids(model, length=5)
    module = sys.modules[type(integration.find_mixers(model)[0][1]).__module__]
    before = getattr(module, integration.FUNCTION)
    with hf_models.timed_calls(model) as seconds:
        hf_models.generate(model, ids, 3)
    assert getattr(module, integration.FUNCTION) is before
    assert len(seconds) == 2 * 2 and all(s > 0 for s in seconds)  # 2 one-token steps, 2 layers; not the prefill
    result = hf_models.compare(model, ids, 3, config=ssu.Config(backend="reference"), null=True, rounds=2)
    for run in (result.reference, result.through_ssu, result.null_ssu):
        assert len(run.call_seconds) == 2 * 2 * 2 and run.per_call > 0


def test_first_decode_call_records_what_the_mixer_passes():
    model = hf_models.random_model("nemotron_h", "tiny", 2)
    args, kwargs = hf_models.first_decode_call(model, prompt())
    state, x = args[0], args[1]
    H, P, N, _ = hf_models.PRESETS["tiny"]
    assert state.shape[1:] == (H, P, N) and x.shape[1:] == (H, P)
    assert kwargs["dt_softplus"] is True and hf_models.kernel_us(model, prompt(), ssu.Config()) is None
