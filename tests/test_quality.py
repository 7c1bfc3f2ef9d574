"""The quality study: the recall task, the Mamba2 model decoding through ssu (held to
transformers' own forward), the shipped trained model's answers at every state dtype, and a
wrong SSU shown to change them."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

import ssu
from ssu.quality import study
from ssu.quality.model import Mamba2LM
from ssu.quality.recall import BOS, FILLER0, KEY0, QUERY, VALUE0, VOCAB, RecallTask

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKPOINT = os.path.join(HERE, "models", "mamba2-recall")
REFERENCE = ssu.Config(backend="reference")
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


@pytest.fixture(scope="module")
def lm():
    return Mamba2LM.load(CHECKPOINT)


def test_a_recall_sequence_is_pairs_filler_query_and_its_recital_is_every_key_in_order():
    task = RecallTask()
    prompts, answers = task.sequences(5, 30, seed=4)
    assert prompts.shape == (5, 2 + 2 * task.keys + 30) and answers.shape == (5, 2 * task.keys)
    assert (prompts[:, 0] == BOS).all() and (prompts[:, -1] == QUERY).all()
    pairs = prompts[:, 1 : 1 + 2 * task.keys]
    keys, values = pairs[:, 0::2], pairs[:, 1::2]
    assert (keys.sort(1).values == KEY0 + torch.arange(task.keys)).all()  # every key once
    assert ((values >= VALUE0) & (values < VALUE0 + task.values)).all()
    filler = prompts[:, 1 + 2 * task.keys : -1]
    assert ((filler >= FILLER0) & (filler < VOCAB)).all() and len(filler.unique()) > 10
    assert (answers[:, 0::2] == KEY0 + torch.arange(task.keys)).all()
    for row in range(5):  # the recital gives each key the value it had in the prompt
        given = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert answers[row, 1::2].tolist() == [given[k] for k in answers[row, 0::2].tolist()]
    assert task.accuracy(answers, answers) == 1.0
    wrong = answers.clone()
    wrong[:, 1] = VALUE0 + (wrong[:, 1] - VALUE0 + 1) % task.values
    assert task.accuracy(wrong, answers) == pytest.approx(1 - 1 / task.keys)


def test_the_task_refuses_sizes_its_vocabulary_does_not_hold():
    with pytest.raises(ValueError):
        RecallTask(keys=17)
    with pytest.raises(ValueError):
        RecallTask().sequences(0, 10)


@pytest.mark.slow
@needs_transformers
def test_the_decoder_gives_transformers_logits_token_by_token(lm):
    from transformers import Mamba2ForCausalLM

    model = Mamba2ForCausalLM.from_pretrained(CHECKPOINT).eval()
    prompts, answers = RecallTask().sequences(3, 40, seed=1)
    ids = torch.cat([prompts, answers], 1)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    decoder = lm.decoder(REFERENCE, "fp32", 3)
    with torch.inference_mode():
        got = torch.stack([decoder.step(ids[:, t]) for t in range(ids.shape[1])], 1)
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()


def test_an_8bit_decoder_keeps_its_states_in_8_bits_with_row_scales(lm):
    decoder = lm.decoder(REFERENCE, "int8", 2)
    with torch.inference_mode():
        decoder.feed(RecallTask().sequences(2, 5, seed=2)[0])
    cache, scales = decoder.cache[0], decoder.scales[0]
    assert cache.dtype == torch.int8 and cache.shape == (2, lm.nheads, lm.headdim, lm.dstate)
    assert scales.dtype == torch.float32 and scales.shape == (2, lm.nheads, lm.headdim)
    assert cache.abs().amax().item() == 127 and (scales > 0).any()


def test_a_snapshot_loaded_at_fp32_continues_exactly(lm):
    prompts, _ = RecallTask().sequences(2, 20, seed=3)
    with torch.inference_mode():
        first = lm.decoder(REFERENCE, "fp32", 2)
        first.feed(prompts)
        second = lm.decoder(REFERENCE, "fp32", 2)
        second.load(first.snapshot())
        token = torch.tensor([KEY0, KEY0])
        assert torch.equal(first.step(token), second.step(token))


@pytest.mark.parametrize("prefill", study.PREFILLS)
def test_the_trained_model_recites_at_every_state_dtype(lm, prefill):
    rows = study.recitals(lm, REFERENCE, ["bf16", "int8", "fp8_e4m3"], [64], n=8, prefill=prefill)
    assert [r.state_dtype for r in rows] == ["fp32", "bf16", "int8", "fp8_e4m3"]
    assert rows[0].accuracy >= 0.95 and rows[0].agreement == 1.0
    for row in rows[1:]:
        assert row.accuracy >= 0.9 and row.agreement >= 0.9, row


class _WrongSSU:
    """A kernel whose step is the reference's with one thing wrong (``how``)."""

    def __init__(self, kernel, how: str):
        self.kernel, self.how = kernel, how

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def step(self, state, x, dt, A, B, C, slots, **kw):
        if self.how == "B and C swapped":
            B, C = C, B
        elif self.how == "dt_bias dropped":
            kw["dt_bias"] = None
        elif self.how == "no state written":
            kw["dst_slots"] = torch.full_like(slots, -1)
        elif self.how == "another sequence's state read":
            slots, kw["dst_slots"] = slots.roll(1), slots
        return self.kernel.step(state, x, dt, A, B, C, slots, **kw)


@pytest.mark.parametrize(
    "how", ["B and C swapped", "dt_bias dropped", "no state written", "another sequence's state read"]
)
def test_a_wrong_ssu_changes_the_trained_models_answers(lm, how):
    task = RecallTask()
    prompts, answers = task.sequences(8, 32, seed=5)
    with torch.inference_mode():
        decoder = lm.decoder(REFERENCE, "fp32", 8)
        decoder.kernel = _WrongSSU(decoder.kernel, how)
        wrong = decoder.generate(decoder.feed(prompts), task.answer_len)
        right = lm.decoder(REFERENCE, "fp32", 8)
        right = right.generate(right.feed(prompts), task.answer_len)
    assert task.accuracy(right, answers) >= 0.95
    assert task.accuracy(wrong, answers) < 0.6
    assert (wrong != right).any(1).float().mean().item() >= 0.75  # most sequences' tokens change


def test_a_long_run_measures_drift_and_recites_from_its_own_state(lm):
    run = study.long_run(lm, REFERENCE, ["fp32", "bf16", "int8"], checkpoints=(30, 60), n=2)
    assert [(r.state_dtype, r.steps) for r in run.drift] == [("bf16", 30), ("int8", 30), ("bf16", 60), ("int8", 60)]
    for row in run.drift:
        assert 0 < row.median_error <= row.max_error < 0.5 and 0.5 <= row.token_agreement <= 1
    assert [r.state_dtype for r in run.recitals] == ["fp32", "bf16", "int8"]
    assert run.recitals[0].gap == 60 - 2 - 2 * RecallTask().keys and run.recitals[0].agreement == 1.0


def test_the_model_refuses_what_it_does_not_compute(tmp_path):
    with open(os.path.join(CHECKPOINT, "config.json")) as f:
        config = json.load(f)
    tensors = Mamba2LM.load(CHECKPOINT).tensors
    with pytest.raises(ssu.ConfigError, match="mamba2"):
        Mamba2LM(dict(config, model_type="mamba"), tensors)
    with pytest.raises(ssu.ConfigError, match="time_step_limit"):
        Mamba2LM(dict(config, time_step_limit=[0.0, 0.1]), tensors)


@pytest.mark.slow
@needs_transformers
def test_the_training_script_makes_a_model_of_the_shipped_configuration(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(HERE, "models"))
    try:
        import train_recall_model
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(train_recall_model, "PHASES", [(2, 2, 4, 8, 1e-3)])
    train_recall_model.train(str(tmp_path))
    with open(tmp_path / "config.json") as f, open(os.path.join(CHECKPOINT, "config.json")) as g:
        made, shipped = json.load(f), json.load(g)
    assert {k: v for k, v in made.items() if k != "transformers_version"} == {
        k: v for k, v in shipped.items() if k != "transformers_version"
    }
    assert Mamba2LM.load(str(tmp_path)).num_layers == 2


@pytest.mark.slow
def test_8bit_states_hold_the_answers_across_a_thousand_filler_steps(lm):
    rows = study.recitals(lm, REFERENCE, ["int8", "fp8_e4m3"], [1000], n=8, prefill="steps")
    assert rows[0].accuracy >= 0.95
    assert all(r.accuracy >= rows[0].accuracy - 0.05 for r in rows[1:]), rows
