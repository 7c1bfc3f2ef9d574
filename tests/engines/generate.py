"""vLLM generating greedily from a tiny random Mamba2 model on the CPU, in the processes vLLM
starts (front end, engine core, worker): ``python generate.py MODEL_DIR``, which prints
``TOKENS [...]``. Run by tests/engines/test_vllm_generation.py with and without ``SSU_BACKEND``."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_mamba2(directory: str) -> None:
    """A Mamba2 model of two layers with random weights, saved where vLLM loads it from."""
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=256, hidden_size=128, num_heads=4, head_dim=64, state_size=16, n_groups=1, num_hidden_layers=2,
        expand=2, conv_kernel=4, chunk_size=16,
    )  # fmt: skip
    Mamba2ForCausalLM(config).save_pretrained(directory)


def main(directory: str) -> None:
    from vllm import LLM, SamplingParams

    if not os.path.exists(os.path.join(directory, "config.json")):
        tiny_mamba2(directory)
    llm = LLM(model=directory, skip_tokenizer_init=True, max_model_len=128, enforce_eager=True, dtype="float32",
              max_num_seqs=2)  # fmt: skip
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    print("TOKENS", [list(o.outputs[0].token_ids) for o in outputs], flush=True)


if __name__ == "__main__":  # vLLM spawns its processes: the work starts only here
    main(sys.argv[1])
