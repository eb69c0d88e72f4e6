"""Layer-wise distillation: losses read inside the decoder instead of at the lm_head (docs/recover.md, "Layer-wise
objectives").

- ``hidden_state_losses``: each decoder layer's output (the residual stream after it) matched to the teacher's at
  the same depth, beside the KL at the head (intermediate-layer distillation): one term per layer, so that every
  layer gets a signal of its own, not only what reaches it back through the layers above.
- ``attention_output_losses``: teacher forcing. Each student attention gets the teacher's own attention input at
  its depth (the source's normalised residual) and is matched to the teacher's attention output there: the
  conversion's layer-wise reconstruction, continued on the training text. A step costs the teacher's forward and the
  attentions' forward and backward, not the student's MLPs, lm_head or the backward through its depth.

Both are relative squared errors per token, ``||s - t||^2 / ||t||^2``, averaged over positions and layers, so that a
token carrying a massive activation (an attention sink) weighs as much as any other."""

from __future__ import annotations

import contextlib

import torch

from mha2mla import UserError


def _layers(model):
    return model.get_decoder().layers


def _relative_error(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``||s - t||^2 / ||t||^2`` (float32)."""
    teacher = teacher.float()
    error = (student.float() - teacher).pow(2).sum(-1)
    return (error / teacher.pow(2).sum(-1).clamp(min=1e-12)).mean()


@contextlib.contextmanager
def layer_outputs(model):
    """The outputs of ``model``'s decoder layers, in order, recorded while the block runs (the hooks are gone after
    it, so a checkpointed layer's recomputation in the backward pass records nothing)."""
    captured: list[torch.Tensor] = []

    def hook(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    handles = [layer.register_forward_hook(hook) for layer in _layers(model)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def hidden_state_losses(student_layers: list[torch.Tensor], teacher_layers: list[torch.Tensor]) -> torch.Tensor:
    """The mean over layers of each layer output's relative error to the teacher's at the same depth."""
    if len(student_layers) != len(teacher_layers):
        raise UserError(f"the teacher has {len(teacher_layers)} decoder layers and the model {len(student_layers)}; "
                        "layer-wise distillation needs the model it was converted from as the teacher.")
    return torch.stack([_relative_error(s, t) for s, t in zip(student_layers, teacher_layers)]).mean()


class _Stop(Exception):
    """Ends a forward once what it was run for is recorded."""


def _attention_inputs(unwrapped, batch) -> dict:
    """The keyword arguments ``unwrapped``'s decoder gives its layers' attention for ``batch`` (the attention mask
    made from the packed rows' position ids, the rotary cos and sin), read by running it up to its first attention."""
    captured: dict = {}

    def hook(_module, _args, kwargs):
        captured.update(kwargs)
        raise _Stop

    handle = _layers(unwrapped)[0].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        unwrapped.get_decoder()(**batch, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    captured.pop("hidden_states", None)
    return captured


def _teacher_attention(teacher, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each teacher layer's attention input and output for ``batch`` (no gradient)."""
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []

    def before(_module, args, kwargs):
        inputs.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def after(_module, _args, output):
        outputs.append(output[0] if isinstance(output, tuple) else output)

    handles = []
    for layer in _layers(teacher):
        handles.append(layer.self_attn.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(after))
    try:
        with torch.no_grad():
            teacher.get_decoder()(**batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs


def attention_output_losses(unwrapped, teacher, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean over layers of the relative error of each student attention, run on the teacher's attention input
    at its depth, to the teacher's attention output there."""
    if teacher is None:
        raise UserError("the attention-output objective matches the source layer by layer; give --teacher.")
    inputs, outputs = _teacher_attention(teacher, batch)
    layers = _layers(unwrapped)
    if len(layers) != len(inputs):
        raise UserError(f"the teacher has {len(inputs)} decoder layers and the model {len(layers)}; layer-wise "
                        "distillation needs the model it was converted from as the teacher.")
    arguments = _attention_inputs(unwrapped, batch)
    errors = []
    for layer, x, y in zip(layers, inputs, outputs):
        out = layer.self_attn(hidden_states=x, **arguments)
        errors.append(_relative_error(out[0] if isinstance(out, tuple) else out, y))
    return torch.stack(errors).mean()
