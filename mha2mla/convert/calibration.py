"""The built-in calibration provider (docs/calibration.md): layer-wise statistics of the source's
attention on calibration tokens, the refit, and the hidden states pushed from layer to layer.

``LayerwiseCalibration`` implements :class:`mha2mla.convert.stats.CalibrationProvider`. The pipeline
calls, per layer i and in order: ``statistics(i)`` — the statistics of layer i's attention input x
(the input RMSNorm's output) and of what the source attention does with it; ``refit(i, tensors)`` —
the converted layer's read-out refitted towards the source (``refit.py``); ``advance(i, tensors)`` —
the hidden states pushed through layer i: through the *converted* attention when sequential (layer
i+1 is then calibrated on what the converted model really feeds it, as TransMLA does), or through
the source attention. With the refit, a second stream of the source model's own hidden states gives
the refit its targets, so each layer also takes up part of what earlier conversions changed.

Only one layer's hidden states are held at a time: ``(N, L, D)`` for N sequences of L tokens, on the
chosen device. Each layer's weights are read from the lazy checkpoint when it is reached.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

from mha2mla import UserError
from mha2mla.convert.calibration_data import calibration_documents, calibration_token_ids
from mha2mla.convert.layer import SourceAttention
from mha2mla.convert.lowrank import row_space_basis
from mha2mla.convert.memory import calibration_batch, check_budget, host_buffer, refit_cache_bytes
from mha2mla.convert.plan import ConversionPlan
from mha2mla.convert.reconstruct import ReconstructionData, massive_tokens, reconstruct
from mha2mla.convert.refit import OutputMoments, ValueMoments
from mha2mla.convert.source import SourceReader
from mha2mla.convert.stats import LayerStatistics
from mha2mla.convert.target_config import deepseek_config_object
from mha2mla.modeling.rmsnorm import rms_norm

log = logging.getLogger(__name__)

# tokens kept per layer (on top of the moments) for statistics that need per-token values
INPUT_SAMPLE_TOKENS = 4096
# attention statistics are measured at every QUERY_STRIDE-th query and KEY_STRIDE-th key position
QUERY_STRIDE = 4
KEY_STRIDE = 4
KEY_DENSE = 16
# keys are weighted by (attention they receive) ** KEY_WEIGHT_POWER (measured: 0.5 beats 0 and 1)
KEY_WEIGHT_POWER = 0.5
# per-head moments are measured in the K/V row space (m = 2·G·d coordinates) instead of all D inputs when
# the dense ones, 2 · H · D² float32, would pass this size: it is exact for every step but the latent's own
# refinement, which it confines to that row space — measured slightly worse on SmolLM2 at 31.25% (KJV
# ×1.906 → ×1.907, Python docs ×2.268 → ×2.303), so small models keep the dense moments (docs/calibration.md, memory)
DENSE_MOMENTS_LIMIT = 8 * 1024**3


@dataclass
class _Modules:
    """Classes of the source family and of the target, taken from transformers (no weights)."""

    source_config: object
    target_config: object
    layer_class: type
    source_rotary: torch.nn.Module
    target_attention_class: type
    target_rotary: torch.nn.Module


def _modules(ckpt, plan: ConversionPlan) -> _Modules:
    config_dict = dict(ckpt.config)
    source_config = AutoConfig.for_model(config_dict.pop("model_type"), **{k: v for k, v in config_dict.items() if k != "transformers_version"})
    source_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(source_config)
    layer_class = type(skeleton.model.layers[0])
    rotary_class = type(skeleton.model.rotary_emb)
    target_config = deepseek_config_object(plan, ckpt.config)
    target_config._attn_implementation = "sdpa"
    return _Modules(
        source_config=source_config, target_config=target_config, layer_class=layer_class,
        source_rotary=rotary_class(config=source_config), target_attention_class=deepseek.DeepseekV3Attention,
        target_rotary=deepseek.DeepseekV3RotaryEmbedding(config=target_config),
    )


class LayerwiseCalibration:
    """The statistics provider (see the module docstring)."""

    def __init__(self, ckpt, family, plan: ConversionPlan, tokens: torch.Tensor, device: str | None = None,
                 batch_size: int | None = None, on_disk: bool = False):
        self.ckpt, self.family, self.plan = ckpt, family, plan
        self.sequential = plan.methods.sequential
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.batch_size = batch_size or (calibration_batch(plan) if plan.calibration is not None else 8)
        self.on_disk = on_disk and self.device.type == "cpu"  # the hidden states and the head outputs file-backed (memory.py)
        self.modules = _modules(ckpt, plan)
        self.reader = SourceReader(ckpt, family, plan)  # canonical K/V rows (fused tensors split)
        self.num_layers = plan.shape.num_layers
        embed = ckpt.get(family.weight("embed_tokens"))
        self.residual_scale = plan.shape.residual_scale  # folded into the converted o_proj and down_proj (source.py)
        # (N, L, D): the current layer's input hidden states
        N, L = tokens.shape
        self.hidden = self._buffer((N, L, embed.shape[1]))
        for start in range(0, N, 8):
            self.hidden[start : start + 8] = embed[tokens[start : start + 8]].float() * plan.shape.embedding_scale
        # the refit's targets come from the source model's own hidden states (sequential only): a
        # second set, pushed through the source layers only
        self.source_hidden = None
        if self.sequential and (plan.methods.refit or plan.methods.reconstruct):
            self.source_hidden = self._buffer(self.hidden.shape)
            self.source_hidden.copy_(self.hidden)
        self.layer = 0  # the hidden states are the input of this layer
        positions = torch.arange(L, device=self.device)[None]  # (1, L)
        # an explicit causal mask: eager attention (run for its probabilities) applies no other
        self.causal_mask = torch.full((L, L), float("-inf"), device=self.device).triu(1)[None, None]
        probe = torch.zeros(1, L, 1, device=self.device)
        self.source_rope = self.modules.source_rotary.to(self.device)(probe, positions)
        self.target_rope = self.modules.target_rotary.to(self.device)(probe, positions)
        self._layer_cache: tuple[int, torch.nn.Module] | None = None
        self._heads_cache: tuple[int, torch.Tensor] | None = None

    def _buffer(self, shape) -> torch.Tensor:
        return host_buffer(shape, True) if self.on_disk else torch.empty(shape, device=self.device)

    # ---- one source layer, weights read lazily ------------------------------------------------
    def _source_layer(self, layer: int) -> torch.nn.Module:
        if self._layer_cache is not None and self._layer_cache[0] == layer:
            return self._layer_cache[1]
        module = self.modules.layer_class(self.modules.source_config, layer_idx=layer)
        prefix = f"model.layers.{layer}."
        state = {name: self.ckpt.get(prefix + name) for name in module.state_dict()}
        module.load_state_dict(state)
        module = module.to(self.device).eval()
        self._layer_cache = (layer, module)
        return module

    @torch.no_grad()
    def _source_heads(self, layer: int) -> torch.Tensor:
        """(N, L, H·d): the source attention's head outputs (what its o_proj reads) on the source stream (the
        one stream when there is no second), computed once per layer for the refit, the reconstruction and
        ``advance``: the source attention output is ``o_proj`` of it (docs/calibration.md, "memory")."""
        cached = self._cached_heads(layer)
        if cached is not None:
            return cached
        self._heads_cache = None
        source = self._source_layer(layer)
        stream = self.hidden if self.source_hidden is None else self.source_hidden
        N, L, _ = stream.shape
        heads = self._buffer((N, L, source.self_attn.o_proj.in_features))
        captured = []
        hook = source.self_attn.o_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            for start in range(0, N, self.batch_size):
                source.self_attn(source.input_layernorm(stream[start : start + self.batch_size]),
                                 position_embeddings=self.source_rope, attention_mask=None)
                heads[start : start + self.batch_size] = captured.pop()
        finally:
            hook.remove()
        self._heads_cache = (layer, heads)
        return heads

    def _cached_heads(self, layer: int) -> torch.Tensor | None:
        return self._heads_cache[1] if self._heads_cache is not None and self._heads_cache[0] == layer else None

    def _source_output(self, source: torch.nn.Module, h: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """The source attention output on hidden states ``h`` (b, L, D), residual multiplier included: from
        ``heads``, their head outputs, when these were computed already."""
        if heads is not None:
            return self.residual_scale * source.self_attn.o_proj(heads.to(self.device))
        return self.residual_scale * source.self_attn(source.input_layernorm(h), position_embeddings=self.source_rope,
                                                      attention_mask=None)[0]

    def _target_attention(self, layer: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        module = self.modules.target_attention_class(self.modules.target_config, layer_idx=layer)
        state = module.state_dict()
        missing = [name for name in tensors if name not in state]
        if missing:
            raise RuntimeError(f"internal error: converted tensors {missing} have no place in DeepseekV3Attention")
        state.update({name: tensor.float() for name, tensor in tensors.items()})
        module.load_state_dict(state)
        return module.to(self.device).eval()

    @torch.no_grad()
    def statistics(self, layer: int) -> LayerStatistics:
        while self.layer < layer:  # a caller that does not advance: follow the source model
            self.advance(self.layer, None)
        if layer != self.layer:
            raise RuntimeError(f"calibration statistics asked for layer {layer} after layer {self.layer}; layers go in order")
        norm_weight = self.ckpt.get(self.family.weight("input_layernorm", layer)).to(self.device)
        eps = float(self.ckpt.config.get("rms_norm_eps", 1e-6))
        D = self.hidden.shape[-1]
        moment = torch.zeros(D, D, dtype=torch.float64, device=self.device)
        total = torch.zeros(D, dtype=torch.float64, device=self.device)
        count = 0
        flat = self.hidden.reshape(-1, D)  # (N*L, D)
        for start in range(0, flat.shape[0], 4096):
            x = rms_norm(flat[start : start + 4096], norm_weight, eps, keep_float32=True)  # (n, D) float32
            moment += (x.T @ x).double()  # a float32 product per chunk, accumulated in float64
            total += x.double().sum(0)
            count += x.shape[0]
        # per-token sample: evenly spaced tokens plus every sequence's first (attention-sink) token
        num_sequences, length = self.hidden.shape[:2]
        sample_every = max(1, flat.shape[0] // INPUT_SAMPLE_TOKENS)
        index = torch.cat([torch.arange(0, flat.shape[0], sample_every)[:INPUT_SAMPLE_TOKENS],
                           torch.arange(0, flat.shape[0], length)]).unique().to(flat.device)
        sample = rms_norm(flat[index], norm_weight, eps, keep_float32=True)
        H = self.modules.source_config.num_attention_heads
        basis = None
        if 2 * H * D * D * 4 > DENSE_MOMENTS_LIMIT:
            basis = row_space_basis(self.reader.tensor("k_proj", layer, ".weight"), self.reader.tensor("v_proj", layer, ".weight"))
        value_covariances, key_covariances, histogram = self._attention_statistics(self._source_layer(layer), basis)
        return LayerStatistics(
            moment_basis=None if basis is None else basis.cpu(),
            input_covariance=(moment / count).cpu(), input_mean=(total / count).cpu(), num_tokens=count,
            input_sample=sample.cpu(), value_covariances=value_covariances.cpu(),
            key_covariances=key_covariances.cpu(), distance_histogram=histogram.cpu(),
            pair_frequencies=self.modules.source_rotary.inv_freq.double().cpu(),
        )

    @torch.no_grad()
    def _attention_statistics(self, source: torch.nn.Module, basis: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """What the source attention does with this layer's tokens, per query head h:
        ``E[x̄ x̄ᵀ]`` for the attention-averaged inputs x̄_i = Σ_j p_hij x_j (what a value error is seen
        through), the key-side moment E_w[x xᵀ] with each token weighted by the attention it receives
        (Σ_i p_hij) ** KEY_WEIGHT_POWER, and the attention mass at each distance i - j. Queries are
        taken at every QUERY_STRIDE-th position; keys at the first KEY_DENSE, then every KEY_STRIDE-th.
        The moments are of ``basis`` x (m coordinates) when a basis of the K/V row space is given."""
        N, L, D = self.hidden.shape
        attention = source.self_attn
        H = self.modules.source_config.num_attention_heads
        mask = self.causal_mask
        position = torch.arange(L, device=self.device)
        distance = (position[:, None] - position[None, :]).clamp_min(0).reshape(1, -1).expand(H, -1)
        # keys: every position of the first KEY_DENSE ones (they receive the most attention), then every
        # KEY_STRIDE-th, each standing for KEY_STRIDE positions
        keys = torch.cat([torch.arange(min(KEY_DENSE, L)), torch.arange(KEY_DENSE, L, KEY_STRIDE)]).to(self.device)
        key_share = torch.where(keys < KEY_DENSE, 1.0, float(KEY_STRIDE)).to(self.device)
        # per-head (H, m, m) moments in float32: the products are float32 anyway, and the sums are over at
        # most a few hundred thousand positions (docs/calibration.md, "memory")
        project = None if basis is None else basis.float().to(self.device)  # (m, D)
        m = D if project is None else project.shape[0]
        covariances = torch.zeros(H, m, m, device=self.device)
        key_covariances = torch.zeros(H, m, m, device=self.device)
        key_weight = torch.zeros(H, dtype=torch.float64, device=self.device)
        histogram = torch.zeros(H, L, dtype=torch.float64, device=self.device)
        with eager_attention(attention.config):  # the probabilities themselves
            for start in range(0, N, self.batch_size):
                x = source.input_layernorm(self.hidden[start : start + self.batch_size])  # (b, L, D)
                probabilities = attention(x, position_embeddings=self.source_rope, attention_mask=mask)[1].float()
                x = x if project is None else x @ project.T  # (b, L, m)
                averaged = probabilities[:, :, ::QUERY_STRIDE] @ x[:, None]  # (b, H, L/s, m)
                covariances += torch.einsum("bhnd,bhne->hde", averaged, averaged)
                weight = probabilities.sum(2)[:, :, keys].clamp_min(0) ** KEY_WEIGHT_POWER * key_share  # (b, H, k)
                weighted = weight.sqrt()[..., None] * x[:, None, keys]  # (b, H, k, m)
                key_covariances += torch.einsum("bhnd,bhne->hde", weighted, weighted)
                key_weight += weight.sum((0, 2)).double()
                histogram.scatter_add_(1, distance, probabilities.sum(0).reshape(H, -1).double())
        queries = N * len(range(0, L, QUERY_STRIDE))
        return (covariances / queries, key_covariances / key_weight.float()[:, None, None],
                histogram / histogram.sum(-1, keepdim=True))

    @torch.no_grad()
    def refit(self, layer: int, tensors: dict[str, torch.Tensor], source_attention: SourceAttention) -> tuple[dict[str, torch.Tensor], dict]:
        """The converted layer's value rows and o_proj refitted on what it computes (``refit.py``), in two
        passes: the value rows, then o_proj on the refitted heads. f always comes from the stream being
        calibrated; t from the source stream when there is one. A full-capacity conversion, where f spans
        t exactly, keeps its maps. The source's values and output projection come from
        ``source_attention`` (canonical: fused tensors split, multipliers folded)."""
        target = self._target_attention(layer, tensors)
        H, d, r = target.num_heads, target.v_head_dim, target.kv_lora_rank
        N, L, D = self.hidden.shape
        # the first pass keeps its averaged latents and targets for the second when they are small
        keep = refit_cache_bytes(N * L, H, r, D) > 0
        kept = []
        value_moments = ValueMoments(H, d, r, self.device)
        for fold, t, f, y in self._readout_batches(layer, target, source_attention, with_output=keep):
            value_moments.add(fold, t, f)
            if keep:
                kept.append((fold, None, f, y))
        values, report = value_moments.solve(tensors["kv_b_proj.weight"])
        up = values.float().to(self.device)  # (H, d, r)
        output_moments = OutputMoments(D, H * d, self.device)
        for fold, _, f, y in kept or self._readout_batches(layer, target, source_attention, with_output=True):
            z = torch.einsum("hdr,bhlr->blhd", up, f)  # (b, L, H, d): the refitted heads' outputs
            output_moments.add(fold, z.flatten(2), y)
        o_weight, o_report = output_moments.solve(tensors["o_proj.weight"])
        out = dict(tensors)
        kv_b = tensors["kv_b_proj.weight"].to(torch.float64).view(H, 2 * d, r).clone()
        kv_b[:, d:] = values
        out["kv_b_proj.weight"] = kv_b.reshape(H * 2 * d, r).to(tensors["kv_b_proj.weight"].dtype)
        out["o_proj.weight"] = o_weight.to(tensors["o_proj.weight"].dtype)
        return out, {**report, **o_report}

    def _readout_batches(self, layer: int, target: torch.nn.Module, source_attention: SourceAttention, with_output: bool):
        """Per half-batch (the two cross-validation folds: even and odd sequences): (fold, t, f, y) with t the
        source heads' outputs (b, H, L, d), f the converted layer's averaged latents (b, H, L, r) and y the
        source attention output (b, L, D; None unless ``with_output``)."""
        source = self._source_layer(layer)
        heads = self._source_heads(layer)  # (N, L, H*d)
        N, L, _ = self.hidden.shape
        H, r = target.num_heads, target.kv_lora_rank
        o_weight = source_attention.o_weight.float().to(self.device) if with_output else None  # residual multiplier folded in
        with eager_attention(target.config):
            for start in range(0, N, self.batch_size):
                x = source.input_layernorm(self.hidden[start : start + self.batch_size])  # (b, L, D)
                b = x.shape[0]
                batch_heads = heads[start : start + b].to(self.device)  # (b, L, H*d)
                t = batch_heads.view(b, L, H, -1).transpose(1, 2)  # (b, H, L, d)
                p_converted = target(x, position_embeddings=self.target_rope, attention_mask=self.causal_mask)[1].float()
                latent = target.kv_a_layernorm(target.kv_a_proj_with_mqa(x)[..., :r])  # (b, L, r)
                f = p_converted @ latent[:, None]  # (b, H, L, r)
                y = batch_heads @ o_weight.T if with_output else None  # (b, L, D)
                for k in (0, 1):
                    fold = slice((start + k) % 2, b, 2)
                    yield k, t[fold], f[fold], None if y is None else y[fold]

    def reconstruct(self, layer: int, tensors: dict[str, torch.Tensor], source_attention: SourceAttention) -> tuple[dict[str, torch.Tensor], dict]:
        """The converted layer fitted by gradient descent (``reconstruct.py``) on the inputs of the stream being
        calibrated, towards the source stream's residual after the attention: the source layer's attention
        output plus the drift the earlier converted layers left in the residual stream, h_source − h_converted,
        except at attention sinks (docs/calibration.md, "reconstruction"). Without a second stream there is no
        drift to take up."""
        source = self._source_layer(layer)
        target = self._target_attention(layer, tensors)
        with torch.no_grad():
            x = torch.cat([source.input_layernorm(self.hidden[i : i + self.batch_size])
                           for i in range(0, self.hidden.shape[0], self.batch_size)])
            heads = self._source_heads(layer)
            # an attention sink's drift is left out: the attention cannot cancel it, and it would dominate the loss
            massive = None if self.source_hidden is None else massive_tokens(self.source_hidden).to(self.device)
            targets = []
            for i in range(0, heads.shape[0], self.batch_size):
                batch = slice(i, i + self.batch_size)
                y = self._source_output(source, None, heads[batch])
                if massive is not None:
                    y += (self.source_hidden[batch] - self.hidden[batch]) * ~massive[batch, :, None]
                targets.append(y)
            y = torch.cat(targets)
        # on a CPU, eager softmax with the explicit causal mask (a quarter faster than sdpa for SmolLM2's heads,
        # measured); on a GPU the module's causal sdpa
        cpu = self.device.type == "cpu"
        data = ReconstructionData(x, y, self.target_rope, self.causal_mask if cpu else None)
        with eager_attention(*([target.config] if cpu else [])):
            report = reconstruct(target, data, exact=self.plan.profile == "exact")
        report["reconstruction_massive_tokens"] = 0 if massive is None else int(massive.sum())
        state = target.state_dict()
        return {name: state[name].to(tensor.dtype).cpu() for name, tensor in tensors.items()}, report

    @torch.no_grad()
    def advance(self, layer: int, tensors: dict[str, torch.Tensor] | None) -> None:
        """Push the hidden states through layer ``layer``: its converted attention (``tensors``, when
        calibrating sequentially) or the source attention, then the source MLP — each added to the residual
        stream with the family's residual multiplier (the converted o_proj carries it already)."""
        if layer != self.layer:
            raise RuntimeError(f"calibration advanced through layer {layer} while at layer {self.layer}")
        source = self._source_layer(layer)
        converted = self._target_attention(layer, tensors) if (self.sequential and tensors is not None) else None
        # the source attention's head outputs on the source stream, when the refit or reconstruction computed them
        heads = self._cached_heads(layer)
        own_heads = heads if self.source_hidden is None else None  # this stream's, when it is the one stream
        for start in range(0, self.hidden.shape[0], self.batch_size):
            batch = slice(start, start + self.batch_size)
            h = self.hidden[batch]  # (b, L, D)
            if converted is not None:
                h = h + converted(source.input_layernorm(h), position_embeddings=self.target_rope, attention_mask=None)[0]
            else:
                h = h + self._source_output(source, h, None if own_heads is None else own_heads[batch])
            self.hidden[batch] = self._add_mlp(source, h)
            if self.source_hidden is not None:
                h = self.source_hidden[batch]
                h = h + self._source_output(source, h, None if heads is None else heads[batch])
                self.source_hidden[batch] = self._add_mlp(source, h)
        self._heads_cache = None
        self.layer += 1

    def _add_mlp(self, source: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer: its MLP added to the residual stream ``h`` (b, L, D) after the attention."""
        return h + self.residual_scale * source.mlp(source.post_attention_layernorm(h))


@contextmanager
def eager_attention(*configs):
    """Run the attention of these configs' modules with eager softmax (it returns the probabilities)."""
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = "eager"
        yield
    finally:
        for config, implementation in zip(configs, saved):
            config._attn_implementation = implementation


def calibration_provider(ckpt, family, plan: ConversionPlan) -> LayerwiseCalibration:
    """The built-in provider for ``plan.calibration`` (the calibration text, sizes and device)."""
    settings = plan.calibration
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt.folder))
    except Exception as error:
        raise UserError(f"calibration needs the source tokenizer, which {ckpt.folder} lacks ({type(error).__name__}).") from error
    tokens = calibration_token_ids(calibration_documents(settings.text), tokenizer, settings.samples, settings.seq_len)
    on_disk = check_budget(plan, settings.max_memory)
    if on_disk:
        log.info("calibration activations kept on disk: one layer's working set exceeds the memory budget")
    return LayerwiseCalibration(ckpt, family, plan, tokens, device=settings.device, on_disk=on_disk)
