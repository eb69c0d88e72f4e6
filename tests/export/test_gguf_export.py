"""`mha2mla export-gguf` on a tiny random model: the GGUF read back with the gguf package's own reader has the keys,
names, shapes and (at f32) the exact values llama.cpp's deepseek2 loader expects, and a forward written the way
llama.cpp computes (absorbed MLA, rope on adjacent pairs) from the GGUF alone reproduces transformers' logits
(docs/engines.md). Exact-profile models are refused, and OUT is never left half-written."""

from __future__ import annotations

import io
import json
import math
import shutil

import gguf
import numpy as np
import pytest
import sentencepiece
import torch
import typer
from common import SAMPLE_TEXT, build_source, logits, tiny_tokenizer
from typer.testing import CliRunner

from mha2mla import UserError
from mha2mla.cli.export import register
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert
from mha2mla.export import export_gguf
from mha2mla.export import gguf as export_module
from mha2mla.io.reader import LazyCheckpoint


def _convert(tmp_path_factory, profile: str):
    base = tmp_path_factory.mktemp(f"gguf-{profile}")
    source = build_source(base / "src", "llama", num_heads=4, num_kv_heads=2, with_tokenizer=False)
    tiny_tokenizer(384).save_pretrained(source)  # large enough to have BPE merges, which llama.cpp needs
    out = base / "mla"
    convert(source, out, ConvertConfig(calib=None, kv_budget=0.5, profile=profile), progress=False)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _convert(tmp_path_factory, "portable")


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    path = export_gguf(model, tmp_path_factory.mktemp("gguf") / "model.gguf", "f32")
    return gguf.GGUFReader(path)


def fields(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def tensors(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """Float tensors in numpy order (the reverse of ggml's ne)."""
    return {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}


def test_metadata_has_every_key_the_deepseek2_loader_reads(model, exported):
    config = json.loads((model / "config.json").read_text())
    r, d_r, d = config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    meta = fields(exported)
    expected = {
        "general.architecture": "deepseek2", "deepseek2.block_count": 2, "deepseek2.embedding_length": 64,
        "deepseek2.feed_forward_length": 96, "deepseek2.vocab_size": 384, "deepseek2.context_length": 512,
        "deepseek2.attention.head_count": 4, "deepseek2.attention.head_count_kv": 1,
        "deepseek2.leading_dense_block_count": 2, "deepseek2.attention.q_lora_rank": 0,
        "deepseek2.attention.kv_lora_rank": r, "deepseek2.attention.key_length": r + d_r,
        "deepseek2.attention.value_length": r, "deepseek2.attention.key_length_mla": d + d_r,
        "deepseek2.attention.value_length_mla": config["v_head_dim"], "deepseek2.rope.dimension_count": d_r,
        "deepseek2.expert_count": 0, "deepseek2.expert_used_count": 0, "deepseek2.expert_shared_count": 0,
        "deepseek2.expert_feed_forward_length": 0, "general.file_type": 0,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False,
    }
    assert {key: meta.get(key) for key in expected} == expected
    assert meta["deepseek2.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert meta["deepseek2.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    assert "deepseek2.expert_group_count" not in meta  # 0 groups: the loader's n_expert_groups < n_expert check never runs
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    assert len(meta["tokenizer.ggml.tokens"]) == 384 and len(meta["tokenizer.ggml.token_type"]) == 384
    assert meta["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    assert meta["tokenizer.ggml.tokens"][0] == "<|endoftext|>" and meta["tokenizer.ggml.token_type"][0] == gguf.TokenType.CONTROL


def test_tensor_names_shapes_and_exact_f32_values(model, exported):
    config = json.loads((model / "config.json").read_text())
    H, d, r, d_r = 4, config["qk_nope_head_dim"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    weights = LazyCheckpoint(model)
    stored = tensors(exported)
    ne = {t.name: [int(n) for n in t.shape] for t in exported.tensors}
    per_layer = ["attn_norm", "attn_q", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    names = ["token_embd.weight"] + [f"blk.{i}.{n}.weight" for i in range(2) for n in per_layer] + ["output_norm.weight", "output.weight"]
    assert [t.name for t in exported.tensors] == names
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in exported.tensors)
    assert ne["blk.0.attn_q.weight"] == [64, H * (d + d_r)] and ne["blk.0.attn_kv_a_mqa.weight"] == [64, r + d_r]
    assert ne["blk.0.attn_k_b.weight"] == [d, r, H] and ne["blk.0.attn_v_b.weight"] == [r, d, H]
    copies = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    for i in range(2):
        hf = f"model.layers.{i}."
        copies.update({f"blk.{i}.attn_norm": hf + "input_layernorm", f"blk.{i}.attn_q": hf + "self_attn.q_proj",
                       f"blk.{i}.attn_kv_a_mqa": hf + "self_attn.kv_a_proj_with_mqa",
                       f"blk.{i}.attn_kv_a_norm": hf + "self_attn.kv_a_layernorm", f"blk.{i}.attn_output": hf + "self_attn.o_proj",
                       f"blk.{i}.ffn_norm": hf + "post_attention_layernorm", f"blk.{i}.ffn_gate": hf + "mlp.gate_proj",
                       f"blk.{i}.ffn_up": hf + "mlp.up_proj", f"blk.{i}.ffn_down": hf + "mlp.down_proj"})
        kv_b = weights.get(hf + "self_attn.kv_b_proj.weight").view(H, 2 * d, r)
        assert torch.equal(stored[f"blk.{i}.attn_k_b.weight"], kv_b[:, :d].transpose(1, 2))  # W_UK[h]ᵀ
        assert torch.equal(stored[f"blk.{i}.attn_v_b.weight"], kv_b[:, d:])  # W_UV[h]
    for name, source in copies.items():  # rope rows included: no permutation, the interleaved rows are llama.cpp's
        assert torch.equal(stored[f"{name}.weight"], weights.get(f"{source}.weight")), name


def _rope_adjacent(x: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's "normal" rope: dims (2j, 2j+1) rotate together at base^(-2j/n) (x: [..., T, n])."""
    n, positions = x.shape[-1], torch.arange(x.shape[-2], dtype=torch.float64)
    angle = positions[:, None] * base ** (-torch.arange(0, n, 2, dtype=torch.float64) / n)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()), -1).flatten(-2)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ggml_forward(reader: gguf.GGUFReader, ids: list[int]) -> torch.Tensor:
    """Logits from the GGUF alone, computed as llama.cpp's deepseek2 graph does on its MLA path."""
    meta, w = fields(reader), {k: v.double() for k, v in tensors(reader).items()}
    H, r = meta["deepseek2.attention.head_count"], meta["deepseek2.attention.kv_lora_rank"]
    d_r, d_k = meta["deepseek2.rope.dimension_count"], meta["deepseek2.attention.key_length_mla"]
    eps, base = meta["deepseek2.attention.layer_norm_rms_epsilon"], meta["deepseek2.rope.freq_base"]
    T, x = len(ids), w["token_embd.weight"][ids]
    mask = torch.full((T, T), float("-inf")).triu(1).double()
    for i in range(meta["deepseek2.block_count"]):
        p = lambda n, i=i: w[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, p("attn_norm"), eps)
        q = (h @ p("attn_q").T).view(T, H, d_k).transpose(0, 1)  # [H, T, d_k]
        q_pe = _rope_adjacent(q[..., d_k - d_r:], base)
        kv = h @ p("attn_kv_a_mqa").T
        latent, k_pe = _rms(kv[:, :r], p("attn_kv_a_norm"), eps), _rope_adjacent(kv[:, r:], base)
        q_latent = torch.einsum("htn,hrn->htr", q[..., : d_k - d_r], p("attn_k_b"))  # absorbed W_UK
        scores = (q_latent @ latent.T + q_pe @ k_pe.T) / math.sqrt(d_k) + mask
        heads = torch.einsum("hts,sr,hvr->thv", scores.softmax(-1), latent, p("attn_v_b"))  # absorbed W_UV
        x = x + heads.reshape(T, -1) @ p("attn_output").T
        h = _rms(x, p("ffn_norm"), eps)
        x = x + (torch.nn.functional.silu(h @ p("ffn_gate").T) * (h @ p("ffn_up").T)) @ p("ffn_down").T
    return _rms(x, w["output_norm.weight"], eps) @ w["output.weight"].T


def test_llamacpp_style_forward_of_the_gguf_matches_transformers(model, exported):
    ids = [5, 17, 200, 33, 90, 1, 300, 42, 7, 250, 128, 64]
    expected = logits(model, torch.tensor([ids]))[0].double()
    got = ggml_forward(exported, ids)
    # the one difference left: transformers' kv_a_layernorm eps is 1e-6, llama.cpp's is rms_norm_eps (1e-5)
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max()


def test_quantised_and_half_types(model, tmp_path):
    reader = gguf.GGUFReader(export_gguf(model, tmp_path / "q8.gguf", "q8_0"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    Q = gguf.GGMLQuantizationType
    assert types["blk.0.attn_norm.weight"] == Q.F32 and types["blk.0.attn_kv_a_norm.weight"] == Q.F32
    assert types["blk.0.attn_q.weight"] == Q.Q8_0 and types["token_embd.weight"] == Q.Q8_0
    assert types["blk.0.attn_v_b.weight"] == Q.F16  # rows of r = 24 do not split into blocks of 32
    assert types["blk.0.attn_kv_a_mqa.weight"] == Q.F16  # the latent projection is never block-quantised
    meta = fields(reader)
    assert meta["general.file_type"] == 7 and meta["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    restored = gguf.quants.dequantize(q.data, q.tensor_type)
    original = LazyCheckpoint(model).get("model.layers.0.self_attn.q_proj.weight").numpy()
    assert restored.shape == original.shape and np.abs(restored - original).max() < 0.01 * np.abs(original).max()
    for name, qtype in (("f16", Q.F16), ("bf16", Q.BF16)):
        half = gguf.GGUFReader(export_gguf(model, tmp_path / f"{name}.gguf", name))
        assert {t.tensor_type for t in half.tensors} == {Q.F32, qtype}


def test_sentencepiece_tokenizer(model, tmp_path):
    """A SentencePiece tokenizer (Llama-2, Mistral) is written as llama.cpp's `llama` vocab with scores and types."""
    folder = tmp_path / "spm"
    shutil.copytree(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SAMPLE_TEXT.splitlines() * 20), model_writer=buffer, vocab_size=330, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(buffer.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    meta = fields(gguf.GGUFReader(export_gguf(folder, tmp_path / "spm.gguf", "f16")))
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.pre" not in meta
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.scores"]) == 384
    types = meta["tokenizer.ggml.token_type"]
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert gguf.TokenType.BYTE in types and types[-1] == gguf.TokenType.UNUSED  # byte fallback; padding to vocab_size
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.add_bos_token"] is True


def test_exact_profile_and_unconverted_models_are_refused(tmp_path_factory, model, tmp_path):
    exact = _convert(tmp_path_factory, "exact")
    with pytest.raises(UserError, match="exact-profile conversion"):
        export_gguf(exact, tmp_path / "x.gguf")
    with pytest.raises(UserError, match="not a converted checkpoint"):
        export_gguf(exact.parent / "src", tmp_path / "x.gguf")
    with pytest.raises(UserError, match="unknown --type"):
        export_gguf(model, tmp_path / "x.gguf", "q4_k")
    assert list(tmp_path.iterdir()) == []


def test_out_is_written_atomically(model, tmp_path, monkeypatch):
    out = tmp_path / "model.gguf"
    export_gguf(model, out, "f32")
    previous = out.read_bytes()
    with pytest.raises(UserError, match="pass --force"):
        export_gguf(model, out)
    calls, encode = [], export_module.encode

    def failing(tensor, qtype, name):  # the fifth tensor fails halfway through the file
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return encode(tensor, qtype, name)

    monkeypatch.setattr(export_module, "encode", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        export_gguf(model, out, force=True)
    assert out.read_bytes() == previous and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    monkeypatch.undo()
    export_gguf(model, out, "f16", force=True)
    assert fields(gguf.GGUFReader(out))["general.architecture"] == "deepseek2"


def test_cli_command(model, tmp_path):
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    result = CliRunner().invoke(app, ["export-gguf", str(model), str(tmp_path / "m.gguf"), "--type", "bf16"])
    assert result.exit_code == 0 and "wrote" in result.output
    result = CliRunner().invoke(app, ["export-gguf", str(model), str(tmp_path / "m.gguf")])
    assert isinstance(result.exception, UserError) and "--force" in str(result.exception)
