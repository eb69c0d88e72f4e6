"""The calibration stream (docs/calibration.md): calibration tokens carried through the model one layer at
a time, driven by the pipeline.

The stream holds the hidden states at the current layer's input: ``(N, L, D)`` for N sequences of L tokens,
on the chosen device (file-backed when memory.py says so). For layer i the pipeline calls ``enter(i)``, which
gives a :class:`LayerActivations` (the source decoder layer, read once through the pipeline's SourceReader,
and what the steps read of it), measures it (measure.py), converts the layer, then ``advance(activations,
tensors)``: the hidden states pushed through layer i — its converted attention when calibrating sequentially
(layer i+1 is then calibrated on what the converted model really feeds it), else the source attention —
and the source MLP. When the refit or the reconstruction needs the source model's own outputs, a second
stream of the source model's hidden states is carried beside the first.

The hidden states are float32; the layer forwards run in the plan's compute dtype (mha2mla/compute.py): the
layer modules, the rope tables and the mask are in it, every forward takes its input cast to it and returns
float32 to the residual stream (docs/design.md, "compute dtype").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

from mha2mla.compute import torch_dtype
from mha2mla.convert.calibration.data import calibration_documents, calibration_token_ids
from mha2mla.convert.calibration.memory import calibration_batch, check_budget, host_buffer
from mha2mla.convert.output.target_config import deepseek_config_object
from mha2mla.convert.phases import phase
from mha2mla.convert.plan.resolve import ConversionPlan
from mha2mla.convert.source_reader import SourceReader
from mha2mla.devices import resolve_device
from mha2mla.io.loader import load_tokenizer
from mha2mla.kernels.sdpa import register_padded_sdpa
from mha2mla.modeling.eager import EAGER, register_eager

log = logging.getLogger(__name__)


@dataclass
class _Modules:
    """Classes of the source family and of the target, taken from transformers (no weights)."""

    source_config: object
    target_config: object
    layer_class: type
    source_rotary: torch.nn.Module
    target_rotary: torch.nn.Module


def _modules(config: dict, plan: ConversionPlan, device: torch.device) -> _Modules:
    settings = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    source_config = AutoConfig.for_model(config["model_type"], **settings)
    source_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(source_config)
    target_config = deepseek_config_object(plan, config)
    # the value head is narrower than the query/key head: plain sdpa takes its math path there, the padded value runs
    # the fused kernel (kernels/sdpa.py) -- on a GPU; on a CPU the eager softmax (modeling/eager.py), faster there
    # than that math path (docs/benchmarks.md, "conversion cost"), with the stream's ``target_mask``
    target_config._attn_implementation = {"cuda": register_padded_sdpa, "cpu": register_eager}.get(device.type, lambda: "sdpa")()
    return _Modules(source_config=source_config, target_config=target_config, layer_class=type(skeleton.model.layers[0]),
                    source_rotary=type(skeleton.model.rotary_emb)(config=source_config),
                    target_rotary=deepseek.DeepseekV3RotaryEmbedding(config=target_config))


class CalibrationStream:
    """Calibration tokens carried through the layers (see the module docstring)."""

    def __init__(self, reader: SourceReader, tokens: torch.Tensor, device: str | None = None, batch_size: int | None = None,
                 on_disk: bool = False):
        plan = reader.plan
        self.reader, self.plan = reader, plan
        self.device = torch.device(resolve_device(device, "--calib-device"))
        self.compute = torch_dtype(plan.compute_dtype)  # the layer forwards' dtype
        self.batch_size = batch_size or (calibration_batch(plan) if plan.calibration is not None else 8)
        self.on_disk = on_disk and self.device.type == "cpu"
        self.modules = _modules(reader.ckpt.config, plan, self.device)
        embed = reader.tensor("embed_tokens")
        N, L = tokens.shape
        self.hidden = self.buffer((N, L, embed.shape[1]))  # (N, L, D): the current layer's input
        for start in range(0, N, 8):
            self.hidden[start : start + 8] = embed[tokens[start : start + 8]].float() * plan.shape.embedding_scale
        # the source model's own hidden states, for the refit's and the reconstruction's targets (sequential only)
        self.source_hidden = None
        if plan.methods.sequential and plan.methods.fits_layers:
            self.source_hidden = self.buffer(self.hidden.shape)
            self.source_hidden.copy_(self.hidden)
        self.layer = 0  # the hidden states are the input of this layer
        positions = torch.arange(L, device=self.device)[None]  # (1, L)
        # an explicit causal mask: eager attention (run for its probabilities) applies no other
        self.causal_mask = torch.full((L, L), float("-inf"), device=self.device, dtype=self.compute).triu(1)[None, None]
        # what the converted attention is called with: the causal mask where _modules chose eager, else sdpa's own
        self.target_mask = self.causal_mask if self.modules.target_config._attn_implementation == EAGER else None
        probe = torch.zeros(1, L, 1, device=self.device, dtype=self.compute)  # the rope tables take its dtype
        self.source_rope = self.modules.source_rotary.to(self.device)(probe, positions)
        self.target_rope = self.modules.target_rotary.to(self.device)(probe, positions)

    def buffer(self, shape) -> torch.Tensor:
        """An uninitialised float32 tensor for activations of ``shape``, on the device or file-backed (memory.py)."""
        return host_buffer(shape, True) if self.on_disk else torch.empty(shape, device=self.device)

    def enter(self, layer: int) -> LayerActivations:
        """The activations of layer ``layer``, which must be the layer the stream is at."""
        if layer != self.layer:
            raise RuntimeError(f"the calibration stream is at layer {self.layer}, not {layer}; layers go in order")
        module = self.modules.layer_class(self.modules.source_config, layer_idx=layer)
        module.load_state_dict(self.reader.layer_state(layer, list(module.state_dict())))
        return LayerActivations(self, layer, module.to(self.device, self.compute).eval())

    @torch.no_grad()
    def advance(self, activations: LayerActivations, tensors: dict[str, torch.Tensor] | None) -> None:
        """Push the hidden states through the layer of ``activations``: its converted attention (``tensors``) or,
        given None, the source attention, then the source MLP, each added with the residual multiplier."""
        if activations.layer != self.layer:
            raise RuntimeError(f"the calibration stream is at layer {self.layer}, not {activations.layer}")
        converted = None if tensors is None else activations.target_attention(tensors)
        heads = activations.computed_heads  # on the source stream, when a fit step computed them
        own_heads = heads if self.source_hidden is None else None  # this stream's, when it is the one stream
        for start in range(0, self.hidden.shape[0], self.batch_size):
            batch = slice(start, start + self.batch_size)
            h = self.hidden[batch]  # (b, L, D)
            if converted is not None:
                h = h + converted(activations.normed(h), position_embeddings=self.target_rope,
                                  attention_mask=self.target_mask)[0].float()
            else:
                h = h + activations.source_output(h, None if own_heads is None else own_heads[batch])
            self.hidden[batch] = activations.add_mlp(h)
            if self.source_hidden is not None:
                h = self.source_hidden[batch]
                h = h + activations.source_output(h, None if heads is None else heads[batch])
                self.source_hidden[batch] = activations.add_mlp(h)
        self.layer += 1


class LayerActivations:
    """One layer's view of the stream: the source decoder layer and what measure.py and the fit steps read.

    The source attention's head outputs on the source stream are computed on first use and kept for the
    layer's lifetime (the refit, the reconstruction and ``advance`` share them)."""

    def __init__(self, stream: CalibrationStream, layer: int, source: torch.nn.Module):
        self.stream, self.layer, self.source = stream, layer, source
        self.plan, self.device, self.batch_size = stream.plan, stream.device, stream.batch_size
        self.hidden, self.source_hidden = stream.hidden, stream.source_hidden
        self.residual_scale = stream.plan.shape.residual_scale  # folded into the converted o_proj (source.py)
        self.compute = stream.compute
        self.computed_heads: torch.Tensor | None = None

    def batches(self):
        """Slices of ``batch_size`` sequences covering the stream."""
        return [slice(start, start + self.batch_size) for start in range(0, self.hidden.shape[0], self.batch_size)]

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The attention input, in the compute dtype: the source layer's input RMSNorm of hidden states ``h`` (b, L, D)."""
        return self.source.input_layernorm(h.to(self.compute))

    @torch.no_grad()
    def source_heads(self) -> torch.Tensor:
        """(N, L, H·d): the source attention's head outputs (what its o_proj reads) on the source stream (the one
        stream when there is no second)."""
        if self.computed_heads is None:
            with phase("source heads"):
                self.computed_heads = self._compute_source_heads()
        return self.computed_heads

    def _compute_source_heads(self) -> torch.Tensor:
        attention = self.source.self_attn
        stream = self.hidden if self.source_hidden is None else self.source_hidden
        heads = self.stream.buffer((*stream.shape[:2], attention.o_proj.in_features))
        captured = []
        hook = attention.o_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            for batch in self.batches():
                attention(self.normed(stream[batch]), position_embeddings=self.stream.source_rope, attention_mask=None)
                heads[batch] = captured.pop()
        finally:
            hook.remove()
        return heads

    def source_output(self, h: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """The source attention output on hidden states ``h`` (b, L, D), residual multiplier included: from
        ``heads``, their head outputs, when these were computed already."""
        if heads is not None:
            return self.residual_scale * self.source.self_attn.o_proj(heads.to(self.device, self.compute)).float()
        return self.residual_scale * self.source.self_attn(self.normed(h), position_embeddings=self.stream.source_rope,
                                                           attention_mask=None)[0].float()

    def add_mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The rest of the decoder layer: its MLP added to the residual stream ``h`` (b, L, D) after the attention."""
        return h + self.residual_scale * self.source.mlp(self.source.post_attention_layernorm(h.to(self.compute))).float()

    def target_attention(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.nn.Module:
        """A DeepseekV3Attention holding the converted layer's ``tensors`` in ``dtype`` (the compute dtype if not
        given), on the stream's device."""
        module = deepseek.DeepseekV3Attention(self.stream.modules.target_config, layer_idx=self.layer)
        state = module.state_dict()
        missing = [name for name in tensors if name not in state]
        if missing:
            raise RuntimeError(f"internal error: converted tensors {missing} have no place in DeepseekV3Attention")
        state.update({name: tensor.float() for name, tensor in tensors.items()})
        module.load_state_dict(state)
        return module.to(self.device, dtype or self.compute).eval()


def calibration_stream(reader: SourceReader) -> CalibrationStream:
    """The stream for ``plan.calibration`` (the calibration text, sizes and device), on the source's tokenizer."""
    settings = reader.plan.calibration
    tokenizer = load_tokenizer(reader.ckpt.folder, hint="calibration needs the source tokenizer: give a source with "
                               "its tokenizer files, or convert without calibration (--calib none)")
    tokens = calibration_token_ids(calibration_documents(settings.text), tokenizer, settings.samples, settings.seq_len)
    on_disk = check_budget(reader.plan, settings.max_memory)
    if on_disk:
        log.info("calibration activations kept on disk: one layer's working set exceeds the memory budget")
    return CalibrationStream(reader, tokens, device=settings.device, on_disk=on_disk)
