"""The output's config.json: a native DeepSeek-V3 config with every MLP dense (docs/design.md §2)."""

from __future__ import annotations

from transformers import DeepseekV3Config

from mha2mla import __version__
from mha2mla.convert.plan.resolve import ConversionPlan


def deepseek_config(plan: ConversionPlan, source_config: dict, padded: bool = True) -> dict:
    """The output config.json as a dict (validated by transformers' DeepseekV3Config). ``padded=False``:
    the value heads at the source head dim, as calibration builds the converted layers before padding.

    Every MLP is dense (``first_k_dense_replace`` = the layer count); the MoE keys still have to be there
    because engines read them unconditionally: ``moe_layer_freq`` (SGLang's layer sparsity test),
    ``n_routed_experts`` (vLLM's weight-name mapping). docs/engines.md."""
    s = plan.shape
    rope = {"rope_type": "default", "rope_theta": plan.target_rope_theta}
    source_rope = source_config.get("rope_parameters") or {}
    if plan.keeps_rope_scaling:
        # per-frequency scaling (llama3, linear, longrope's factor lists) maps onto the kept pairs exactly; the
        # target's rope head rotates in full (no partial factor), and its lists hold the kept pairs only
        rope = {key: ([value[pair] for pair in plan.rope_pairs] if isinstance(value, list) else value)
                for key, value in source_rope.items()
                if key not in ("partial_rotary_factor", "type")}
        rope["rope_theta"] = plan.target_rope_theta
    tie = bool(source_config.get("tie_word_embeddings", False)) and not plan.untie_embeddings
    config = DeepseekV3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        moe_intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_heads,
        n_shared_experts=1,
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=s.num_layers,
        num_nextn_predict_layers=0,
        kv_lora_rank=plan.kv_lora_rank,
        q_lora_rank=(s.hidden_size + 1) if plan.use_q_lora else None,
        qk_rope_head_dim=plan.rope_dim,
        qk_nope_head_dim=s.head_dim,
        v_head_dim=plan.v_head_dim if padded else s.head_dim,
        hidden_act=source_config.get("hidden_act", "silu"),
        max_position_embeddings=source_config.get("max_position_embeddings", 4096),
        rms_norm_eps=source_config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=tie,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=plan.profile == "exact",
        bos_token_id=source_config.get("bos_token_id"),
        eos_token_id=source_config.get("eos_token_id"),
        pad_token_id=source_config.get("pad_token_id"),
    )
    data = config.to_dict()
    data["architectures"] = ["DeepseekV3ForCausalLM"]
    data["moe_layer_freq"] = 1
    data["dtype"] = plan.dtype
    data["rope_theta"] = plan.target_rope_theta  # engines that read the pre-v5 key
    data["mha2mla"] = {"version": __version__, "profile": plan.profile, "target": plan.target, "source_family": plan.family}
    return data


def deepseek_config_object(plan: ConversionPlan, source_config: dict) -> DeepseekV3Config:
    """The unpadded config as a transformers object (calibration builds the converted layers with it)."""
    data = deepseek_config(plan, source_config, padded=False)
    return DeepseekV3Config(**{k: v for k, v in data.items() if k not in ("mha2mla", "architectures", "dtype")})
