"""The README.md model card written into every output folder, the one card writer: a conversion's (source, method,
budget, the command) and a recovery's (the input's card with a section on the run appended).

The YAML header carries ``base_model`` and ``license`` when the source tells them (a hub id, a hub cache folder, a
model card's own header, a GGUF file's metadata); the title and the source line name the model, never a local path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from huggingface_hub import try_to_load_from_cache

from mha2mla.io.cache import DEFAULT_MODEL_FILE, DEFAULT_MODEL_REPO
from mha2mla.io.model_folder import CARD_FILE, ConversionReport

HUB_URL = re.compile(r"^https?://(?:huggingface\.co|hf\.co)/(?P<repo>[\w.-]+/[\w.-]+)")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
GGUF_QUANT = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
GGUF_CACHE_KEY = re.compile(r"-[0-9a-f]{12}$")  # the dequantised copy's cache folder (mha2mla/io/source.py)


def _front_matter(card: Path | None) -> dict:
    """The YAML header of a model card (empty when there is none or it does not parse)."""
    if card is None or not Path(card).is_file():
        return {}
    text = Path(card).read_text(encoding="utf-8", errors="replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.DOTALL)
    try:
        data = yaml.safe_load(match.group(1)) if match else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _gguf_metadata(path: Path) -> dict:
    from gguf import GGUFReader  # the gguf extra: only a GGUF source has this metadata

    try:
        fields = GGUFReader(str(path)).fields
    except (OSError, ValueError):  # not readable as GGUF here: the card just lacks the metadata
        return {}
    values = {}
    for key in ("general.license", "general.base_model.0.repo_url", "general.source.repo_url", "general.source.url"):
        if key in fields:
            values[key] = str(fields[key].contents())
    repo = next((HUB_URL.match(values[key])["repo"] for key in list(values)[1:] if HUB_URL.match(values[key])), None)
    if repo is None and path.name == DEFAULT_MODEL_FILE:
        repo = DEFAULT_MODEL_REPO
    return {"license": values.get("general.license"), "base_model": repo}


def _folder_metadata(folder: Path) -> dict:
    header = _front_matter(folder / CARD_FILE)
    hub = re.search(r"models--([\w.-]+)--([\w.-]+)/snapshots/", str(folder.resolve()) + "/")
    return {"license": header.get("license"), "base_model": f"{hub[1]}/{hub[2]}" if hub else None}


def source_metadata(source: str) -> dict:
    """``name`` (for the title), ``base_model`` (a hub id) and ``license`` of a SOURCE as given to convert."""
    path = Path(source).expanduser()
    if path.is_file():
        name = GGUF_QUANT.sub("", path.stem)
        return {"name": name, "file": path.name, **_gguf_metadata(path)}
    if path.is_dir():
        name = path.resolve().name
        if path.resolve().parent.name == "gguf":
            name = GGUF_QUANT.sub("", GGUF_CACHE_KEY.sub("", name))
        return {"name": name, "file": name, **_folder_metadata(path)}
    if HUB_ID.match(str(source)):
        cached = try_to_load_from_cache(str(source), CARD_FILE)
        license_ = _front_matter(Path(cached) if isinstance(cached, str) else None).get("license")
        return {"name": str(source).split("/")[1], "file": str(source), "base_model": str(source), "license": license_}
    return {"name": Path(str(source)).name or "model", "file": str(source), "base_model": None, "license": None}


def _header(meta: dict) -> list[str]:
    lines = ["---", "library_name: transformers"]
    if meta.get("base_model"):
        lines.append(f"base_model: {meta['base_model']}")
    if meta.get("license"):
        lines.append(f"license: {meta['license']}")
    return lines + ["tags: [mha2mla, mla, deepseek_v3]", "---"]


def _source_line(meta: dict) -> str:
    described = f"`{meta['file']}`"
    if meta.get("base_model") and meta["base_model"] != meta["file"]:
        described += f" ([{meta['base_model']}](https://huggingface.co/{meta['base_model']}))"
    return described


def write_model_card(folder: str | Path, report: ConversionReport, extra_sections: list[str] | None = None) -> None:
    plan = report.plan
    shape = plan["shape"]
    kv = report.kv_bytes_per_token
    mean_k, mean_v = report.mean_errors()
    portable = plan["profile"] == "portable"
    meta = source_metadata(report.source or "model")
    lines = [
        *_header(meta),
        f"# {meta['name']} → Multi-head Latent Attention",
        "",
        f"Converted by mha2mla {report.mha2mla_version} from {_source_line(meta)} into a native "
        f"DeepSeek-V3 checkpoint. Source: {plan['family']}, {shape['num_layers']} layers, {shape['num_heads']} query "
        f"heads, {shape['num_kv_heads']} KV heads, head dim {shape['head_dim']}.",
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        'model = AutoModelForCausalLM.from_pretrained("<this folder>")  # no trust_remote_code',
        "```",
        "",
        ("Profile **portable**: no attention biases, silu MLP, plain interleaved rope — loads in transformers, "
         "vLLM and SGLang." if portable else
         "Profile **exact**: transformers only (attention biases, neutralised kv_a_layernorm); training-free "
         "conversions at full capacity reproduce the source's logits."),
        "",
        "## Method",
        "",
        f"- Method: {plan['method']}.",
        f"- RoPE: {plan['rope_dim']} rope dims on one shared rope key (the fastest source pairs "
        f"{plan['rope_pairs']}), per-frequency KV-head mixing; rope theta {plan['target_rope_theta']:g}.",
        f"- Latent: kv_lora_rank {plan['kv_lora_rank']} (latent rank {plan['latent_rank']}), joint low rank of [K_nope; V].",
        f"- Mean relative reconstruction error: K {mean_k:.4f}, V {mean_v:.4f} (per layer in conversion_report.json).",
        f"- KV cache per token ({plan['dtype']}, all layers): {kv['source']:,.0f} B → {kv['converted']:,.0f} B "
        f"({100 * kv['ratio']:.2f}% of the source).",
    ]
    if report.dropped_biases:
        lines.append(f"- Source biases not carried (portable profile): {', '.join(report.dropped_biases)}.")
    lines += ["", "## Command", "", "```", report.command, "```", ""]
    for section in extra_sections or []:
        lines += [section, ""]
    (Path(folder) / "README.md").write_text("\n".join(lines))


def write_recovery_card(folder: Path, source_folder: Path, settings: dict, report: dict) -> None:
    """``folder``'s card: the input's model card (if any) with a section on this recovery run appended."""
    source_card = Path(source_folder) / CARD_FILE
    default_card = "---\nlibrary_name: transformers\ntags: [mha2mla, mla, deepseek_v3]\n---\n\n# MLA model recovered with mha2mla\n\n"
    card = source_card.read_text(encoding="utf-8").rstrip() + "\n\n" if source_card.is_file() else default_card
    evaluations = report.get("evaluations") or []
    lines = [
        "## Recovery fine-tuning (`mha2mla recover`)",
        "",
        (
            f"Recovered from `{settings['model']}` on {report['tokens_trained']:,} training tokens "
            f"({report['steps']} optimizer steps, {report['seconds']:.0f} s, {report['tokens_per_second']:.0f} tokens/s)."
        ),
        "",
        "| held-out perplexity | value |",
        "|---|---|",
    ]
    if evaluations:
        lines.append(f"| before recovery (step {evaluations[0]['step']}) | {evaluations[0]['perplexity']:.3f} |")
        lines.append(f"| after recovery (step {evaluations[-1]['step']}) | {evaluations[-1]['perplexity']:.3f} |")
    lines += ["", "Settings:", "", "```json", json.dumps(settings, indent=2), "```", ""]
    (Path(folder) / "README.md").write_text(card + "\n".join(lines), encoding="utf-8")
