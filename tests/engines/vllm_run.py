"""Serve one converted checkpoint with vLLM's offline ``LLM`` and write what it computed as JSON.

Runs inside the vLLM venv (`make vllm-venv`), never the project's: tests/engines/test_engines_vllm.py starts it as
``.venv-vllm/bin/python tests/engines/vllm_run.py REQUEST.json RESULT.json``. It imports nothing from mha2mla.

REQUEST keys: model, dtype, backend (an attention backend name or null for vLLM's choice), rotary_custom_op
(false turns vLLM's compiled rotary op off, so its PyTorch rope runs), prompt (token ids), greedy_tokens, logprobs
(top-k reported per position), max_model_len. The KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB).

RESULT keys: backend (the attention backend vLLM built), prompt_logprobs (per prompt position after the first,
{token id: logprob} holding the prompt token and the top-k), greedy (token ids) and greedy_logprobs (the same
per generated token), kv (the KV cache spec vLLM derived per layer, and bytes per token summed over layers),
weight_files (the files vLLM's loader read weights from), versions.

``vllm_run.py --rope-check RESULT.json`` instead applies vLLM's compiled CPU rotary op the way
``model_executor/layers/mla.py`` calls it (strided 3-D views of q and of the latent projection) and the way it
expects (contiguous 2-D copies), and writes each one's max |difference| from vLLM's PyTorch rope.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The engine core runs in this process (not a child), so the executor's KV cache spec and the loader's file list
# can be read back below.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _logprob_dicts(entries) -> list[dict[str, float]]:
    return [{str(token): float(lp.logprob) for token, lp in entry.items()} for entry in entries if entry is not None]


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import default_loader

    # Record which files the loader takes weights from (vLLM globs *.safetensors unless an index names them).
    weight_files: list[str] = []
    prepare = default_loader.DefaultModelLoader._prepare_weights

    def recording_prepare(self, *args, **kwargs):
        result = prepare(self, *args, **kwargs)
        weight_files.extend(Path(f).name for f in result[1])
        return result

    default_loader.DefaultModelLoader._prepare_weights = recording_prepare

    kwargs = dict(
        model=request["model"], dtype=request["dtype"], enforce_eager=True, max_model_len=request["max_model_len"],
        max_num_seqs=1, seed=0,
    )
    if request.get("backend"):
        kwargs["attention_config"] = {"backend": request["backend"]}
    if not request["rotary_custom_op"]:
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    llm = LLM(**kwargs)

    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    specs = core.model_executor.get_kv_cache_specs()[0]
    layers = {name: {"type": type(spec).__name__, "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes,
                     "head_size": getattr(spec, "head_size", None), "num_kv_heads": getattr(spec, "num_kv_heads", None),
                     "dtype": str(getattr(spec, "dtype", ""))}
              for name, spec in specs.items()}
    bytes_per_token = sum(spec.page_size_bytes / spec.block_size for spec in specs.values())
    impl = next(iter(core.model_executor.driver_worker.worker.model_runner.attn_groups[0])).backend.get_name() \
        if hasattr(core.model_executor, "driver_worker") else None

    prompt = {"prompt_token_ids": request["prompt"]}
    scored = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=request["logprobs"], detokenize=False))
    greedy = llm.generate(prompt, SamplingParams(max_tokens=request["greedy_tokens"], temperature=0.0,
                                                 logprobs=request["logprobs"], detokenize=False, ignore_eos=True))
    completion = greedy[0].outputs[0]
    result = {
        "backend": impl,
        "prompt_logprobs": _logprob_dicts(scored[0].prompt_logprobs),
        "greedy": list(completion.token_ids),
        "greedy_logprobs": _logprob_dicts(completion.logprobs),
        "kv": {"layers": layers, "bytes_per_token": bytes_per_token},
        "weight_files": sorted(set(weight_files)),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    Path(result_path).write_text(json.dumps(result))


def rope_check(result_path: str) -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    tokens, heads, nope, rope, rank = 5, 8, 128, 64, 512
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, nope + rope, generator=generator)
    latent = torch.randn(tokens, rank + rope, generator=generator)
    positions = torch.arange(tokens)
    with set_current_vllm_config(VllmConfig()):
        # DeepSeek-V3's rope in vLLM: interleaved pairs (is_neox_style=False, model_executor/models/deepseek_v2.py)
        rotary = get_rope(rope, max_position=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          is_neox_style=False, dtype=torch.float32)
        want_q, want_k = rotary.forward_native(positions, q[..., nope:].clone(), latent[:, rank:].unsqueeze(1).clone())
        # as mla.py passes them: views into q (stride nope + rope per head) and into the latent projection
        q_view, latent_view = q.clone(), latent.clone()
        got_q, got_k = rotary.forward_cpu(positions, q_view[..., nope:], latent_view[:, rank:].unsqueeze(1))
        strided = max((q_view[..., nope:] - want_q).abs().max().item(), (latent_view[:, rank:] - want_k[:, 0]).abs().max().item())
        # contiguous [tokens, heads * rope] and [tokens, rope] copies
        q_flat, k_flat = q[..., nope:].reshape(tokens, heads * rope).clone(), latent[:, rank:].clone()
        rotary.forward_cpu(positions, q_flat, k_flat)
        contiguous = max((q_flat.view(tokens, heads, rope) - want_q).abs().max().item(),
                         (k_flat - want_k[:, 0]).abs().max().item())
    Path(result_path).write_text(json.dumps({"strided": strided, "contiguous": contiguous}))


if __name__ == "__main__":
    if sys.argv[1] == "--rope-check":
        rope_check(sys.argv[2])
    else:
        main(*sys.argv[1:3])
