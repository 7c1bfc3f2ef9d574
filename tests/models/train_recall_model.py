"""Train the recall model shipped beside this script: a 2-layer Mamba2 (transformers'
``Mamba2ForCausalLM``, 64k parameters) that recites key-value pairs after up to thousands of
filler tokens (the task of :mod:`ssu.quality.recall`), trained on the CPU in minutes.

    python tests/models/train_recall_model.py [OUT_FOLDER]   # default: tests/models/mamba2-recall

It trains on the recital's tokens only, in two phases of growing gaps (a curriculum: the pairs
are found first on short sequences, then kept across long ones), and prints the loss and the
values' accuracy as it goes. torch's seed and the task's draws are fixed; the result depends on
torch's CPU kernels, so a rerun on another machine or torch gives a model of the same quality,
not the same bytes. What the model does at each state dtype: docs/quality.md, made by
benchmarks/state_quality.py.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from ssu.quality.recall import BOS, QUERY, VOCAB, RecallTask

HERE = os.path.dirname(os.path.abspath(__file__))
#: (steps, batch, shortest gap, longest gap, learning rate) of each phase
PHASES = [(450, 32, 8, 200, 3e-3), (120, 8, 200, 1500, 1e-3)]


def model():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_heads=4, head_dim=32, state_size=32, n_groups=1, num_hidden_layers=2,
        expand=2, conv_kernel=4, chunk_size=64, tie_word_embeddings=True, pad_token_id=0, bos_token_id=BOS,
        eos_token_id=QUERY,
    )  # fmt: skip
    return Mamba2ForCausalLM(config)


def train(out: str) -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    task = RecallTask()
    lm = model()
    opt = torch.optim.AdamW(lm.parameters(), PHASES[0][4], weight_decay=0.0)
    draws = torch.Generator().manual_seed(1)
    began, step = time.time(), 0
    for steps, batch, shortest, longest, lr in PHASES:
        for group in opt.param_groups:
            group["lr"] = lr
        for _ in range(steps):
            gap = int(torch.randint(shortest, longest, (1,), generator=draws))
            prompts, answers = task.sequences(batch, gap, generator=draws)
            ids = torch.cat([prompts, answers], 1)
            logits = lm(input_ids=ids).logits[:, prompts.shape[1] - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), answers.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if step % 25 == 0:
                accuracy = task.accuracy(logits.argmax(-1), answers)
                print(
                    f"step {step} gap {gap} loss {loss.item():.3f} accuracy {accuracy:.3f} {time.time() - began:.0f} s"
                )
            step += 1
    lm.save_pretrained(out)
    print(f"saved {out} after {step} steps, {time.time() - began:.0f} s")


if __name__ == "__main__":
    train(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "mamba2-recall"))
