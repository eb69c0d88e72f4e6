"""Launch settings of the MLA kernels, chosen per shape (docs/kernels.md, "Tiles, warps and splits").

Pure Python (no Triton), so every choice is unit-tested on the CPU:

- :func:`flash_candidates`: the tile/warp configs tried for the training kernel at a head-dim shape; the first
  is the table's choice when nothing is timed. :class:`ConfigCache` keeps, per :func:`flash_shape_key`, the
  fastest candidate a timing function reports (the autotuning on CUDA; ``MHA2MLA_KERNELS_AUTOTUNE=0`` keeps the
  table's first candidate).
- :func:`decode_num_splits`: how many slices of the cache the split-KV decode cuts each sequence into, from
  batch x head groups x length and the GPU's multiprocessor count, so one wave of programs fills the GPU; the
  slices are merged in one combine pass.
- :func:`dkv_heads_per_program`: how many heads one dK/dV program walks (one on a GPU; each head group writes
  its partial sum of the rope key's gradient, which one reduction adds: no atomics).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

H200_MULTIPROCESSORS = 132  # the GPU the tables were written for; the live count is read from the device


@dataclass(frozen=True)
class FlashMLAConfig:
    """Tile sizes and warps of the training kernel: forward (block_m queries x block_n keys), backward (the
    dK/dV pass owns bwd_block_n keys and walks bwd_block_m queries; the dQ pass the transpose).
    ``heads_per_program`` (dK/dV pass): None picks one from the grid size (:func:`dkv_heads_per_program`)."""

    block_m: int = 64
    block_n: int = 64
    bwd_block_m: int = 32
    bwd_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    heads_per_program: int | None = None


INTERPRETER_CONFIG = FlashMLAConfig(block_m=32, block_n=32, bwd_block_m=16, bwd_block_n=32, num_warps=1,
                                    num_stages=1, bwd_num_warps=1, bwd_num_stages=1)

# GPU candidates by padded head width (BLOCK_DN + BLOCK_DR + BLOCK_DV): wider heads hold more registers per row,
# so they get shorter key tiles and more warps. (block_m, block_n, warps, stages) forward, then backward. Not yet
# measured on a GPU (docs/benchmarks.md): the first entry of each list is what runs without autotuning. Every
# backward key tile is >= 64 rows: the dK/dV and dQ dots take it as their M dimension, and under 64 Triton cannot
# use Hopper's wgmma (`kernels_bench.py --compile` lists each config's registers, spills and wgmma count).
NARROW_FORWARD = [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
NARROW_BACKWARD = [(32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)]
WIDE_FORWARD = [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3)]
WIDE_BACKWARD = [(32, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (16, 64, 4, 2)]
WIDE_HEADS = 256  # padded width above which a shape counts as wide (DeepSeek: 128 + 64 + 128 = 320)


def next_power_of_two(n: int, minimum: int = 16) -> int:
    """Tile width for a dimension of size n (tl.dot needs at least 16)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def padded_head_width(d_nope: int, d_rope: int, d_v: int) -> int:
    return next_power_of_two(d_nope) + next_power_of_two(d_rope) + next_power_of_two(d_v)


def flash_candidates(d_nope: int, d_rope: int, d_v: int, interpreting: bool) -> list[FlashMLAConfig]:
    """The configs tried at this head-dim shape, the table's choice first. Each pairs the i-th forward with the
    i-th backward setting; the autotuner times the two halves separately (:func:`forward_part`,
    :func:`backward_part`). The interpreter has one: tiles are numpy arrays there, small ones are fastest."""
    if interpreting:
        return [INTERPRETER_CONFIG]
    wide = padded_head_width(d_nope, d_rope, d_v) > WIDE_HEADS
    forward, backward = (WIDE_FORWARD, WIDE_BACKWARD) if wide else (NARROW_FORWARD, NARROW_BACKWARD)
    return [FlashMLAConfig(block_m=fm, block_n=fn, num_warps=fw, num_stages=fs, bwd_block_m=bm, bwd_block_n=bn,
                           bwd_num_warps=bw, bwd_num_stages=bs)
            for (fm, fn, fw, fs), (bm, bn, bw, bs) in zip(forward, backward)]


def forward_part(config: FlashMLAConfig) -> tuple[int, int, int, int]:
    return config.block_m, config.block_n, config.num_warps, config.num_stages


def backward_part(config: FlashMLAConfig) -> tuple[int, int, int, int]:
    return config.bwd_block_m, config.bwd_block_n, config.bwd_num_warps, config.bwd_num_stages


def combine(forward: FlashMLAConfig, backward: FlashMLAConfig) -> FlashMLAConfig:
    """The forward settings of one config with the backward settings of another."""
    return replace(forward, bwd_block_m=backward.bwd_block_m, bwd_block_n=backward.bwd_block_n,
                   bwd_num_warps=backward.bwd_num_warps, bwd_num_stages=backward.bwd_num_stages)


def length_bucket(n: int) -> int:
    """Lengths and batch x heads are keyed by their power of two: nearby shapes share a tuned config."""
    return 1 << max(0, (n - 1).bit_length())


def flash_shape_key(pass_name: str, batch: int, heads: int, q_len: int, k_len: int, d_nope: int, d_rope: int,
                    d_v: int, dtype: str, causal: bool, packed: bool) -> tuple:
    """What a tuned config is cached under: the pass, the exact head dims and dtype, the masking, and the
    power-of-two buckets of the lengths and of batch x heads."""
    return (pass_name, d_nope, d_rope, d_v, dtype, causal, packed, length_bucket(q_len), length_bucket(k_len),
            length_bucket(batch * heads))


def autotune_enabled(interpreting: bool) -> bool:
    """Autotuning runs on the GPU only, unless ``MHA2MLA_KERNELS_AUTOTUNE=0``."""
    return not interpreting and os.environ.get("MHA2MLA_KERNELS_AUTOTUNE", "1") != "0"


class ConfigCache:
    """The fastest candidate per shape key, timed once with the given timing function (milliseconds; a
    candidate that fails to launch, e.g. out of shared memory, raises and is skipped)."""

    def __init__(self) -> None:
        self.best: dict[tuple, FlashMLAConfig] = {}
        self.timings: dict[tuple, list[float]] = {}

    def pick(self, key: tuple, candidates: list[FlashMLAConfig], time_ms: Callable[[FlashMLAConfig], float]):
        if key in self.best:
            return self.best[key]
        if len(candidates) == 1:
            self.best[key] = candidates[0]
            return candidates[0]
        timings = []
        for config in candidates:
            try:
                timings.append(float(time_ms(config)))
            except Exception:  # a config the compiler or the GPU rejects is not a choice
                timings.append(math.inf)
        if all(math.isinf(t) for t in timings):
            raise RuntimeError(f"no MLA kernel config ran for {key}: {candidates}")
        self.timings[key] = timings
        self.best[key] = candidates[timings.index(min(timings))]
        return self.best[key]


def dkv_heads_per_program(heads: int, batch: int, k_len: int, d_rope: int, multiprocessors: int | None,
                          max_partial_bytes: int = 1 << 30) -> int:
    """Heads one dK/dV program walks. On a GPU one: a loop over heads makes the compiler spill registers in that
    kernel (`kernels_bench.py --compile`), and one head per program is the forward's grid; each head then stores
    its own partial rope-key gradient, (heads, B, Tk, d_r) float32 added up after the kernel. Only when that
    buffer would pass ``max_partial_bytes`` are heads grouped, as few per program as keeps it under.
    ``multiprocessors`` None (CPU / interpreter): all heads in one program (one partial)."""
    if multiprocessors is None:
        return heads
    per_head = batch * k_len * d_rope * 4
    groups = max(1, min(heads, max_partial_bytes // max(1, per_head)))
    return -(-heads // groups)


def decode_num_splits(batch: int, head_groups: int, max_len: int, block_n: int, multiprocessors: int | None,
                      overhead_tiles: float = 2.0, max_waves: int = 4) -> int:
    """Slices per sequence for the split-KV decode. Cost model: programs run in waves of one per
    multiprocessor, and a wave lasts as long as its longest program, ``ceil(tiles / splits) + overhead_tiles``
    (loading the queries, writing the partial result). The split count with the least ``waves x that`` wins;
    ties go to fewer splits (less to merge). Never more splits than cache tiles, nor more than ``max_waves`` waves.
    ``multiprocessors`` None (CPU / interpreter): at most 2 splits, to exercise the merge.

    Called on every decode step, so it tries only the candidates that can win: within one wave count the cost
    falls as splits grow, so the most splits that still fit each wave count, brought down to the fewest splits
    with the same tiles per split (at most ``max_waves + 1`` candidates)."""
    tiles = max(1, -(-max_len // block_n))
    if multiprocessors is None:
        return min(2, tiles)
    programs = max(1, batch * head_groups)
    best = (math.inf, 1)
    for waves in range(0, max_waves + 1):  # 0 stands for a single split
        splits = 1 if waves == 0 else min(tiles, waves * multiprocessors // programs)
        if splits < 1:
            continue
        per_split = -(-tiles // splits)
        splits = -(-tiles // per_split)  # the fewest splits with this many tiles each
        cost = -(-programs * splits // multiprocessors) * (per_split + overhead_tiles)
        best = min(best, (cost, splits))
    return best[1]


def decode_blocks(num_heads: int, rank: int, interpreting: bool) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps) of the split-KV decode: heads per program (each head group re-reads the cache)
    up to 64, but 32 when r > 256, where the (BLOCK_H, r) float32 accumulator of 64 heads spills registers on
    sm_90 (`kernels_bench.py --compile`); cache tiles of 32 rows at r >= 512 else 64."""
    if interpreting:
        return 16, 16, 1
    block_h = min(32 if rank > 256 else 64, next_power_of_two(num_heads))
    block_n = 32 if next_power_of_two(rank) >= 512 else 64
    return block_h, block_n, 4 if block_h <= 16 else 8
