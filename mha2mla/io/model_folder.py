"""The model folder's contract, in one place: what a model argument is (a folder, a .gguf file or a hub id), its
config.json, the safetensors files it holds and whether they read back, whether it holds a causal LM, the file names
mha2mla writes into it, and the conversion report (``ConversionReport``), written and read only here.

Every command goes through here before it loads a model, so a damaged folder gets the same sentence from
``convert``, ``eval``, ``recover``, ``generate`` and ``export-gguf``. Light on purpose (no torch): the CLI calls it
before the heavy libraries load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mha2mla import UserError

# what an existing path that is neither a file nor a folder is, in every sentence that names one
NOT_REGULAR = "not a regular file or folder (a device, a pipe or a socket)"
CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ABSORBED_FILE = "absorbed.safetensors"  # the absorbed inference weights beside a converted checkpoint
ABSORBED_INDEX = "absorbed.json"  # what the absorbed weights were computed from (mha2mla/modeling/absorbed.py)
CONVERSION_REPORT = "conversion_report.json"  # written by `convert`; marks a converted folder
RECOVERY_REPORT = "recovery_report.json"  # written by `recover`'s export
RECOVER_CONFIG = "recover_config.json"  # the settings of a recover run folder
CARD_FILE = "README.md"
MANIFEST = ".mha2mla_files"  # the names mha2mla wrote into an output folder (mha2mla/io/written.py)
TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# the tokenizer's files, copied from the source folder into a converted one
TOKENIZER_FILES = (
    TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", SENTENCEPIECE_MODEL, "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
GGUF_SUFFIX = ".gguf"

# safetensors caps its JSON header at 100 MB; a larger length field is garbage, not a header
_MAX_HEADER = 100 * 1024 * 1024


def looks_like_hub_id(text: str) -> bool:
    """``owner/name``: the only shape a hub id has here (a path with one slash that exists is a path first)."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~"))


def is_gguf_name(path: str | Path) -> bool:
    """True when ``path`` is named like a GGUF model file (``.gguf``, any case)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def source_kind(spec: str | Path) -> str:
    """``"folder"``, ``"gguf"`` or ``"hub"`` for a model argument; one sentence for anything else."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        if not is_gguf_name(path):
            raise UserError(f"{path} is a file but not a {GGUF_SUFFIX}; pass a model folder, a .gguf file or a hub id.")
        return "gguf"
    if path.exists():  # a device, a pipe or a socket
        raise UserError(f"{path} is {NOT_REGULAR}; pass a model folder, a .gguf file or a hub id.")
    if looks_like_hub_id(str(spec)):
        return "hub"
    raise UserError(f"{spec} does not exist; pass a model folder, a .gguf file or a hub id.")


def read_config(folder: str | Path, *, hint: str = "point at a Hugging Face model folder") -> dict:
    """The folder's config.json as a dict; one sentence when it is missing, not UTF-8, not JSON or not an object."""
    path = Path(folder).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{Path(folder)} has no {CONFIG_FILE}; {hint}.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; re-download the model or fix the file.") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}); re-download the model or "
                        "fix the file.") from None
    except OSError as error:
        raise UserError(f"cannot read {path} ({error.strerror}).") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not an object of settings; re-download the model.")
    return config


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"{path} is damaged ({why}); re-download or re-convert the model.")


def check_safetensors_file(path: str | Path) -> None:
    """A safetensors file whose header parses and whose tensors all lie inside the file; one sentence otherwise.
    Reads the header only (pure Python), so a truncated or garbage file is caught before any loader sees it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _damaged(path, "shorter than a safetensors header")
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(_MAX_HEADER, size - 8):
                raise _damaged(path, "its header length is larger than the file")
            header = json.loads(handle.read(header_len))
    except OSError as error:
        raise UserError(f"cannot read {path} ({error.strerror}).") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _damaged(path, "its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    try:
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError):
        raise _damaged(path, "its header does not describe tensors") from None
    if size < 8 + header_len + end:
        raise _damaged(path, f"truncated: {size:,} bytes of {8 + header_len + end:,}")


def read_index(index: Path) -> dict[str, str]:
    """A safetensors index's weight map (tensor name -> shard file); every shard must be a file directly inside the
    index's folder (``../other/model.safetensors``, absolute paths and subfolders are refused)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise UserError(f"{index} is not a valid safetensors index ({error}); re-download the model.") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise UserError(f"{index} has no weight_map of tensor names to shard files; re-download the model.")
    outside = sorted({f for f in weight_map.values() if Path(f).name != f or f in ("", ".", "..")})
    if outside:
        raise UserError(f"{index} names shard {outside[0]!r} outside {index.parent}; shards must be files in the "
                        "checkpoint folder itself.")
    return weight_map


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files a folder's weights live in (its index's shards, or model.safetensors), plus the
    absorbed inference weights when present. Missing shards named by the index are one sentence."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        files = [folder / name for name in sorted(set(read_index(index).values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise UserError(f"{folder} is missing shard {missing[0]} named in {INDEX_FILE}; re-download the model.")
    else:
        files = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else []
    if (folder / ABSORBED_FILE).is_file():
        files.append(folder / ABSORBED_FILE)
    return files


def check_weights(folder: str | Path) -> None:
    """Every weight file of ``folder`` reads back (headers parse, no truncation): the one check every command makes
    before it loads a model folder."""
    for path in weight_files(folder):
        check_safetensors_file(path)


def check_model_folder(folder: str | Path, *, hint: str = "point at a Hugging Face model folder") -> dict:
    """config.json read and every weight file checked; returns the config."""
    config = read_config(folder, hint=hint)
    check_weights(folder)
    return config


def check_causal_lm_folder(folder: str | Path) -> dict:
    """config.json of a model folder (every weight file checked to read back) that holds a causal LM; one sentence
    for a folder of another kind of model (a masked LM, a vision model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = check_model_folder(folder)
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = [str(architectures)]
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        not architectures or any(str(name).endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    )
    if not causal:
        what = f"a {model_type!r} model" if model_type else "a model without a model_type"
        arch = f" ({', '.join(map(str, architectures))})" if architectures else ""
        raise UserError(f"{folder} holds {what}{arch}, not a causal language model; pass a *ForCausalLM checkpoint.")
    return config


@dataclass
class ConversionReport:
    """conversion_report.json: what ``convert`` did, beside the checkpoint it wrote. The model card (io/card.py)
    renders it, ``eval`` carries it into its results and ``recover`` copies it into its output.

    ``layers`` holds one record per decoder layer: the steps' measurements (``k_rel_error`` and ``v_rel_error``,
    the relative K/V reconstruction errors every path reports; ranks, refit and reconstruction errors and the
    layer's seconds where those steps ran). ``plan`` is ``ConversionPlan.to_dict()``; ``kv_bytes_per_token``
    holds ``source``, ``converted`` and their ``ratio``."""

    layers: list[dict]
    family: str = ""
    profile: str = ""
    plan: dict = field(default_factory=dict)
    kv_bytes_per_token: dict = field(default_factory=dict)
    initialisation: str = ""
    methods: dict = field(default_factory=dict)
    dropped_biases: list[str] = field(default_factory=list)
    portable_check: str = ""
    source: str = ""
    command: str = ""
    mha2mla_version: str = ""
    options: dict = field(default_factory=dict)
    elapsed_seconds: float = 0.0
    peak_rss_gib: float = 0.0
    peak_gpu_gib: float | None = None  # calibrated on a GPU only
    # wall and CPU seconds per phase of the conversion, "other" for the rest (convert/phases.py)
    phase_seconds: dict = field(default_factory=dict)
    phase_cpu_seconds: dict = field(default_factory=dict)

    def mean_errors(self) -> tuple[float, float]:
        """The mean relative K and V reconstruction errors over the layers."""
        count = max(len(self.layers), 1)
        return (sum(layer["k_rel_error"] for layer in self.layers) / count,
                sum(layer["v_rel_error"] for layer in self.layers) / count)

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["peak_gpu_gib"] is None:
            del data["peak_gpu_gib"]
        return data

    @classmethod
    def from_dict(cls, data: object) -> ConversionReport | None:
        """The report a JSON object describes, or None when it has no list of per-layer records (not a conversion
        report). Keys this version does not know are left out."""
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            return None
        if not all(isinstance(layer, dict) for layer in data["layers"]):
            return None
        known = {item.name for item in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def write_conversion_report(folder: str | Path, report: ConversionReport) -> None:
    (Path(folder) / CONVERSION_REPORT).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")


def read_conversion_report(folder: str | Path) -> ConversionReport | None:
    """The conversion report beside a converted checkpoint, or None (absent, unreadable or not a conversion report:
    it is informative, never required)."""
    path = Path(folder) / CONVERSION_REPORT
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return ConversionReport.from_dict(data)


def holds_checkpoint(folder: str | Path) -> bool:
    """A folder holding a Hugging Face checkpoint: a config.json or safetensors weights."""
    folder = Path(folder)
    return (folder / CONFIG_FILE).is_file() or any(folder.glob("*.safetensors"))


def is_model_folder(folder: str | Path) -> bool:
    """A folder holding a model: a checkpoint or a .gguf file (where results or notes must not be written)."""
    return holds_checkpoint(folder) or any(Path(folder).glob(f"*{GGUF_SUFFIX}"))
