"""The plan as text, for --dry-run and the CLI."""

from __future__ import annotations

from mha2mla.convert.plan.engines import engine
from mha2mla.convert.plan.resolve import ConversionPlan


def format_plan(plan: ConversionPlan) -> str:
    """A human-readable plan for --dry-run and the CLI."""
    s = plan.shape
    kv = plan.kv_bytes_per_token()
    params = plan.attention_parameters()
    lines = [
        f"family {plan.family}, profile {plan.profile}, target {engine(plan.target).label}, dtype {plan.dtype}",
        f"source: {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} query heads, {s.num_kv_heads} KV heads, head dim {s.head_dim}, rope theta {s.rope_theta:g}",
        f"output: kv_lora_rank {plan.kv_lora_rank} (latent rank {plan.latent_rank}"
        f"{f' + {plan.extra_channels} {plan.methods.kv_norm} channel' if plan.extra_channels else ''}), "
        f"rope dim {plan.rope_dim} (pairs {list(plan.rope_pairs[:4])}{'...' if len(plan.rope_pairs) > 4 else ''}), rope theta {plan.target_rope_theta:g}",
        f"method: {plan.method_summary()}",
        *([f"value heads zero-padded from {s.head_dim} to {plan.v_head_dim} dims (exact) for {engine(plan.target).label}"]
          if plan.v_head_dim != s.head_dim else []),
        f"per layer: r={plan.kv_lora_rank}, d_r={plan.rope_dim} for all {s.num_layers} layers (global in the config)",
        f"KV cache per token ({plan.dtype}, all layers): {kv['source']:,.0f} B -> {kv['converted']:,.0f} B "
        f"({100 * kv['ratio']:.2f}% of the source)",
        f"attention parameters: {params['source_total']:,} -> {params['converted_total']:,}",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
