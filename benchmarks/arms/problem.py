"""A captured reconstruction problem as the solvers of benchmarks/recon_solvers.py read it: the same held-out split
as ``mha2mla.convert.steps.reconstruct`` makes, and the converted layer's forward on some of its sequences."""

from __future__ import annotations


def split(data) -> tuple[int, range]:
    """(training sequences, held-out range): the last ``HELD_OUT_FRACTION`` of the sequences held out, as the default."""
    from mha2mla.convert.steps.reconstruct import HELD_OUT_FRACTION

    n = data.x.shape[0]
    held = max(1, round(n * HELD_OUT_FRACTION))
    return n - held, range(n - held, n)


def forward(module, data, index):
    """The layer's attention output on the sequences ``index`` of ``data``."""
    return module(data.x[index], position_embeddings=data.position_embeddings, attention_mask=data.attention_mask)[0]
