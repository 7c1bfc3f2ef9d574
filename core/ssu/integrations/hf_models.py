"""transformers models to compare on: a Mamba2-family architecture with random weights at a
model's real mixer shapes, or a checkpoint (a local folder, or a hub name when the user gives
one), and greedy generation timed per token.

Used by ``ssu compare`` and the integration's tests; imports transformers when called.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import attrs

from ..contract.errors import ConfigError
from .shapes import MODEL_SHAPES

#: architecture -> how its config names the mixer shapes and layer kinds (all layers Mamba2)
ARCHITECTURES = ("mamba2", "nemotron_h", "falcon_h1", "bamba", "granitemoehybrid", "zamba2")
#: architectures transformers has whose SSU is not Mamba2's
MAMBA1 = ("mamba", "falcon_mamba", "jamba")
#: mixer shapes (H, P, N, G) by preset; "tiny" is for a CPU
PRESETS = {
    "tiny": (8, 8, 16, 2),
    **{name: (s["nheads"], s["headdim"], s["dstate"], s["ngroups"]) for name, s in MODEL_SHAPES.items()},
}


def config_fields(arch: str, H: int, P: int, N: int, G: int, layers: int, vocab: int) -> dict:
    """The transformers config of ``arch`` with ``layers`` Mamba2 layers of mixer shape (H, P, N,
    G), a hidden size of H*P/2 (expand 2) and a vocabulary of ``vocab``; the hybrid architectures
    get one attention layer after them (transformers' generate needs one in a hybrid's cache)."""
    hidden = H * P // 2
    heads = max(2, hidden // 128)
    attention = dict(num_attention_heads=heads, num_key_value_heads=1, intermediate_size=2 * hidden)
    mamba = dict(
        mamba_n_heads=H, mamba_d_head=P, mamba_d_state=N, mamba_n_groups=G, hidden_size=hidden, vocab_size=vocab
    )
    if arch == "mamba2":
        return dict(
            num_heads=H,
            head_dim=P,
            hidden_size=hidden,
            state_size=N,
            n_groups=G,
            expand=2,
            num_hidden_layers=layers,
            vocab_size=vocab,
        )
    if arch == "nemotron_h":
        return dict(
            mamba_num_heads=H,
            mamba_head_dim=P,
            hidden_size=hidden,
            ssm_state_size=N,
            n_groups=G,
            num_hidden_layers=layers + 1,
            hybrid_override_pattern="M" * layers + "*",
            vocab_size=vocab,
            **attention,
        )
    if arch == "falcon_h1":  # attention runs beside the mixer in every layer
        return dict(mamba, mamba_d_ssm=H * P, num_hidden_layers=layers, mamba_rms_norm=False, **attention)
    if arch == "bamba":
        return dict(mamba, mamba_expand=2, attn_layer_indices=[layers], num_hidden_layers=layers + 1, **attention)
    if arch == "granitemoehybrid":
        return dict(
            mamba,
            mamba_expand=2,
            layer_types=["mamba"] * layers + ["attention"],
            num_hidden_layers=layers + 1,
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=2 * hidden,
            **attention,
        )
    if arch == "zamba2":
        return dict(
            n_mamba_heads=H,
            mamba_headdim=P,
            mamba_d_state=N,
            mamba_ngroups=G,
            hidden_size=hidden,
            vocab_size=vocab,
            mamba_expand=2,
            layers_block_type=["mamba"] * layers + ["hybrid"],
            num_hidden_layers=layers + 1,
            attention_head_dim=2 * hidden // heads,
            **attention,
        )
    raise ConfigError(_unknown_arch(arch))


def _unknown_arch(arch: str) -> str:
    from ..contract.options import did_you_mean

    if arch in MAMBA1:
        return (
            f"--arch {arch}: a Mamba-1 architecture (its SSU takes parameters that vary along the head "
            f"dimension), which ssu does not serve; use one of {', '.join(ARCHITECTURES)}"
        )
    return (
        f"--arch {arch!r} is not a Mamba2-family architecture{did_you_mean(arch, ARCHITECTURES)}; use one of "
        f"{', '.join(ARCHITECTURES)}"
    )


def random_model(
    arch: str,
    preset: str,
    layers: int,
    *,
    vocab: int = 1024,
    dtype=None,
    device: str = "cpu",
    seed: int = 0,
    shapes: Optional[tuple] = None,
    chunk_size: Optional[int] = None,
):
    """A causal LM of ``arch`` with random weights (seeded) at ``preset``'s mixer shapes, its
    mixers' dt_bias and A_log drawn as in a trained model (transformers' initial dt is about
    0.01, under which a decode step barely changes the state)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ConfigError(_unknown_arch(arch))
    H, P, N, G = shapes or PRESETS[preset]
    torch.manual_seed(seed)
    fields = config_fields(arch, H, P, N, G, layers, vocab)
    if chunk_size is not None:  # the prefill's chunk: transformers' torch scan holds (batch, H, chunk, chunk) terms
        fields["chunk_size" if arch in ("mamba2", "nemotron_h", "zamba2") else "mamba_chunk_size"] = chunk_size
    try:
        config = AutoConfig.for_model(arch, **fields)
    except (ValueError, TypeError) as exc:  # transformers' own validation of the config
        raise ConfigError(
            f"transformers refuses a {arch} config of H={H} P={P} N={N} G={G}: {str(exc).splitlines()[-1]}"
        ) from None
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    with torch.no_grad():  # a trained layer's dt is around 1: each decode step moves the state visibly
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.dt_bias.uniform_(-1.0, 1.0)
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.0, 2.0))
    return model.eval()


def not_a_checkpoint(where: str):
    """Why the local folder ``where`` holds no checkpoint (not there, not a folder, no
    ``config.json``), or None where it may: said before transformers, which takes a path that is
    not a folder for a hub name and answers with the hub's rules for names."""
    import os

    if not os.path.exists(where):
        return "no such folder"
    if not os.path.isdir(where):
        return "not a folder"
    if not os.path.isfile(os.path.join(where, "config.json")):
        return "the folder has no config.json, so it holds no transformers checkpoint"
    return None


def pretrained_model(where: str, *, hub: bool, dtype=None, device: str = "cpu"):
    """A checkpoint: a local folder, or (``hub``) a name on the Hugging Face hub, downloaded if
    needed; a folder that is not there, or a hub that cannot be reached, is a clear error."""
    import torch
    from transformers import AutoModelForCausalLM

    if not hub and not_a_checkpoint(where):
        raise ConfigError(
            f"checkpoint {where!r}: {not_a_checkpoint(where)}; give a checkpoint folder (config.json and weights)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype or torch.float32, local_files_only=not hub)
    except OSError as exc:
        what = (
            f"the hub model {where!r} could not be loaded (offline, or no such model?)"
            if hub
            else f"no checkpoint in {where!r} (a folder with config.json and weights)"
        )
        raise ConfigError(f"{what}: {str(exc).splitlines()[0]}") from None
    return model.to(device).eval()


@attrs.define
class Generation:
    """One greedy generation: the tokens, each step's logits, seconds per decode step, the cache."""

    sequences: object
    logits: object
    step_seconds: list
    cache: object = None
    #: host seconds of each one-token SSU call the mixers made (kept by :func:`compare`)
    call_seconds: list = attrs.Factory(list)

    def recurrent_states(self) -> list:
        """The cache's SSM state tensor of each Mamba2 layer, in layer order."""
        layers = getattr(self.cache, "layers", [])
        return [
            layer.recurrent_states[0]
            for layer in layers
            if getattr(layer, "recurrent_states", None) and layer.recurrent_states[0] is not None
        ]

    @property
    def per_token(self) -> float:
        """Median seconds per generated token after the first (prefill excluded)."""
        return statistics.median(self.step_seconds) if self.step_seconds else float("nan")

    @property
    def per_call(self) -> float:
        """Median host seconds of one layer's one-token SSU call inside the decode steps."""
        return statistics.median(self.call_seconds) if self.call_seconds else float("nan")


def generate(model, input_ids, new_tokens: int, *, attention_mask=None, **kwargs) -> Generation:
    """Greedy ``generate`` with each step's logits and the time between consecutive steps (the
    device synchronised at each: both paths compared pay the same)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list = []
    cuda = input_ids.device.type == "cuda"

    class Clock(LogitsProcessor):
        def __call__(self, ids, scores):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        logits_processor=LogitsProcessorList([Clock()]),
        **kwargs,
    )
    return Generation(
        out.sequences, torch.stack(out.logits, 1), [b - a for a, b in zip(stamps, stamps[1:])], _cache_of(out)
    )


def _cache_of(out):
    """The cache a ``generate`` output holds: its ``cache`` field where it has one (reading the
    older name ``past_key_values`` there logs transformers' deprecation warning), else
    ``past_key_values`` (transformers before that rename)."""
    return out.cache if "cache" in getattr(type(out), "__dataclass_fields__", {}) else out.past_key_values


def cache_keyword(model) -> str:
    """How ``generate`` takes an existing cache: ``cache`` where the model's forward takes it (the
    older names are deprecated there), else ``cache_params`` (Mamba2) or ``past_key_values``."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "cache_params") if name in parameters), "past_key_values")


@attrs.define
class Comparison:
    """transformers' own decode against ssu's, on the same model and prompts."""

    reference: Generation
    through_ssu: Generation
    null_ssu: Optional[Generation] = None

    @property
    def agreement(self) -> float:
        """Fraction of generated tokens equal to transformers' own."""
        a, b = self.reference.sequences, self.through_ssu.sequences
        n = self.reference.logits.shape[1]
        return (a[:, -n:] == b[:, -n:]).float().mean().item()

    def first_divergence(self) -> Optional[tuple]:
        """(row, step) of the first generated token that differs, or None."""
        n = self.reference.logits.shape[1]
        diff = self.reference.sequences[:, -n:] != self.through_ssu.sequences[:, -n:]
        if not diff.any():
            return None
        step = int(diff.any(0).nonzero()[0])
        return int(diff[:, step].nonzero()[0]), step

    def max_logit_difference(self) -> float:
        """Largest |logit| difference over the steps before the first divergence (after it the
        two paths decode different tokens)."""
        first = self.first_divergence()
        end = self.reference.logits.shape[1] if first is None else first[1] + 1
        a, b = self.reference.logits[:, :end].float(), self.through_ssu.logits[:, :end].float()
        return (a - b).abs().max().item()

    def divergence_within_rounding(self) -> bool:
        """A flip is explained by rounding when transformers' own top-two logits at that step are
        closer than twice the largest logit difference between the two paths there."""
        first = self.first_divergence()
        if first is None:
            return True
        row, step = first
        top = self.reference.logits[row, step].float().topk(2).values
        gap = (self.reference.logits[row, step].float() - self.through_ssu.logits[row, step].float()).abs().max()
        return bool(top[0] - top[1] <= 2 * gap)


def compare(
    model,
    input_ids,
    new_tokens: int,
    *,
    config=None,
    attention_mask=None,
    null: bool = False,
    warm: bool = True,
    rounds: int = 3,
    state_rounding: Optional[str] = None,
) -> Comparison:
    """Greedy generation with transformers' own path, then through ssu (``patch(model, config)``),
    each warmed up first; with ``null`` also with the SSU replaced by one that returns zeros, so
    that the SSU's share of a token's time is the difference. The paths take turns ``rounds``
    times and each keeps the step times of all its rounds (the tokens and logits of its first),
    so that a drift of the host moves them alike. ``state_rounding``: the patched path rounds the
    cache to an 8-bit cache's contents after each step (:func:`ssu.integrations.transformers.patch`)."""
    from . import transformers as integration

    def timed():
        with timed_calls(model) as seconds:
            run = generate(model, input_ids, new_tokens, attention_mask=attention_mask)
        run.call_seconds = seconds
        return run

    def run_all(first: bool):
        if first and warm:
            generate(model, input_ids, 2, attention_mask=attention_mask)
        runs = [timed()]
        with integration.patch(model, config, state_rounding=state_rounding):
            if first and warm:
                generate(model, input_ids, 2, attention_mask=attention_mask)
            runs.append(timed())
        if null:
            with null_ssu(model):
                runs.append(timed())
        return runs

    kept = run_all(True)
    for _ in range(rounds - 1):
        for run, more in zip(kept, run_all(False)):
            run.step_seconds.extend(more.step_seconds)
            run.call_seconds.extend(more.call_seconds)
    return Comparison(kept[0], kept[1], kept[2] if null else None)


class replaced_ssu:
    """Within it, the decode SSU function of each modeling module of ``model``'s mixers is
    ``replacement(function)``, ``function`` being what is there now (the original, or a patch's);
    each is put back on leaving."""

    def __init__(self, model, replacement) -> None:
        from . import transformers as integration

        self.modules = sorted({type(m).__module__ for _, m in integration.find_mixers(model)})
        self.replacement = replacement
        self.saved: dict = {}

    def __enter__(self):
        import sys

        from . import transformers as integration

        for name in self.modules:
            function = self.saved[name] = getattr(sys.modules[name], integration.FUNCTION)
            setattr(sys.modules[name], integration.FUNCTION, self.replacement(function))
        return self

    def __exit__(self, *exc) -> None:
        import sys

        from . import transformers as integration

        for name, function in self.saved.items():
            setattr(sys.modules[name], integration.FUNCTION, function)


class timed_calls(replaced_ssu):
    """Within it, the host time of every one-token SSU call ``model``'s mixers make is appended to
    the list it yields: the function in force (the original, a patch's or :class:`null_ssu`'s)
    wrapped with a clock. The SSU's share of a token measured where it runs, between the layer's
    other operations, without the noise of the whole step's time; every path pays the clock alike."""

    def __init__(self, model) -> None:
        self.seconds: list = []
        clock, seconds = time.perf_counter, self.seconds

        def clocked(function):
            def timed(state, x, *args, **kwargs):
                start = clock()
                out = function(state, x, *args, **kwargs)
                if x.dim() == 3:  # one token per sequence: a decode step's call
                    seconds.append(clock() - start)
                return out

            return timed

        super().__init__(model, clocked)

    def __enter__(self) -> list:
        super().__enter__()
        return self.seconds


class null_ssu(replaced_ssu):
    """Within it, the model's decode SSU returns zeros and leaves the state (timing only)."""

    def __init__(self, model) -> None:
        super().__init__(model, lambda function: lambda state, x, *a, **k: x.new_zeros(x.shape))


def first_decode_call(model, input_ids) -> tuple:
    """``(args, kwargs)`` of the first one-token SSU call a greedy generate of ``model`` makes (two
    tokens), as the mixer passes them to its modeling module's function (patched or not)."""
    seen: list = []

    def recording(function):
        def call(*args, **kwargs):
            if not seen and args[1].dim() == 3:
                seen.append((args, kwargs))
            return function(*args, **kwargs)

        return call

    with replaced_ssu(model, recording):
        generate(model, input_ids, 2)
    if not seen:
        raise ConfigError(f"{type(model).__name__}: generate made no one-token SSU call to record")
    return seen[0]


def kernel_us(model, input_ids, config) -> Optional[float]:
    """Device microseconds of one layer's SSU kernel alone at ``model``'s decode step, through ssu
    with ``config`` (CUDA-graph replays of the backend's step callable on a first decode call's
    arguments); None off CUDA or for a backend whose step a graph cannot capture."""
    from .. import dropin
    from ..measure.timing import graph_time_us
    from . import transformers as integration

    if input_ids.device.type != "cuda":
        return None
    with integration.patch(model, config) as patch:
        args, kwargs = first_decode_call(model, input_ids)
        state, x, dt, A, B, C, D = args[:7]
        found = dropin.served(state, patch.config)
        if found is None or not found[0].capabilities.cuda_graphs:
            return None
        import torch

        slots = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
        out = torch.empty_like(x)
        raw, adopted = found[0].raw_step, found[1]
        z, dt_bias = kwargs.get("z"), kwargs.get("dt_bias")
        with torch.no_grad():
            return graph_time_us(
                [lambda: raw(adopted, x, dt, A, B, C, slots, D, z, dt_bias, True, out, 0, None)], min_launches=20
            )


def prompt_ids(model, batch: int = 1, length: int = 8, seed: int = 0):
    """Random prompt tokens for ``model`` (batch, length), on its device."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(next(model.parameters()).device)
