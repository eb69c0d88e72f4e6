"""The README.md model card written into every output folder: source, method, budget, the command."""

from __future__ import annotations

from pathlib import Path


def write_model_card(folder: str | Path, report: dict, extra_sections: list[str] | None = None) -> None:
    plan = report["plan"]
    shape = plan["shape"]
    kv = report["kv_bytes_per_token"]
    layers = report.get("layers", [])
    mean_k = sum(layer["k_rel_error"] for layer in layers) / max(len(layers), 1)
    mean_v = sum(layer["v_rel_error"] for layer in layers) / max(len(layers), 1)
    portable = plan["profile"] == "portable"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [mha2mla, mla, deepseek_v3]",
        "---",
        f"# {Path(report.get('source', 'model')).name} → Multi-head Latent Attention",
        "",
        f"Converted by mha2mla {report.get('mha2mla_version', '')} from `{report.get('source')}` "
        f"({plan['family']}, {shape['num_layers']} layers, {shape['num_heads']} query heads, "
        f"{shape['num_kv_heads']} KV heads, head dim {shape['head_dim']}) into a native DeepSeek-V3 checkpoint.",
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        'model = AutoModelForCausalLM.from_pretrained("<this folder>")  # no trust_remote_code',
        "```",
        "",
        ("Profile **portable**: no attention biases, silu MLP, plain interleaved rope — loads in transformers, "
         "vLLM and SGLang." if portable else
         "Profile **exact**: transformers only (attention biases, neutralised kv_a_layernorm); training-free "
         "conversions at full capacity reproduce the source's logits."),
        "",
        "## Method",
        "",
        f"- Method: {plan['method']}.",
        f"- RoPE: {plan['rope_dim']} rope dims on one shared rope key (the fastest source pairs "
        f"{plan['rope_pairs']}), per-frequency KV-head mixing; rope theta {plan['target_rope_theta']:g}.",
        f"- Latent: kv_lora_rank {plan['kv_lora_rank']} (latent rank {plan['latent_rank']}), joint low rank of [K_nope; V].",
        f"- Mean relative reconstruction error: K {mean_k:.4f}, V {mean_v:.4f} (per layer in conversion_report.json).",
        f"- KV cache per token: {kv['source']:,.0f} B → {kv['converted']:,.0f} B ({100 * kv['ratio']:.2f}% of the source).",
    ]
    if report.get("dropped_biases"):
        lines.append(f"- Source biases not carried (portable profile): {', '.join(report['dropped_biases'])}.")
    lines += ["", "## Command", "", "```", report.get("command", ""), "```", ""]
    for section in extra_sections or []:
        lines += [section, ""]
    (Path(folder) / "README.md").write_text("\n".join(lines))
