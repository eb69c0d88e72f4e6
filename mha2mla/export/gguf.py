"""``export_gguf``: a portable-profile checkpoint as a GGUF that llama.cpp runs as ``deepseek2`` with its MLA cache.

The facts this module relies on were read from llama.cpp as vendored in llama-cpp-python 0.3.36 and are listed in
docs/engines.md: the metadata keys the deepseek2 loader reads, the tensor names and ggml shapes it creates, the
split ``attn_k_b`` / ``attn_v_b`` form it wants for the absorbed (MLA) path, and its "normal" rope on adjacent
pairs, which is the interleaved layout ``convert`` already writes (docs/design.md §2), so rope rows are copied
unchanged. Tensors are streamed one at a time into a temporary file that is renamed onto OUT at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from mha2mla import UserError, __version__
from mha2mla.convert.output.portable import check_portable_folder
from mha2mla.export.vocab import check_pre_tokenizer, read_vocab
from mha2mla.io.output import user_path
from mha2mla.io.output_file import check_file_destination, staged_file
from mha2mla.io.reader import LazyCheckpoint

log = logging.getLogger(__name__)
# The gguf package's writer logs at INFO what export-gguf says itself (and the hidden staging file's name).
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)

ARCH = "deepseek2"
# The start of general.description in every GGUF export-gguf writes; --force replaces only such files.
DESCRIPTION_PREFIX = "MLA conversion written by mha2mla"
Q = gguf.GGMLQuantizationType
# --type choices: the float types and the block quantisations the gguf package can write (gguf.quants).
TENSOR_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0,
                "q5_1": Q.Q5_1, "q5_0": Q.Q5_0, "q4_1": Q.Q4_1, "q4_0": Q.Q4_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "bf16": 32}  # llama_ftype


@dataclass
class TensorPlan:
    """One GGUF tensor: its name, its numpy-order shape, its stored type, and how to read it as float32."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    load: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Dims:
    """The sizes the export needs, read from the converted config.json (docs/design.md notation)."""

    hidden: int
    layers: int
    heads: int
    nope: int
    rope: int
    value: int
    rank: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict) -> Dims:
        return cls(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=config["num_attention_heads"],
                   nope=config["qk_nope_head_dim"], rope=config["qk_rope_head_dim"], value=config["v_head_dim"],
                   rank=config["kv_lora_rank"], intermediate=config["intermediate_size"], vocab=config["vocab_size"])


def export_gguf(model_folder: str | Path, out_path: str | Path, tensor_type: str = "f16", *,
                force: bool = False, pre_tokenizer: str | None = None) -> Path:
    """Write the converted checkpoint in ``model_folder`` as a llama.cpp ``deepseek2`` GGUF at ``out_path``.

    ``tensor_type``: one of :data:`TENSOR_TYPES` for the matrices (norms stay float32; with a block quantisation
    the latent projection, and any matrix whose rows do not split into blocks, are written as f16). ``pre_tokenizer``: the llama.cpp pre-tokenizer name, when
    the one in tokenizer.json is not recognised. Returns ``out_path`` (a ``~`` in it expanded, as everywhere)."""
    folder, out = user_path(model_folder), user_path(out_path)
    if tensor_type not in TENSOR_TYPES:
        raise UserError(f"unknown --type {tensor_type!r}; choose one of {', '.join(TENSOR_TYPES)}.")
    check_pre_tokenizer(pre_tokenizer)
    check_file_destination(out_path, [("the model being exported", folder)], force=force,
                           is_ours_file=written_by_mha2mla, kind="GGUF")
    ckpt = LazyCheckpoint(folder)
    check_exportable(folder, ckpt.config)
    dims = Dims.from_config(ckpt.config)
    vocab = read_vocab(folder, dims.vocab, pre_tokenizer)
    plans = tensor_plans(ckpt, dims, TENSOR_TYPES[tensor_type])
    with staged_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCH)
        try:
            write_metadata(writer, ckpt.config, dims, tensor_type, folder.name)
            vocab.add_to(writer, folder)
            _write_tensors(writer, plans)
        finally:
            writer.close()
    return out


def written_by_mha2mla(path: Path) -> bool:
    """True when ``path`` is a GGUF whose description says mha2mla's export-gguf wrote it (what --force may replace)."""
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                return False
        field = gguf.GGUFReader(path).get_field("general.description")
        return field is not None and field.contents().startswith(DESCRIPTION_PREFIX)
    except Exception:  # unreadable or not a GGUF: never ours
        return False


def check_exportable(folder: Path, config: dict) -> None:
    """Refuse what llama.cpp's deepseek2 cannot run as it is: anything but a portable-profile conversion."""
    if config.get("model_type") != "deepseek_v3":
        raise UserError(f"{folder} is not a converted checkpoint (model_type {config.get('model_type')!r}); "
                        "run `mha2mla convert` on it first.")
    profile = (config.get("mha2mla") or {}).get("profile")
    if profile == "exact" or config.get("attention_bias") or config.get("q_lora_rank") is not None:
        raise UserError(f"{folder} is an exact-profile conversion (attention biases and the q_lora path), which "
                        "llama.cpp's deepseek2 cannot run; convert the source again with --profile portable.")
    problems = check_portable_folder(folder)
    if problems:
        raise UserError(f"{folder} is not a portable checkpoint ({problems[0]}); convert it again with --profile portable.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UserError(f"{folder} uses rope scaling {rope.get('rope_type')!r}, but export-gguf writes plain rope only; "
                        "convert with the portable profile, which writes plain rope.")


def metadata(config: dict, dims: Dims) -> dict[str, tuple[object, gguf.GGUFValueType]]:
    """The architecture keys of the GGUF (docs/engines.md lists where llama.cpp reads each one)."""
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    keys = {
        "context_length": (config.get("max_position_embeddings", 4096), u32),
        "embedding_length": (dims.hidden, u32),
        "block_count": (dims.layers, u32),
        "feed_forward_length": (dims.intermediate, u32),
        "vocab_size": (dims.vocab, u32),
        "leading_dense_block_count": (dims.layers, u32),  # every MLP dense (first_k_dense_replace)
        "attention.head_count": (dims.heads, u32),
        "attention.head_count_kv": (1, u32),  # the absorbed MLA path is MQA over the latent
        "attention.layer_norm_rms_epsilon": (config.get("rms_norm_eps", 1e-6), f32),
        "attention.q_lora_rank": (0, u32),  # q_proj directly; the loader requires the key
        "attention.kv_lora_rank": (dims.rank, u32),
        "attention.key_length": (dims.rank + dims.rope, u32),  # one cached key: latent + rope key
        "attention.value_length": (dims.rank, u32),  # the value is the latent
        "attention.key_length_mla": (dims.nope + dims.rope, u32),  # per-head q/k size, sets the softmax scale
        "attention.value_length_mla": (dims.value, u32),
        "rope.dimension_count": (dims.rope, u32),
        "rope.freq_base": (float(rope_theta), f32),
        # no experts: 0 keeps the loader's expert checks (n_expert_groups < n_expert) out of the way
        "expert_count": (0, u32),
        "expert_used_count": (0, u32),
        "expert_shared_count": (0, u32),  # required key
        "expert_feed_forward_length": (0, u32),  # required key, unused without experts
    }
    return {f"{ARCH}.{key}": value for key, value in keys.items()}


def write_metadata(writer: gguf.GGUFWriter, config: dict, dims: Dims, tensor_type: str, name: str) -> None:
    writer.add_name(name)
    writer.add_description(f"{DESCRIPTION_PREFIX} {__version__} export-gguf")
    writer.add_file_type(FILE_TYPES[tensor_type])
    if TENSOR_TYPES[tensor_type] not in (Q.F32, Q.F16, Q.BF16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, value_type) in metadata(config, dims).items():
        writer.add_key_value(key, value, value_type)


def _stored_type(name: str, shape: tuple[int, ...], requested: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Norms (1-D) in float32. With a block quantisation, the latent projection ``attn_kv_a_mqa`` stays f16: every
    cached value comes from it and kv_a_norm rescales its error (SmolLM2 at 31.25%, q8_0: top-1 agreement 93.8%
    quantised, 98.8% in f16, docs/engines.md), for 2% of the weights. Other matrices take a block quantisation only
    where each row splits into whole blocks, else f16."""
    if len(shape) == 1:
        return Q.F32
    if requested in (Q.F32, Q.F16, Q.BF16):
        return requested
    if name.endswith("attn_kv_a_mqa.weight"):
        return Q.F16
    block, _ = gguf.GGML_QUANT_SIZES[requested]
    if shape[-1] % block:
        log.info("%s: rows of %d do not split into blocks of %d; writing it as f16", name, shape[-1], block)
        return Q.F16
    return requested


def _split_kv_b(ckpt: LazyCheckpoint, name: str, dims: Dims, part: str) -> torch.Tensor:
    """kv_b_proj [H·(d_n + d_v), r] as llama.cpp's two absorbed tensors: k_b[h] = W_UK[h]ᵀ [H, r, d_n] and
    v_b[h] = W_UV[h] [H, d_v, r] (docs/design.md §2 gives the per-head row order)."""
    kv_b = ckpt.get(name, torch.float32, shape=(dims.heads * (dims.nope + dims.value), dims.rank))
    per_head = kv_b.view(dims.heads, dims.nope + dims.value, dims.rank)
    if part == "k":
        return per_head[:, : dims.nope, :].transpose(1, 2).contiguous()
    return per_head[:, dims.nope :, :].contiguous()


def _layer_sources(layer: int, dims: Dims) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, checkpoint name, shape) of the tensors of one layer that are copied as they are."""
    hf, blk = f"model.layers.{layer}.", f"blk.{layer}."
    D, H, r = dims.hidden, dims.heads, dims.rank
    return [
        (blk + "attn_norm.weight", hf + "input_layernorm.weight", (D,)),
        (blk + "attn_q.weight", hf + "self_attn.q_proj.weight", (H * (dims.nope + dims.rope), D)),
        (blk + "attn_kv_a_mqa.weight", hf + "self_attn.kv_a_proj_with_mqa.weight", (r + dims.rope, D)),
        (blk + "attn_kv_a_norm.weight", hf + "self_attn.kv_a_layernorm.weight", (r,)),
        (blk + "attn_output.weight", hf + "self_attn.o_proj.weight", (D, H * dims.value)),
        (blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight", (D,)),
        (blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight", (dims.intermediate, D)),
        (blk + "ffn_up.weight", hf + "mlp.up_proj.weight", (dims.intermediate, D)),
        (blk + "ffn_down.weight", hf + "mlp.down_proj.weight", (D, dims.intermediate)),
    ]


def tensor_plans(ckpt: LazyCheckpoint, dims: Dims, requested: gguf.GGMLQuantizationType) -> list[TensorPlan]:
    """Every tensor of the GGUF in file order, with the checkpoint tensor it comes from."""
    output = "lm_head.weight" if ckpt.has("lm_head.weight") else "model.embed_tokens.weight"  # tied: the embeddings
    copies = [("token_embd.weight", "model.embed_tokens.weight", (dims.vocab, dims.hidden))]
    for layer in range(dims.layers):
        copies += _layer_sources(layer, dims)
    copies += [("output_norm.weight", "model.norm.weight", (dims.hidden,)),
               ("output.weight", output, (dims.vocab, dims.hidden))]
    plans = []
    for gguf_name, source, shape in copies:
        plans.append(TensorPlan(gguf_name, shape, _stored_type(gguf_name, shape, requested),
                                lambda s=source, sh=shape: ckpt.get(s, torch.float32, shape=sh)))
        if gguf_name.endswith("attn_kv_a_norm.weight"):  # the split kv_b_proj follows the latent norm
            layer = int(gguf_name.split(".")[1])
            kv_b = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            for part, shape_b in (("k", (dims.heads, dims.rank, dims.nope)), ("v", (dims.heads, dims.value, dims.rank))):
                plans.append(TensorPlan(f"blk.{layer}.attn_{part}_b.weight", shape_b,
                                        _stored_type(f"attn_{part}_b", shape_b, requested),
                                        lambda n=kv_b, p=part: _split_kv_b(ckpt, n, dims, p)))
    return plans


def encode(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType, name: str) -> np.ndarray:
    """The bytes (as a numpy array) of ``tensor`` stored as ``qtype``."""
    values = tensor.detach().to(torch.float32).contiguous().numpy()
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        encoded = values.astype(np.float16)
        if not np.isfinite(encoded).all():
            raise UserError(f"tensor {name} overflows float16; export with --type bf16 or f32.")
        return encoded
    return gguf.quants.quantize(values, qtype)


def _byte_shape(plan: TensorPlan) -> tuple[tuple[int, ...], np.dtype]:
    if plan.qtype == Q.F32:
        return plan.shape, np.dtype(np.float32)
    if plan.qtype == Q.F16:
        return plan.shape, np.dtype(np.float16)
    return tuple(gguf.quant_shape_to_byte_shape(plan.shape, plan.qtype)), np.dtype(np.uint8)


def _write_tensors(writer: gguf.GGUFWriter, plans: list[TensorPlan]) -> None:
    """Header, metadata and tensor table first, then each tensor's data read, converted and written in turn."""
    for plan in plans:
        shape, dtype = _byte_shape(plan)
        raw = None if dtype != np.uint8 else plan.qtype
        writer.add_tensor_info(plan.name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for plan in plans:
        writer.write_tensor_data(encode(plan.load(), plan.qtype, plan.name))
