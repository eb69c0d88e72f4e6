"""The teacher of a recovery run: the frozen source model (a Hugging Face folder, a ``.gguf`` file, dequantized on
load, or a hub id, downloaded into the Hugging Face cache) that the student is distilled from and that writes the
training text when there is no ``--data`` (data/generated.py). A teacher folder was checked with the other inputs
(preflight.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.io import loader

STUDENT_ONLY_ATTENTION = ("mha2mla_triton", "auto")  # MLA kernels: an MHA/GQA teacher runs sdpa instead
TEACHER_HINT = "give the source model the converted one was made from"  # a teacher folder that does not read


def load_teacher(source: str | Path, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                 student_vocab: int | None = None):
    """The frozen source model of ``source`` (a folder, a ``.gguf`` file or a hub id) in ``dtype``, in eval mode without
    gradients. ``student_vocab``: the student's vocabulary size (its config's ``vocab_size``), which the teacher's
    must equal (None: not compared)."""
    implementation = "sdpa" if attn_implementation in STUDENT_ONLY_ATTENTION else attn_implementation
    # a dequantized GGUF model is a plain float model (docs/recover.md), loaded in ``dtype`` as a folder's is
    model = loader.load_causal_lm(source, dtype, attention=implementation)
    model.config.use_cache = False
    model.eval()
    model.requires_grad_(False)
    teacher_vocab = model.get_output_embeddings().weight.shape[0]
    if student_vocab is not None and student_vocab != teacher_vocab:
        raise UserError(
            f"the teacher's vocabulary ({teacher_vocab}) differs from the model's ({student_vocab}); "
            "distil from the model it was converted from."
        )
    return model
