"""The models of a recovery run: the student (student.py: the converted MLA model and its attention kernel; its
latents balanced: latents.py), the teacher (teacher.py), what trains of the student (trainable.py), and
the merged model written to OUT (merge.py)."""

from mha2mla.train.model.latents import balance_latent_scales
from mha2mla.train.model.student import build_student, load_student, resolve_attn_implementation
from mha2mla.train.model.teacher import load_teacher
from mha2mla.train.model.trainable import make_trainable

__all__ = ["balance_latent_scales", "build_student", "load_student", "load_teacher", "make_trainable",
           "resolve_attn_implementation"]
