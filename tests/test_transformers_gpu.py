"""transformers models decoding through the GPU backends (marker ``gpu``): the same greedy tokens
as transformers' own path in fp32; in bf16 a token may flip only where transformers' own top-two
logits are closer than the two paths' logits differ (judged by that margin, not a tolerance)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import ssu  # noqa: E402
from ssu.checking import oracle  # noqa: E402
from ssu.integrations import hf_models  # noqa: E402

pytestmark = pytest.mark.gpu

#: mixer shapes FlashInfer builds (P, N >= 32), small enough for many tests
SHAPES = (8, 64, 128, 2)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["nemotron_h", "mamba2"])
def test_generation_through_a_gpu_backend(backend, dtype, arch):
    ssu.dropin.clear()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = hf_models.random_model(arch, "tiny", 2, dtype=torch_dtype, device="cuda", shapes=SHAPES)
    ids = torch.randint(0, 1024, (4, 8), generator=torch.Generator().manual_seed(0)).cuda()
    result = hf_models.compare(model, ids, 12, config=ssu.Config(backend=backend))
    assert {k.backend for k in ssu.dropin.cache._kernels.values()} == {backend}
    if dtype == "fp32":
        assert torch.equal(result.reference.sequences, result.through_ssu.sequences)
        for a, b in zip(result.reference.recurrent_states(), result.through_ssu.recurrent_states()):
            assert oracle.rel_error(b, a) <= oracle.state_tolerance("fp32")
    else:
        assert result.divergence_within_rounding(), result.first_divergence()
    ssu.dropin.clear()
