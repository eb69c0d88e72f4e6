"""The student's latents balanced before it trains (docs/recover.md, "Stability"): a converted model's latent may be
many times larger than the hidden state its layer reads, which AdamW turns into an up-projection that changes too
fast; ``balance_latent_scales`` rescales it without changing the function the model computes."""

from __future__ import annotations

import torch

from mha2mla.modeling.rmsnorm import latent_scale_ratio, normalises


@torch.no_grad()
def balance_latent_scales(model) -> None:
    """Each attention's latent brought to the scale of the hidden state its layer reads, the inverse folded into the
    up-projection that reads it: W_up (w * n(c)) = (s W_up) ((w / s) * n(c)), the same function (s:
    rmsnorm.latent_scale_ratio). An up-projection reading a latent s times larger than the other projections'
    inputs changes its output s times faster under AdamW: at the recipes' learning rate that broke a converted
    SmolLM2 in training (docs/recover.md, "Stability"). The same for the query latent where the model has one. A
    neutralised norm (the exact profile's) passes its latent through at its own scale and is left as it is."""
    config = model.config
    for layer in model.model.layers:
        attention, reference = layer.self_attn, layer.input_layernorm.weight
        for norm_name, down_name, up_name, channels in (
                ("kv_a_layernorm", "kv_a_proj_with_mqa", "kv_b_proj", config.kv_lora_rank),
                ("q_a_layernorm", "q_a_proj", "q_b_proj", config.q_lora_rank)):
            norm, down, up = (getattr(attention, name, None) for name in (norm_name, down_name, up_name))
            if norm is None or up is None or not normalises(down.weight, down.bias, channels):
                continue
            scale = latent_scale_ratio(norm.weight, reference)
            if scale > 0:
                norm.weight.div_(scale)
                up.weight.mul_(scale)
