"""The memory estimate of a recovery run (mha2mla/train/memory.py) against the memory a run really takes, measured
in a fresh process: its peak resident set after the libraries are loaded, minus its resident set then, allocator
slack pinned out (CHILD). Full layers without, with selective and with full activation checkpointing, and LoRA;
float32, the test's whole run (setup, steps, export). ``recover --dry-run`` and the refusal of a run that does not
fit: one sentence, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import SAMPLE_TEXT, tiny_deepseek_config, tiny_tokenizer

from mha2mla.train import RecoverConfig
from mha2mla.train.memory import GIB, estimate, meta_counts

REPO = Path(__file__).resolve().parents[2]

# The child: import everything a run imports, note the resident set, reset the peak (Linux: clear_refs 5), run,
# read the peak. The estimate leaves out allocator slack, so the child measures the live set: glibc's mmap threshold
# pinned at 64 KiB (CHILD_ENV) gives every tensor its own mapping, returned when freed, as a real-size run's tensors
# above 32 MiB are; and no transparent huge pages (prctl PR_SET_THP_DISABLE), which would round mappings up to 2 MiB
# where the kernel makes them the default. Without the pin, heap fragmentation of these small tensors varies with
# the CPU's kernels (docs/recover.md, "Memory").
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
CHILD = """
import ctypes, json, sys
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from pathlib import Path
import mha2mla.train.trainer, mha2mla.train.loop, mha2mla.train.model.merge, peft, accelerate, safetensors.torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from mha2mla.train import RecoverConfig, recover

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
config = RecoverConfig(**json.loads(sys.argv[1]))
AutoTokenizer.from_pretrained(config.model)  # the tokenizer library's own tables, not the run's
before = status("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")
recover(config, show_progress=False)
print(json.dumps({"before": before, "peak": status("VmHWM:")}))
"""

SHAPES = {
    "full layers": ({"hidden_size": 384, "num_heads": 6, "kv_lora_rank": 64, "num_layers": 4, "vocab_size": 16384,
                     "intermediate_size": 1024}, {"full_layers": True, "seq_len": 256, "batch_size": 8,
                                      "activation_checkpointing": "none"}),
    "full layers, activation checkpointing": (
        {"hidden_size": 384, "num_heads": 6, "kv_lora_rank": 64, "num_layers": 4, "vocab_size": 16384,
         "intermediate_size": 1024}, {"full_layers": True, "seq_len": 256, "batch_size": 8, "activation_checkpointing": "full"}),
    "full layers, selective checkpointing": (
        {"hidden_size": 384, "num_heads": 6, "kv_lora_rank": 64, "num_layers": 4, "vocab_size": 16384,
         "intermediate_size": 1024}, {"full_layers": True, "seq_len": 256, "batch_size": 8,
                                      "activation_checkpointing": "selective"}),
    "lora": ({"hidden_size": 512, "num_heads": 8, "kv_lora_rank": 96, "num_layers": 6, "vocab_size": 32768,
              "intermediate_size": 1536}, {"lora": {"rank": 16}, "seq_len": 256, "batch_size": 4,
                                                      "activation_checkpointing": "none"}),
}


def _model(folder: Path, shape: dict) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_deepseek_config(**{**shape, "max_position_embeddings": 1024})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _settings(model: Path, out: Path, text: Path, run: dict) -> dict:
    return {"model": str(model), "data": [str(text)], "out": str(out), "max_steps": 2, "eval_sequences": 2,
            "save_every": 1, "compute_dtype": "float32", **run}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the resident set through Linux /proc")
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_estimate_is_within_20_percent_of_the_measured_peak(name, tmp_path):
    shape, run = SHAPES[name]
    model = _model(tmp_path / "model", shape)
    (tmp_path / "text").mkdir()
    for document in ("a.txt", "b.txt"):  # the held-out rows are the first document's (whole documents are held out)
        (tmp_path / "text" / document).write_text(SAMPLE_TEXT * 40)
    settings = _settings(model, tmp_path / "out", tmp_path / "text", run)
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(REPO / "tests")}
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(settings)], env=env, capture_output=True,
                            text=True, check=False, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    used = measured["peak"] - measured["before"]
    config = RecoverConfig(**settings)
    estimated = estimate(config, meta_counts(config), config.total_steps()).total
    print(f"{name}: estimated {estimated / GIB:.3f} GiB, measured {used / GIB:.3f} GiB")  # shown with -s
    assert used > 100 * 2**20, used  # a shape whose run, not the process, is what is measured
    assert abs(estimated - used) <= 0.2 * used, f"estimated {estimated / GIB:.3f} GiB, measured {used / GIB:.3f} GiB"


def _run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    from mha2mla.cli.main import main

    monkeypatch.setattr(sys, "argv", ["mha2mla", "recover", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_dry_run_states_the_estimate_and_writes_nothing(tiny_mla, tmp_path, monkeypatch, capsys):
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    out = tmp_path / "out"
    args = [str(tiny_mla), "--data", str(tmp_path / "text.txt"), "--out", str(out), "--max-steps", "2", "--dry-run"]
    code, stdout, err = _run_main(monkeypatch, capsys, args)
    assert code == 0, err
    names = [line.split()[0] for line in stdout.splitlines()[1:-2]]
    assert names == ["weights", "gradients", "optimizer", "teacher", "activations", "backward", "logit_chunks", "logits",
                     "data", "total"]
    # LoRA with memory to spare: auto keeps every activation
    assert stdout.splitlines()[-2].startswith("activation checkpointing: none (auto:")
    assert stdout.splitlines()[-1].startswith("fits:") and not out.exists()


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_run_that_does_not_fit_is_refused_in_one_sentence(tiny_mla, tmp_path, monkeypatch, capsys, stderr_logging,
                                                           dry_run):
    import mha2mla.train.memory

    monkeypatch.setattr(mha2mla.train.memory, "free_memory", lambda device: 2**20)  # 1 MiB free
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    out = tmp_path / "out"
    args = [str(tiny_mla), "--data", str(tmp_path / "text.txt"), "--out", str(out), "--max-steps", "2",
            "--no-progress", *(["--dry-run"] if dry_run else [])]
    code, _, err = _run_main(monkeypatch, capsys, args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: this run needs about ")
    assert "only 0.0 GiB is free" in lines[0] and "Traceback" not in err
    assert not out.exists()
