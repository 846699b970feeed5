"""The e2e suite's tiny DiT file (the try-out's: comfy/multidevice/tryout/models.py), loaded by
upstream's `comfy.sd.load_diffusion_model`, must carry a rounding-sized change of its text input
through at rounding size.

tests/e2e/test_workflows.py compares each workflow at 4 cards against one card. There the text
encoder runs tensor parallel and sums its split layers in another order than one card does
(measured: 8e-7 of max |value|), so the DiT receives text states that differ by that much. If
the DiT turned such a change into a large one, the comparison would measure the rounding, not
the pipeline. The released ConvRot int8 form does: it rounds each block linear's input to int4
per token, a step function. Here, text changed by 1e-5 (ten times the encoder's difference)
moved the ConvRot form's output by 1.2e-2 and the fp32 form's by 4e-7.
"""

from __future__ import annotations

import pytest
import torch

from tests.sp_cases import rel_diff

TEXT_CHANGE = 1e-5  # relative, per value: ten times the tensor-parallel text encoder's difference
MAX_OUTPUT_CHANGE = 1e-5  # of max |output|


@pytest.fixture(scope="module")
def e2e_dit(upstream, tmp_path_factory):
    import comfy.sd
    import safetensors.torch
    from comfy.multidevice.tryout.models import dit_state_dict
    path = tmp_path_factory.mktemp("e2e-dit") / "dit.safetensors"
    safetensors.torch.save_file(dit_state_dict(1), str(path))
    with torch.inference_mode():
        return comfy.sd.load_diffusion_model(str(path)).model.diffusion_model


def test_the_e2e_dit_passes_a_text_rounding_change_on_at_rounding_size(upstream, e2e_dit):
    from comfy.multidevice.tryout.models import DIT
    g = torch.Generator().manual_seed(0)
    # the e2e workflows' sizes: 39 frames of 128x128 (12 x 8 x 8 latents), 65 audio latents, 147 text tokens
    video, audio = torch.randn(1, 24, 12, 8, 8, generator=g), torch.randn(1, 32, 2, 65, generator=g)
    text = torch.randn(1, 147, DIT["text_dim"], generator=g)
    changed = text * (1 + TEXT_CHANGE * torch.randn(text.shape, generator=g))
    timestep = torch.tensor([640.0])
    with torch.inference_mode():
        before = e2e_dit([video, audio], timestep, text, transformer_options={})
        after = e2e_dit([video, audio], timestep, changed, transformer_options={})
    assert float(before[0].abs().max()) > 0.1 and float(before[1].abs().max()) > 0.1  # not a silent model
    assert rel_diff(after, before) <= MAX_OUTPUT_CHANGE
