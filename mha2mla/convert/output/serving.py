"""What a converted model's card says about serving it (the card itself: io/card.py)."""

from __future__ import annotations

from mha2mla.convert.plan.engines import (
    ENGINES,
    VLLM_CPU,
    VLLM_CPU_BACKENDS,
    VLLM_CPU_COMPILATION_CONFIG,
    VLLM_CPU_ROTARY_REASON,
    VLLM_CPU_SERVER,
    vllm_cpu_problems,
)


def serving_sections(plan: dict) -> list[str]:
    """The model card's sections on serving the output of ``plan`` (its dict form) in its target engine."""
    return [vllm_card_section(plan)] if plan.get("target") == "vllm" else []


def vllm_card_section(plan: dict) -> str:
    """How to serve a `--target vllm` output: the GPU command, and on a CPU the rotary workaround and why."""
    cpu_flags = f" --compilation-config '{VLLM_CPU_COMPILATION_CONFIG}'"
    cpu_kwargs = f"compilation_config={VLLM_CPU_COMPILATION_CONFIG}"
    if plan["dtype"] not in VLLM_CPU_BACKENDS["AMX_MLA"].dtypes:  # AMX_MLA, vLLM's choice on AMX CPUs, is bf16 only
        cpu_flags += " --attention-backend CPU_MLA"
        cpu_kwargs += ', attention_config={"backend": "CPU_MLA"}'
    lines = [
        "## Serve with vLLM", "",
        "```bash",
        f"vllm serve <this folder>   # GPU: vLLM {ENGINES['vllm'].version}'s rules, read from its source, not run",
        f"{VLLM_CPU_SERVER} <this folder> --enforce-eager{cpu_flags}   # CPU: {VLLM_CPU}, run",
        "```", "",
        "```python",
        "from vllm import LLM",
        f'llm = LLM("<this folder>", enforce_eager=True, {cpu_kwargs})  # CPU',
        "```", "",
        f"On a CPU the flag is required: {VLLM_CPU_ROTARY_REASON}. With it vLLM's PyTorch rope runs and vLLM's "
        "output equals transformers' (float32). vLLM's GPU path is believed unaffected (its CUDA rotary op reads the "
        "views' strides), but that was read, not run. "
        f"`vllm serve` itself does not start with {VLLM_CPU} (it looks up a distribution named vllm, this one is "
        "vllm-cpu); the module above is the same server.",
    ]
    problems = vllm_cpu_problems(plan["kv_lora_rank"], plan["rope_dim"], plan["dtype"])
    return "\n".join(lines + [line for p in problems for line in ("", f"Note: {p}.")])
