"""What a person reads: progress bars only on a terminal (theirs and transformers'), no GGUF dtype warning, usage
lines as click writes them, inspect of a .gguf without dequantising it, and a --help that loads no torch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from common import run_cli, snapshot

BARS = ("Loading weights", "Writing model shards", "de-quantizing GGUF tensors", "converting (")


def write_llama_gguf(folder: Path, path: Path) -> Path:
    """The Llama safetensors folder ``folder`` (with its byte-level BPE tokenizer) as an F32 GGUF file, in the
    names and keys llama.cpp writes, so transformers reads it back as a Llama."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())["model"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tokenizer["vocab"], key=tokenizer["vocab"].get)
    vocab += [f"<extra_{i}>" for i in range(config["vocab_size"] - len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name not in names:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            names[name] = f"blk.{layer}.{parts[rest.removesuffix('.weight')]}.weight"
        writer.add_tensor(names[name], tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(llama_source, tmp_path_factory) -> Path:
    """The tiny Llama source as a .gguf file. Shared: never modify it."""
    return write_llama_gguf(llama_source, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _cli(args, tmp_path: Path, terminal: bool) -> tuple[int, str]:
    """``mha2mla ARGS`` in a fresh process with its own cache; stderr a pipe, or a terminal 120 columns wide."""
    env = {**os.environ, "MHA2MLA_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "mha2mla.cli.main", *map(str, args)]
    if not terminal:
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        return done.returncode, done.stderr.decode()
    import fcntl
    import pty
    import struct
    import termios

    reader, writer = pty.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=writer)
    os.close(writer)
    chunks = []
    while True:
        try:
            chunk = os.read(reader, 65536)
        except OSError:  # the terminal's other end closed: the process is gone
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(reader)
    return process.wait(timeout=600), b"".join(chunks).decode(errors="replace")


def test_convert_into_a_pipe_writes_plain_lines(tiny_gguf, tmp_path):
    code, err = _cli(["convert", tiny_gguf, tmp_path / "out", "--calib", "none"], tmp_path, terminal=False)
    assert code == 0 and (tmp_path / "out" / "config.json").is_file(), err
    assert "\r" not in err and not [bar for bar in BARS if bar in err], err
    assert err.startswith("dequantising tiny.gguf"), err


@pytest.mark.skipif(sys.platform != "linux", reason="opens a pseudo-terminal")
def test_a_terminal_gets_bars_unless_no_progress(tiny_gguf, tmp_path):
    code, err = _cli(["convert", tiny_gguf, tmp_path / "a", "--calib", "none"], tmp_path / "1", terminal=True)
    assert code == 0 and "\r" in err and all(bar in err for bar in BARS), err
    code, err = _cli(["convert", tiny_gguf, tmp_path / "b", "--calib", "none", "--no-progress"], tmp_path / "2",
                     terminal=True)
    assert code == 0 and (tmp_path / "b" / "config.json").is_file(), err
    assert not [bar for bar in BARS if bar in err], err


def test_library_bars_are_hidden_while_a_command_runs_and_restored_after(llama_source, capsys, monkeypatch):
    """stderr under capsys is not a terminal: transformers and huggingface_hub draw nothing during the command."""
    import huggingface_hub.utils as hub
    import transformers.utils.logging as transformers_logging

    import mha2mla.inspection

    during = []
    inspect_model = mha2mla.inspection.inspect_model
    monkeypatch.setattr(mha2mla.inspection, "inspect_model", lambda model: during.append(
        (transformers_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled())) or inspect_model(model))
    assert transformers_logging.is_progress_bar_enabled() and not hub.are_progress_bars_disabled()
    code, _, err = run_cli(["inspect", llama_source], capsys)
    assert code == 0 and during == [(False, True)], err
    assert transformers_logging.is_progress_bar_enabled() and not hub.are_progress_bars_disabled()


def test_inspect_reads_a_gguf_without_dequantising_it(tiny_gguf, tmp_path, private_cache, capsys):
    before = snapshot(tmp_path)
    code, stdout, err = run_cli(["inspect", tiny_gguf, "--json"], capsys)
    assert code == 0 and err == "" and snapshot(tmp_path) == before, err  # no cache folder, nothing dequantised
    from_metadata = json.loads(stdout)
    assert from_metadata["family"] == "llama" and from_metadata["kv_heads"] == 2

    from mha2mla.io.model_folder import read_config
    from mha2mla.io.source import gguf_config, gguf_to_folder

    metadata = gguf_config(tiny_gguf)
    written = read_config(gguf_to_folder(tiny_gguf))  # what a conversion dequantises; inspect reads it from now on
    assert {key: metadata.get(key) for key in written if key != "transformers_version"} == {
        key: value for key, value in written.items() if key != "transformers_version"}
    code, stdout, err = run_cli(["inspect", tiny_gguf, "--json"], capsys)
    assert code == 0 and json.loads(stdout) == from_metadata, err  # the KV bytes and budgets of the cached copy


def test_bfloat16_gguf_load_gives_no_dtype_warning(tiny_gguf):
    import torch

    from mha2mla.io.source import load_gguf_model

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    quantizer_log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    quantizer_log.addHandler(handler)
    try:
        model, _ = load_gguf_model(tiny_gguf, torch.bfloat16)
    finally:
        quantizer_log.removeHandler(handler)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert [record.getMessage() for record in records] == []


def test_eval_computes_a_gguf_in_the_dtype_its_conversion_writes(tiny_gguf):
    import torch

    from mha2mla.evaluation.loading import load_model

    assert next(load_model(tiny_gguf, "auto", "cpu").model.parameters()).dtype == torch.bfloat16
    assert next(load_model(tiny_gguf, "float32", "cpu").model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("command, usage", [
    ("convert", "SOURCE [OUT]"), ("inspect", "MODEL"), ("eval", "[MODELS]..."), ("recover", "MODEL"),
    ("generate", "MODEL"), ("export-gguf", "MODEL OUT")])
def test_usage_lines_name_arguments_without_braces(command, usage, capsys):
    code, stdout, _ = run_cli([command, "--help"], capsys)
    assert code == 0 and stdout.splitlines()[0] == f"Usage: mha2mla {command} [OPTIONS] {usage}", stdout


HEAVY = ("torch", "transformers", "accelerate", "peft", "lm_eval", "triton")


def test_help_and_argument_errors_load_no_heavy_library():
    script = (
        "import sys\n"
        "from mha2mla.cli.main import main\n"
        "for args in (['--help'], ['convert', '--help'], ['eval', '--help'], ['recover', '--help'], ['inspect'],\n"
        "             ['convert', '--kv-budget', 'x', 'a', 'b'], ['generate', '--help'], ['export-gguf', '--help']):\n"
        "    sys.argv = ['mha2mla', *args]\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stderr.splitlines()[-1] == "[]", done.stderr
    assert "Usage: mha2mla convert [OPTIONS] SOURCE [OUT]" in done.stdout


class _FullDiskModel:
    """What load_gguf_model returns, whose save writes part of a file and then finds the disk full."""

    def save_pretrained(self, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 64)
        raise OSError(28, "No space left on device")


def test_a_full_disk_while_convert_dequantises_a_gguf(tmp_path, private_cache, capsys, monkeypatch):
    """inspect no longer fills the GGUF cache; convert does, and a full disk there is one sentence, nothing left."""
    import mha2mla.io.source

    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(mha2mla.io.source, "load_gguf_model", lambda path, dtype=None: (_FullDiskModel(), None))
    before = snapshot(tmp_path)
    code, _, err = run_cli(["convert", tmp_path / "model.gguf", tmp_path / "out", "--calib", "none"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: ") and "No space left on device" in lines[0], err
    assert snapshot(tmp_path) == before
