"""Upstream's MiniMax-H3 audio VAE (`MiniMaxH3AudioVAE` inside `comfy.sd.VAE`, the released
config, seeded random weights) placed the way the node's role plan places it: on its planned
card, a new VAE object whose decode is bit-identical to the input's, the input untouched."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def audio_vae(upstream):
    import comfy.sd
    from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    g = torch.Generator().manual_seed(13)
    state = {name: torch.randn(t.shape, generator=g) * 0.02 + (1.0 if "norm" in name else 0.0)
             if t.is_floating_point() else t for name, t in MiniMaxH3AudioVAE().state_dict().items()}
    vae = comfy.sd.VAE(sd=state)
    assert type(vae.first_stage_model).__name__ == "MiniMaxH3AudioVAE"
    return vae


def test_audio_vae_placement_keeps_its_decode(upstream, audio_vae):
    import comfy.model_management
    from comfy.multidevice.roles.apply import place_vae
    from comfy.multidevice.roles.plan import plan_roles
    z = torch.randn(1, 32, 2, 4, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = audio_vae.decode(z)
    card = plan_roles(4).audio_vae.cards[0]
    assert card == 3  # the last of four cards
    device = comfy.model_management.get_torch_device()  # CPU here: every card is this device
    placed = place_vae(audio_vae, device, "audio VAE")
    assert placed is not audio_vae and placed.first_stage_model is audio_vae.first_stage_model
    with torch.inference_mode():
        out = placed.decode(z)
    assert torch.equal(out, reference)
    with torch.inference_mode():
        assert torch.equal(audio_vae.decode(z), reference)
