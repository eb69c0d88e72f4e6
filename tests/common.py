"""Tiny random models and a tiny tokenizer, built in-process (no network) for fast tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

SAMPLE_TEXT = (
    "In the beginning the model had many heads, and every head kept its own keys and values. "
    "Then the keys were gathered into a latent, and the cache grew small. "
    "def add(a, b):\n    return a + b\n"
) * 8


def tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences (ids < vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def source_config(
    family: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 384,
    intermediate_size: int = 96,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    **extra,
):
    from transformers import AutoConfig

    kwargs = dict(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=num_layers,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=0,
        eos_token_id=0,
    )
    kwargs.update(extra)
    return AutoConfig.for_model(family, **kwargs)


def randomize_weights(model, std: float = 0.15) -> None:
    """Larger-than-default random weights (matrices of standard deviation ``std``): peaked attention patterns, logits
    of several units."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)


def logits(folder, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the model saved in ``folder``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def run_cli(args, capsys) -> tuple[int, str, str]:
    """Run ``mha2mla ARGS`` in-process through the real entry point: (exit code, stdout, stderr).
    Output printed before the call (fixtures' progress bars) is discarded."""
    import sys

    from mha2mla.cli.main import main

    capsys.readouterr()
    old_argv = sys.argv
    sys.argv = ["mha2mla", *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = old_argv
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def build_source(path: Path, family: str = "llama", seed: int = 0, with_tokenizer: bool = True, **config_kwargs) -> Path:
    """Save a random source model of ``family`` (safetensors) and a tiny tokenizer to ``path``."""
    torch.manual_seed(seed)
    config = source_config(family, **config_kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model)
    model.save_pretrained(path)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return Path(path)


def tiny_deepseek_config(
    num_heads: int = 4,
    hidden_size: int = 64,
    kv_lora_rank: int = 24,
    qk_rope_head_dim: int = 8,
    qk_nope_head_dim: int = 16,
    v_head_dim: int = 16,
    num_layers: int = 2,
    vocab_size: int = 384,
    **extra,
):
    """A dense (no MoE) DeepSeek-V3 MLA config of the kind ``mha2mla convert`` writes."""
    from transformers import DeepseekV3Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        first_k_dense_replace=num_layers,
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        rope_interleave=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=0,
    )
    kwargs.update(extra)
    return DeepseekV3Config(**kwargs)


def snapshot(root: Path) -> dict:
    """Every entry under ``root``: kind, permission bits and content hash (or link target)."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            mode = path.lstat().st_mode & 0o7777
            if path.is_symlink():
                entries[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[str(path.relative_to(root))] = ("dir", mode)
            else:
                entries[str(path.relative_to(root))] = ("file", mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return entries


def one_error_line(err: str, needle: str) -> str:
    """The one ``error:`` line of ``err``, which must name ``needle``: no traceback, nothing else on stderr."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    return lines[0]


def refused(args, needle: str, root: Path, capsys, code: int = 2) -> str:
    """Run the CLI with ``args``: exit ``code``, one ``error:`` line naming ``needle``, ``root`` byte-identical."""
    before = snapshot(root)
    got, _, err = run_cli(args, capsys)
    assert got == code, err
    line = one_error_line(err, needle)
    assert snapshot(root) == before
    return line


def tiny_output(base: Path) -> Path:
    """An mha2mla output folder under ``base``: a weight-only portable conversion of a tiny Llama whose tokenizer has
    BPE merges (which export-gguf needs)."""
    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    source = build_source(base / "src", "llama", num_heads=4, num_kv_heads=2, with_tokenizer=False)
    tiny_tokenizer(384).save_pretrained(source)
    convert(source, base / "mla", ConvertConfig(calib="none"), progress=False)
    return base / "mla"


class CharTokenizer:
    """One token per character (its code point), EOS 0; encodes one text or a list, as a transformers tokenizer."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        encode = lambda text: [ord(c) for c in text]  # noqa: E731
        return {"input_ids": encode(texts) if isinstance(texts, str) else [encode(t) for t in texts]}
