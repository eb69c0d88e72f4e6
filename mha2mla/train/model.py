"""Loading the student (a converted MLA model) and the teacher (its source), and choosing what trains."""

from __future__ import annotations

import importlib
import logging
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from mha2mla import UserError
from mha2mla.io.model_folder import check_model_folder
from mha2mla.io.source import load_gguf_model
from mha2mla.modeling.sdpa import mla_attention_for
from mha2mla.train.config import TRAINABLE_NORMS, LoraSettings

log = logging.getLogger(__name__)

TRITON_ATTENTION = "mha2mla_triton"


def resolve_attn_implementation(name: str, device_type: str = "cpu", compute_dtype: str = "float32",
                                model_config: dict | None = None) -> str:
    """``sdpa`` / ``eager`` as they are; ``mha2mla_triton`` once the kernels package registers it with
    transformers' ``AttentionInterface`` (importing ``mha2mla.kernels`` is expected to do so); ``auto``: the kernel
    where a GPU measurement shows it at least as fast as SDPA here, else ``sdpa`` (mha2mla/kernels/speed_table.py)."""
    if name == "auto":
        from mha2mla.kernels.speed_table import training_attention

        name = training_attention(device_type, compute_dtype, model_config or {})
    if name != TRITON_ATTENTION:
        return name
    try:
        importlib.import_module("mha2mla.kernels")
    except ImportError:
        pass
    if name not in AttentionInterface._global_mapping:
        raise UserError(
            f"attention implementation {name!r} is not available (the Triton MLA kernel is not registered); "
            "use --attn-implementation sdpa."
        )
    return name


def read_model_config(folder: str | Path) -> dict:
    """config.json of a model folder, every weight file checked to read back (mha2mla/io/model_folder.py)."""
    return check_model_folder(folder, hint="give the output folder of `mha2mla convert`")


def load_student(folder: str | Path, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                 device_type: str = "cpu", compute_dtype: str = "float32"):
    """The converted DeepSeek-V3 MLA model, in ``dtype`` (fp32 master weights for training); ``sdpa`` runs as
    ``mha2mla_sdpa`` (mha2mla/modeling/sdpa.py) so that the fused kernels serve MLA's unequal head dims."""
    config = read_model_config(folder)
    if config.get("model_type") != "deepseek_v3":
        raise UserError(
            f"{folder} is a {config.get('model_type')!r} model, not a converted DeepSeek-V3 MLA model; "
            "run `mha2mla convert` first."
        )
    implementation = mla_attention_for(config, resolve_attn_implementation(attn_implementation, device_type,
                                                                           compute_dtype, config))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation=implementation)
    model.config.use_cache = False
    return model


def load_tokenizer(folder: str | Path):
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load a tokenizer from {folder} ({str(error).splitlines()[0][:160]}).") from None


def check_teacher_path(source: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"teacher {source} does not exist; give the source model folder or its .gguf file.")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise UserError(f"teacher {source} is a file but not a .gguf; give a model folder or a .gguf file.")
    if path.is_dir():
        read_model_config(path)
    return path


def load_teacher(source: str, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32):
    """The frozen source model: a Hugging Face folder or a ``.gguf`` file (dequantized on load)."""
    path = check_teacher_path(source)
    impl = "sdpa" if attn_implementation in (TRITON_ATTENTION, "auto") else attn_implementation  # an MHA/GQA source
    if path.is_file():  # a dequantized GGUF model is a plain float model (docs/recover.md)
        model, _ = load_gguf_model(path, dtype, attn_implementation=impl)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=impl)
    model.config.use_cache = False
    model.eval()
    model.requires_grad_(False)
    return model


def check_teacher_matches(student, teacher) -> None:
    """The teacher must share the vocabulary of ``student`` (a model, or its vocabulary size: its config's
    ``vocab_size``, read before the student is loaded)."""
    student_vocab = student if isinstance(student, int | None) else student.get_output_embeddings().weight.shape[0]
    if student_vocab is None:  # a config without vocab_size: nothing to compare
        return
    teacher_vocab = teacher.get_output_embeddings().weight.shape[0]
    if student_vocab != teacher_vocab:
        raise UserError(
            f"the teacher's vocabulary ({teacher_vocab}) differs from the model's ({student_vocab}); "
            "distil from the model it was converted from."
        )


def _module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}


def make_trainable(model: nn.Module, lora: LoraSettings | None, layers: bool = False) -> nn.Module:
    """Wrap ``model`` in a peft LoRA model as ``lora`` says (adapters on its targets; with ``train_norms`` the
    model's kv_a_layernorm trains in full), or with ``lora=None`` unfreeze every parameter under ``self_attn``
    and nothing else (full-attention training) or, with ``layers``, every parameter of the decoder layers
    (attention, MLP, norms) while the embeddings, final norm and lm_head stay frozen (full-layer training).
    Returns the model to train."""
    if lora is None:
        model.requires_grad_(False)
        scope = ".layers." if layers else ".self_attn."
        count = 0
        for name, param in model.named_parameters():
            if scope in name:
                param.requires_grad_(True)
                count += 1
        if count == 0:
            raise UserError(f"the model has no {'decoder-layer' if layers else 'self_attn'} parameters to train.")
        return model

    present = _module_names(model)
    missing = [target for target in lora.targets if target not in present]
    if missing:
        raise UserError(f"LoRA target(s) {', '.join(missing)} are not modules of this model; check --lora-targets.")
    norms = [name for name in TRAINABLE_NORMS if name in present] if lora.train_norms else []
    adapter = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        modules_to_save=norms or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model, a FutureWarning
        # on every run that is neither ours nor the user's to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, adapter)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter by name (what a checkpoint must restore)."""
    return {name: param.detach().cpu().clone() for name, param in model.named_parameters() if param.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    if set(params) != set(state):
        extra, missing = sorted(set(state) - set(params))[:3], sorted(set(params) - set(state))[:3]
        raise UserError(f"the checkpoint's trainable weights do not match this run (extra {extra}, missing {missing}).")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


def count_parameters(model: nn.Module) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
