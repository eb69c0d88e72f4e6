"""A source model read in canonical form (docs/convert.md, "Families"): whatever the family, the
conversion sees Llama-layout tensors — q/k/v/o, gate/up/down, norms, embeddings, lm_head — with:

- fused tensors split on read (Phi-3's qkv_proj and gate_up_proj, by rows);
- the family's multipliers folded in (Granite: embeddings × embedding_multiplier, o_proj and down_proj ×
  residual_multiplier, lm_head ÷ logits_scaling; the attention multiplier goes into the query scale);
- a per-head q/k RMSNorm (Qwen3) replaced by its best linear stand-in: the norm weight times one
  constant per head, c_h = E[‖y‖²/ρ(y)] / E[‖y‖²] over calibration activations y = W_h x (ρ: the RMS
  the norm divides by), which minimises E‖c·y − y/ρ(y)‖². Without calibration x is modelled as the
  input norm's weight times unit noise. The per-token scale 1/ρ is what no linear map can carry.

Every tensor's shape is checked against config.json (a mismatch is one sentence).
"""

from __future__ import annotations

import torch

from mha2mla.convert.plan.resolve import ConversionPlan
from mha2mla.convert.steps.records import LayerStatistics, SourceAttention
from mha2mla.families import Family
from mha2mla.io.reader import LazyCheckpoint


def source_shapes(plan: ConversionPlan) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for every logical source tensor (by the family's weight key)."""
    s = plan.shape
    D, q_rows, kv_rows, vocab, inner = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.vocab_size, s.intermediate_size
    return {
        "q_proj": (q_rows, D), "k_proj": (kv_rows, D), "v_proj": (kv_rows, D), "o_proj": (D, q_rows),
        "q_proj.bias": (q_rows,), "k_proj.bias": (kv_rows,), "v_proj.bias": (kv_rows,), "o_proj.bias": (D,),
        "input_layernorm": (D,), "post_attention_layernorm": (D,), "final_norm": (D,),
        "q_norm": (s.head_dim,), "k_norm": (s.head_dim,),
        "gate_proj": (inner, D), "up_proj": (inner, D), "down_proj": (D, inner),
        "embed_tokens": (vocab, D), "lm_head": (vocab, D),
    }


class SourceReader:
    """Reads one logical tensor at a time from the lazy checkpoint (see the module docstring)."""

    def __init__(self, ckpt: LazyCheckpoint, family: Family, plan: ConversionPlan):
        self.ckpt, self.family, self.plan = ckpt, family, plan
        self.shapes = source_shapes(plan)

    def tensor(self, key: str, layer: int | None = None, suffix: str = "") -> torch.Tensor:
        """Logical tensor ``key`` (+ ``.weight``/``.bias`` for the attention projections), split out of its
        fused tensor where the family stores it fused."""
        shape = self.shapes[key + (".bias" if suffix == ".bias" else "")]
        fused = self.family.fused_with(key)
        if fused is None:
            return self.ckpt.get(self.family.weight(key, layer) + suffix, shape=shape)
        name, parts = fused
        sizes = [self.shapes[part + (".bias" if suffix == ".bias" else "")][0] for part in parts]
        whole = self.ckpt.get(self.family.weight(name, layer) + suffix, shape=(sum(sizes), *shape[1:]))
        start = sum(sizes[: parts.index(key)])
        return whole[start : start + shape[0]].clone()

    def layer_state(self, layer: int, names: list[str]) -> dict[str, torch.Tensor]:
        """The checkpoint's own tensors of decoder layer ``layer`` under the names a transformers decoder layer of
        the family uses (``self_attn.q_proj.weight``, …): fused and unscaled, as that layer expects them."""
        prefix = self.family.layer_prefix(layer)
        return {name: self.ckpt.get(prefix + name) for name in names}

    def has(self, key: str, layer: int, suffix: str) -> bool:
        fused = self.family.fused_with(key)
        return self.ckpt.has(self.family.weight(fused[0] if fused else key, layer) + suffix)

    def attention(self, layer: int, stats: LayerStatistics | None = None) -> SourceAttention:
        plan, s = self.plan, self.plan.shape

        def bias(key, projection):
            present = plan.biases.get(projection) and self.has(key, layer, ".bias")
            return self.tensor(key, layer, ".bias") if present else None

        q_w, q_b = self.tensor("q_proj", layer, ".weight"), bias("q_proj", "q")
        k_w, k_b = self.tensor("k_proj", layer, ".weight"), bias("k_proj", "k")
        norm = self.tensor("input_layernorm", layer)
        if self.family.qk_norm:
            eps = float(self.ckpt.config.get("rms_norm_eps", 1e-6))
            q_w, q_b = linear_norm_stand_in(q_w, q_b, self.tensor("q_norm", layer), s.head_dim, norm, stats, eps)
            k_w, k_b = linear_norm_stand_in(k_w, k_b, self.tensor("k_norm", layer), s.head_dim, norm, stats, eps)
        o_b = bias("o_proj", "o")
        return SourceAttention(
            q_weight=q_w, k_weight=k_w, v_weight=self.tensor("v_proj", layer, ".weight"),
            o_weight=self.tensor("o_proj", layer, ".weight") * s.residual_scale, input_norm_weight=norm,
            q_bias=q_b, k_bias=k_b, v_bias=bias("v_proj", "v"), o_bias=None if o_b is None else o_b * s.residual_scale,
            uses_rope=s.layer_uses_rope(layer),
        )

    def mlp(self, layer: int) -> dict[str, torch.Tensor]:
        """gate/up/down of one layer (down × the residual multiplier)."""
        return {"gate_proj": self.tensor("gate_proj", layer), "up_proj": self.tensor("up_proj", layer),
                "down_proj": self.tensor("down_proj", layer) * self.plan.shape.residual_scale}

    def embed(self) -> torch.Tensor:
        return self.tensor("embed_tokens") * self.plan.shape.embedding_scale

    def lm_head(self) -> torch.Tensor:
        """The output projection: the tied embedding (unscaled) or lm_head, ÷ the logits multiplier."""
        tied = bool(self.ckpt.config.get("tie_word_embeddings", False))
        head = self.tensor("embed_tokens") if tied else self.tensor("lm_head")
        return head / self.plan.shape.logits_scale


def linear_norm_stand_in(weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor, head_dim: int,
                         input_norm: torch.Tensor, stats: LayerStatistics | None, eps: float):
    """Rows (n·d, D) and bias of y ↦ RMSNorm_head(y) replaced by y ↦ w ⊙ c_h y (see the module docstring)."""
    f64 = torch.float64
    heads = weight.to(f64).view(-1, head_dim, weight.shape[1])  # (n, d, D)
    head_bias = None if bias is None else bias.to(f64).view(-1, head_dim)  # (n, d)
    sample = None if stats is None or stats.input_sample is None else stats.input_sample.to(f64)  # (t, D)
    scales = []
    for h in range(heads.shape[0]):
        if sample is not None:
            y = sample @ heads[h].T + (0 if head_bias is None else head_bias[h])  # (t, d)
            energy = y.pow(2).sum(-1)  # (t,)
            rho = (energy / head_dim + eps).sqrt()
            scales.append(float((energy / rho).sum() / energy.sum().clamp_min(1e-30)))
        else:  # x ≈ input_norm ⊙ unit noise: E[ρ²] = ‖W_h diag(input_norm)‖² / d
            mean_square = float((heads[h] * input_norm.to(f64)).pow(2).sum()) / head_dim
            scales.append(1.0 / (mean_square + eps) ** 0.5)
    scale = torch.tensor(scales, dtype=f64)[:, None] * norm_weight.to(f64)[None]  # (n, d): c_h · w
    new_weight = (heads * scale[:, :, None]).reshape(weight.shape)
    new_bias = None if head_bias is None else (head_bias * scale).reshape(bias.shape)
    return new_weight.to(weight.dtype), None if new_bias is None else new_bias.to(bias.dtype)
