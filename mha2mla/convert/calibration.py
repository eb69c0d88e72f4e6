"""Calibration statistics for activation-aware initialisation (DESIGN §3, docs/calibration.md).

``calibration_statistics(ckpt, family, plan, options)`` returns a provider that the pipeline calls once
per layer, in order: ``provider(i)`` gives the statistics of layer i's attention input x (the input
RMSNorm's output) on the calibration tokens, and ``provider.advance(i, tensors)`` pushes the hidden
states through layer i — through the *converted* attention (``calib_sequential``, the default: layer
i+1 is then calibrated on what the converted model really feeds it, as TransMLA does), or through the
source attention. In between, ``provider.refit_attention(i, tensors)`` refits the converted layer's
value rows and o_proj on what it computes (``--refit``, docs/calibration.md); sequentially, its targets
come from a second stream of the source model's own hidden states.

Only one layer's hidden states are held at a time: ``(N, L, D)`` for N sequences of L tokens, on the
chosen device. Each layer's weights are read from the lazy checkpoint when it is reached.

Calibration text: a .txt / .jsonl / .parquet file, a folder of those, a Hugging Face dataset id (when
online), or ``default`` — the bundled public-domain sample (``mha2mla/data/calibration_sample.txt``:
The Devil's Dictionary, part of the Jargon File and seven CPython standard-library modules; see
calibration_sample_licence.txt). N windows of L tokens are taken evenly spaced through the text.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.convert.norm import expected_rms

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".json", ".parquet")
TEXT_FIELDS = ("text", "content", "document", "body")
# tokens kept per layer (on top of the moments) for statistics that need per-token values
INPUT_SAMPLE_TOKENS = 4096
# attention statistics are measured at every QUERY_STRIDE-th query and KEY_STRIDE-th key position
QUERY_STRIDE = 4
KEY_STRIDE = 4
KEY_DENSE = 16
# keys are weighted by (attention they receive) ** KEY_WEIGHT_POWER (measured: 0.5 beats 0 and 1)
KEY_WEIGHT_POWER = 0.5
# relative ridges (towards the current map) that the refit chooses from by cross-validation
REFIT_RIDGES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def bundled_sample_path() -> Path:
    return Path(str(resources.files("mha2mla.data").joinpath("calibration_sample.txt")))


def _records_text(records, where: str) -> list[str]:
    texts = []
    for record in records:
        if isinstance(record, str):
            texts.append(record)
            continue
        field = next((key for key in TEXT_FIELDS if isinstance(record.get(key), str)), None)
        if field is None:
            raise UserError(f"{where} has a record without a text field ({', '.join(TEXT_FIELDS)}); give plain text or add one.")
        texts.append(record[field])
    return texts


def _file_texts(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise UserError("reading .parquet calibration data needs pyarrow; `pip install pyarrow` or give .txt/.jsonl.") from error
        table = pq.read_table(path)
        column = next((name for name in TEXT_FIELDS if name in table.column_names), None)
        if column is None:
            raise UserError(f"{path} has no text column ({', '.join(TEXT_FIELDS)}).")
        return [text for text in table.column(column).to_pylist() if text]
    if suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        try:
            return _records_text([json.loads(line) for line in lines if line.strip()], str(path))
        except json.JSONDecodeError as error:
            raise UserError(f"{path} is not valid JSON lines ({error.msg} at line {error.lineno}).") from None
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        return _records_text(data if isinstance(data, list) else [data], str(path))
    return [path.read_text(encoding="utf-8", errors="replace")]


def load_calibration_texts(calib: str | None) -> list[str]:
    """The documents of a calibration source (see the module docstring)."""
    if calib in (None, "", "default"):
        return [bundled_sample_path().read_text(encoding="utf-8")]
    path = Path(calib).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"calibration folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files.")
        return [text for file in files for text in _file_texts(file)]
    if path.is_file():
        return _file_texts(path)
    if path.suffix.lower() in TEXT_SUFFIXES or str(calib).startswith((".", "/", "~")):
        raise UserError(f"calibration data {calib} does not exist; give a file, a folder, a dataset id or `default`.")
    return _hub_texts(str(calib))


def _hub_texts(dataset_id: str, max_documents: int = 2000) -> list[str]:
    try:
        from datasets import load_dataset

        name, _, config = dataset_id.partition(":")
        stream = load_dataset(name, config or None, split="train", streaming=True)
        records = []
        for record in stream:
            records.append(record)
            if len(records) >= max_documents:
                break
    except Exception as error:
        raise UserError(
            f"{dataset_id} is neither a local path nor a loadable dataset ({type(error).__name__}); "
            "check the name and the network, or pass a local .txt/.jsonl/.parquet file."
        ) from error
    return _records_text(records, dataset_id)


def calibration_token_ids(texts: list[str], tokenizer, num_samples: int, seq_len: int) -> torch.Tensor:
    """``(num_samples, seq_len)`` token ids: windows evenly spaced through the concatenated documents."""
    separator = tokenizer.eos_token or "\n\n"
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text + separator, add_special_tokens=False)["input_ids"])
        if len(ids) >= num_samples * seq_len * 4:  # enough for well-spread windows
            break
    if len(ids) < seq_len:
        raise UserError(f"the calibration text has {len(ids)} tokens, fewer than one sequence of {seq_len}; give more text.")
    if len(ids) < num_samples * seq_len:
        log.warning("calibration text has %d tokens: the %d sequences of %d tokens overlap.", len(ids), num_samples, seq_len)
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).round().long()
    tokens = torch.tensor(ids, dtype=torch.long)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])  # (N, L)


@dataclass
class _Modules:
    """Classes of the source family and of the target, taken from transformers (no weights)."""

    source_config: object
    target_config: object
    layer_class: type
    source_rotary: torch.nn.Module
    target_attention_class: type
    target_rotary: torch.nn.Module


def _modules(ckpt, plan) -> _Modules:
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    from mha2mla.convert.pipeline import deepseek_config

    config_dict = dict(ckpt.config)
    source_config = AutoConfig.for_model(config_dict.pop("model_type"), **{k: v for k, v in config_dict.items() if k != "transformers_version"})
    source_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(source_config)
    layer_class = type(skeleton.model.layers[0])
    rotary_class = type(skeleton.model.rotary_emb)
    target = deepseek_config(plan, ckpt.config)
    target_config = DeepseekV3Config(**{k: v for k, v in target.items() if k not in ("mha2mla", "architectures", "dtype")})
    target_config._attn_implementation = "sdpa"
    return _Modules(
        source_config=source_config, target_config=target_config, layer_class=layer_class,
        source_rotary=rotary_class(config=source_config), target_attention_class=deepseek.DeepseekV3Attention,
        target_rotary=deepseek.DeepseekV3RotaryEmbedding(config=target_config),
    )


class LayerwiseCalibration:
    """The statistics provider (see the module docstring). Call ``provider(i)`` then ``advance(i, tensors)``."""

    def __init__(self, ckpt, family, plan, tokens: torch.Tensor, sequential: bool = False, device: str | None = None,
                 batch_size: int = 8, progress: bool = True, source_stream: bool = False):
        self.ckpt, self.family, self.plan = ckpt, family, plan
        self.sequential = sequential
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.batch_size = batch_size
        self.modules = _modules(ckpt, plan)
        self.num_layers = plan.shape.num_layers
        embed = ckpt.get(family.weight("embed_tokens"))
        self.hidden = embed[tokens].to(self.device)  # (N, L, D): the current layer's input hidden states
        # with ``source_stream`` (sequential only) the refit's targets come from the source model's own
        # hidden states: a second set, pushed through the source layers only
        self.source_hidden = self.hidden.clone() if (sequential and source_stream) else None
        self.layer = 0  # the hidden states are the input of this layer
        N, L = tokens.shape
        positions = torch.arange(L, device=self.device)[None]  # (1, L)
        # an explicit causal mask: eager attention (run for its probabilities) applies no other
        self.causal_mask = torch.full((L, L), float("-inf"), device=self.device).triu(1)[None, None]
        probe = torch.zeros(1, L, 1, device=self.device)
        self.source_rope = self.modules.source_rotary.to(self.device)(probe, positions)
        self.target_rope = self.modules.target_rotary.to(self.device)(probe, positions)
        self._layer_cache: tuple[int, torch.nn.Module] | None = None
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.num_layers, desc=f"calibrating ({N}×{L} tokens)", unit="layer")

    # ---- one source layer, weights read lazily ------------------------------------------------
    def _source_layer(self, layer: int) -> torch.nn.Module:
        if self._layer_cache is not None and self._layer_cache[0] == layer:
            return self._layer_cache[1]
        module = self.modules.layer_class(self.modules.source_config, layer_idx=layer)
        prefix = f"model.layers.{layer}."
        state = {name: self.ckpt.get(prefix + name) for name in module.state_dict()}
        module.load_state_dict(state)
        module = module.to(self.device).eval()
        self._layer_cache = (layer, module)
        return module

    def _target_attention(self, layer: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        module = self.modules.target_attention_class(self.modules.target_config, layer_idx=layer)
        state = module.state_dict()
        missing = [name for name in tensors if name not in state]
        if missing:
            raise RuntimeError(f"internal error: converted tensors {missing} have no place in DeepseekV3Attention")
        state.update({name: tensor.float() for name, tensor in tensors.items()})
        module.load_state_dict(state)
        return module.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, layer: int):
        from mha2mla.convert.attention import LayerStatistics

        while self.layer < layer:  # a caller that does not advance: follow the source model
            self.advance(self.layer, None)
        if layer != self.layer:
            raise RuntimeError(f"calibration statistics asked for layer {layer} after layer {self.layer}; layers go in order")
        norm_weight = self.ckpt.get(self.family.weight("input_layernorm", layer)).to(self.device)
        eps = float(self.ckpt.config.get("rms_norm_eps", 1e-6))
        D = self.hidden.shape[-1]
        moment = torch.zeros(D, D, dtype=torch.float64, device=self.device)
        total = torch.zeros(D, dtype=torch.float64, device=self.device)
        count = 0
        flat = self.hidden.reshape(-1, D)  # (N*L, D)
        for start in range(0, flat.shape[0], 4096):
            x = rms_norm(flat[start : start + 4096], norm_weight, eps)  # (n, D) float32
            moment += (x.T @ x).double()  # a float32 product per chunk, accumulated in float64
            total += x.double().sum(0)
            count += x.shape[0]
        # per-token sample: evenly spaced tokens plus every sequence's first (attention-sink) token
        num_sequences, length = self.hidden.shape[:2]
        sample_every = max(1, flat.shape[0] // INPUT_SAMPLE_TOKENS)
        index = torch.cat([torch.arange(0, flat.shape[0], sample_every)[:INPUT_SAMPLE_TOKENS],
                           torch.arange(0, flat.shape[0], length)]).unique().to(flat.device)
        sample = rms_norm(flat[index], norm_weight, eps)
        value_covariances, key_covariances, histogram = self._attention_statistics(self._source_layer(layer))
        return LayerStatistics(
            input_covariance=(moment / count).cpu(), input_mean=(total / count).cpu(), num_tokens=count,
            input_sample=sample.cpu(), value_covariances=value_covariances.cpu(),
            key_covariances=key_covariances.cpu(), distance_histogram=histogram.cpu(),
            pair_frequencies=self.modules.source_rotary.inv_freq.double().cpu(),
        )

    @torch.no_grad()
    def _attention_statistics(self, source: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        """What the source attention does with this layer's tokens, per query head h:
        ``E[x̄ x̄ᵀ]`` for the attention-averaged inputs x̄_i = Σ_j p_hij x_j (what a value error is seen
        through), the key-side moment E_w[x xᵀ] with each token weighted by the attention it receives
        (Σ_i p_hij) ** KEY_WEIGHT_POWER, and the attention mass at each distance i - j. Queries are
        taken at every QUERY_STRIDE-th position; keys at the first KEY_DENSE, then every KEY_STRIDE-th."""
        N, L, D = self.hidden.shape
        attention = source.self_attn
        H = self.modules.source_config.num_attention_heads
        mask = self.causal_mask
        position = torch.arange(L, device=self.device)
        distance = (position[:, None] - position[None, :]).clamp_min(0).reshape(1, -1).expand(H, -1)
        # keys: every position of the first KEY_DENSE ones (they receive the most attention), then every
        # KEY_STRIDE-th, each standing for KEY_STRIDE positions
        keys = torch.cat([torch.arange(min(KEY_DENSE, L)), torch.arange(KEY_DENSE, L, KEY_STRIDE)]).to(self.device)
        key_share = torch.where(keys < KEY_DENSE, 1.0, float(KEY_STRIDE)).to(self.device)
        # per-head (H, D, D) moments in float32 (8 GB less than float64 per layer for Llama-3-8B); the
        # products are float32 anyway, and the sums are over at most a few hundred thousand positions
        covariances = torch.zeros(H, D, D, device=self.device)
        key_covariances = torch.zeros(H, D, D, device=self.device)
        key_weight = torch.zeros(H, dtype=torch.float64, device=self.device)
        histogram = torch.zeros(H, L, dtype=torch.float64, device=self.device)
        with eager_attention(attention.config):  # the probabilities themselves
            for start in range(0, N, self.batch_size):
                x = source.input_layernorm(self.hidden[start : start + self.batch_size])  # (b, L, D)
                probabilities = attention(x, position_embeddings=self.source_rope, attention_mask=mask)[1].float()
                averaged = probabilities[:, :, ::QUERY_STRIDE] @ x[:, None]  # (b, H, L/s, D)
                covariances += torch.einsum("bhnd,bhne->hde", averaged, averaged)
                weight = probabilities.sum(2)[:, :, keys].clamp_min(0) ** KEY_WEIGHT_POWER * key_share  # (b, H, k)
                weighted = weight.sqrt()[..., None] * x[:, None, keys]  # (b, H, k, D)
                key_covariances += torch.einsum("bhnd,bhne->hde", weighted, weighted)
                key_weight += weight.sum((0, 2)).double()
                histogram.scatter_add_(1, distance, probabilities.sum(0).reshape(H, -1).double())
        queries = N * len(range(0, L, QUERY_STRIDE))
        return (covariances / queries, key_covariances / key_weight.float()[:, None, None],
                histogram / histogram.sum(-1, keepdim=True))

    @torch.no_grad()
    def refit_attention(self, layer: int, tensors: dict[str, torch.Tensor], mode: str = "output") -> tuple[dict[str, torch.Tensor], dict]:
        """The converted layer's linear read-out refitted on what it really computes (``--refit``).

        The low-rank step fits each head's V on the *source* attention averages. The converted layer
        averages its latents c with its own probabilities p' (its keys are approximate) and, in the
        portable profile, after kv_a_layernorm. ``values``: every query head h gets the U_h (its
        kv_b_proj value rows) that best maps f_hi = Σ_j p'_hij c_j to the source head output
        t_hi = Σ_j p_hij v_j. ``output``: then o_proj (not cached, so free) is refitted the same way
        from the refitted heads to the source attention output W_o t. With the source stream the
        targets come from the *source* model's own hidden states, so the fit also takes up what earlier
        layers' conversions changed; f always comes from the (converted) stream being calibrated.

        Each map is a ridge regression towards the current one over the calibration tokens. Attention
        averages of one sequence are strongly correlated, so the ridge is chosen by two-fold
        cross-validation over the sequences (``ridge_refit``; no refit at all is one of the choices).
        A full-capacity conversion, where f spans t exactly, keeps its maps. Returns the new tensors
        and a report."""
        source = self._source_layer(layer)
        target = self._target_attention(layer, tensors)
        N, L, D = self.hidden.shape
        H = self.modules.source_config.num_attention_heads
        G = self.modules.source_config.num_key_value_heads
        d = target.v_head_dim
        r = target.kv_lora_rank
        mask = self.causal_mask
        f64 = torch.float64
        cross = torch.zeros(2, H, d, r, dtype=f64, device=self.device)  # per fold: E[t fᵀ]
        gram = torch.zeros(2, H, r, r, dtype=f64, device=self.device)  # E[f fᵀ]
        energy = torch.zeros(2, dtype=f64, device=self.device)  # E‖t‖² over heads
        o_cross = o_gram = o_energy = None
        if mode not in ("values", "output"):
            raise ValueError(f"unknown refit mode {mode!r}")
        if mode == "output":
            o_cross = torch.zeros(2, D, H * r, dtype=f64, device=self.device)
            o_gram = torch.zeros(2, H * r, H * r, dtype=f64, device=self.device)
            o_energy = torch.zeros(2, dtype=f64, device=self.device)
            o_weight_source = source.self_attn.o_proj.weight.float()
        with eager_attention(source.self_attn.config, target.config):
            for start in range(0, N, self.batch_size):
                x = source.input_layernorm(self.hidden[start : start + self.batch_size])  # (b, L, D)
                b = x.shape[0]
                xs = x if self.source_hidden is None else source.input_layernorm(self.source_hidden[start : start + b])
                p = source.self_attn(xs, position_embeddings=self.source_rope, attention_mask=mask)[1].float()
                v = source.self_attn.v_proj(xs).view(b, L, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
                t = p @ v  # (b, H, L, d): the source heads' outputs
                p_converted = target(x, position_embeddings=self.target_rope, attention_mask=mask)[1].float()
                latent = target.kv_a_layernorm(target.kv_a_proj_with_mqa(x)[..., :r])  # (b, L, r)
                f = p_converted @ latent[:, None]  # (b, H, L, r)
                if o_cross is not None:
                    y = t.transpose(1, 2).reshape(b, L, H * d) @ o_weight_source.T  # (b, L, D)
                    f_all = f.transpose(1, 2).reshape(b, L, H * r)
                for k in (0, 1):  # the two cross-validation folds: even and odd sequences
                    fold = slice((start + k) % 2, b, 2)
                    t_k, f_k = t[fold], f[fold]
                    cross[k] += torch.einsum("bhld,bhlr->hdr", t_k, f_k).double()
                    gram[k] += torch.einsum("bhlr,bhls->hrs", f_k, f_k).double()
                    energy[k] += t_k.pow(2).sum().double()
                    if o_cross is not None:
                        y_k, f_all_k = y[fold].reshape(-1, D), f_all[fold].reshape(-1, H * r)
                        o_cross[k] += (y_k.T @ f_all_k).double()
                        o_gram[k] += (f_all_k.T @ f_all_k).double()
                        o_energy[k] += y_k.pow(2).sum().double()
        cross, gram, energy = cross.cpu(), gram.cpu(), energy.cpu()
        kv_b = tensors["kv_b_proj.weight"].to(f64).view(H, 2 * d, r).cpu()
        refitted, report = ridge_refit(kv_b[:, d:], cross, gram, energy)
        report = {"v_output_error": report["error"], "v_output_error_refit": report["error_refit"], "v_refit_ridge": report["ridge"]}
        kv_b[:, d:] = refitted
        out = dict(tensors)
        out["kv_b_proj.weight"] = kv_b.reshape(H * 2 * d, r).to(tensors["kv_b_proj.weight"].dtype)
        if o_cross is not None:  # o_proj on the refitted heads z = (U_h f_h)_h: moments through B = blockdiag(U_h)
            block = torch.block_diag(*refitted)  # (H*d, H*r)
            o_gram = (block @ o_gram.cpu() @ block.T)
            o_cross = o_cross.cpu() @ block.T
            o_weight = tensors["o_proj.weight"].to(f64).cpu()[None]  # (1, D, H*d)
            o_refitted, o_report = ridge_refit(o_weight, o_cross[:, None], o_gram[:, None], o_energy.cpu())
            out["o_proj.weight"] = o_refitted[0].to(tensors["o_proj.weight"].dtype)
            report.update(o_output_error=o_report["error"], o_output_error_refit=o_report["error_refit"], o_refit_ridge=o_report["ridge"])
        return out, report

    @torch.no_grad()
    def advance(self, layer: int, tensors: dict[str, torch.Tensor] | None) -> None:
        """Push the hidden states through layer ``layer``: its converted attention (``tensors``, when
        calibrating sequentially) or the source attention, then the source MLP."""
        if layer != self.layer:
            raise RuntimeError(f"calibration advanced through layer {layer} while at layer {self.layer}")
        source = self._source_layer(layer)
        converted = self._target_attention(layer, tensors) if (self.sequential and tensors is not None) else None
        for start in range(0, self.hidden.shape[0], self.batch_size):
            h = self.hidden[start : start + self.batch_size]  # (b, L, D)
            x = source.input_layernorm(h)
            if converted is not None:
                attention = converted(x, position_embeddings=self.target_rope, attention_mask=None)[0]
            else:
                attention = source.self_attn(x, position_embeddings=self.source_rope, attention_mask=None)[0]
            h = h + attention
            h = h + source.mlp(source.post_attention_layernorm(h))
            self.hidden[start : start + self.batch_size] = h
            if self.source_hidden is not None:
                h = self.source_hidden[start : start + self.batch_size]
                h = h + source.self_attn(source.input_layernorm(h), position_embeddings=self.source_rope, attention_mask=None)[0]
                self.source_hidden[start : start + self.batch_size] = h + source.mlp(source.post_attention_layernorm(h))
        self.layer += 1
        if self._bar is not None:
            self._bar.update(1)
            if self.layer == self.num_layers:
                self._bar.close()


@contextmanager
def eager_attention(*configs):
    """Run the attention of these configs' modules with eager softmax (it returns the probabilities)."""
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = "eager"
        yield
    finally:
        for config, implementation in zip(configs, saved):
            config._attn_implementation = implementation


def ridge_refit(current: torch.Tensor, cross: torch.Tensor, gram: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Least-squares maps U (batched over a leading dim) for t ≈ U f, from two folds of moments:
    ``cross`` (2, B, m, n) = E[t fᵀ], ``gram`` (2, B, n, n) = E[f fᵀ], ``energy`` (2,) = E‖t‖² summed over B.
    The ridge (towards ``current`` (B, m, n)) is the one of REFIT_RIDGES with the least error on
    the fold it was not fitted on — or no refit, when that validates best. Returns U and the relative
    errors before and after (on both folds) and the ridge (None: kept ``current``)."""
    # one eigendecomposition per set of moments serves every ridge: (G + λsI)⁻¹ = Q (Λ + λs)⁻¹ Qᵀ
    def solver(moments_cross, moments_gram):
        eigenvalues, vectors = torch.linalg.eigh(moments_gram)  # (B, n), (B, n, n)
        scale = moments_gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None]  # (B, 1)
        rotated = (moments_cross - current @ moments_gram) @ vectors  # (B, m, n): the residual's cross moment

        def fit(ridge):
            return current + (rotated / (eigenvalues.clamp_min(0) + ridge * scale)[:, None, :]) @ vectors.transpose(1, 2)

        return fit

    def error(up, k):  # Σ_B E‖U f − t‖² on fold k
        return float(torch.einsum("bmr,brs,bms->", up, gram[k], up) - 2 * torch.einsum("bmr,bmr->", up, cross[k]) + energy[k])

    folds = [solver(cross[k], gram[k]) for k in (0, 1)]
    scores = {float("inf"): error(current, 0) + error(current, 1)}  # first: a tie keeps the current map
    scores.update({ridge: sum(error(folds[k](ridge), 1 - k) for k in (0, 1)) for ridge in REFIT_RIDGES})
    ridge = min(scores, key=scores.get)
    refitted = current if ridge == float("inf") else solver(cross.sum(0), gram.sum(0))(ridge)
    total = float(energy.sum().clamp_min(1e-30))
    report = {"error": (max(error(current, 0) + error(current, 1), 0.0) / total) ** 0.5,
              "error_refit": (max(error(refitted, 0) + error(refitted, 1), 0.0) / total) ** 0.5,
              "ridge": None if ridge == float("inf") else ridge}
    return refitted, report


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def calibration_statistics(ckpt, family, plan, options, progress: bool = True) -> LayerwiseCalibration:
    """The pipeline's statistics provider for ``options.calib`` (see the module docstring)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt.folder))
    except Exception as error:
        raise UserError(f"calibration needs the source tokenizer, which {ckpt.folder} lacks ({type(error).__name__}).") from error
    texts = load_calibration_texts(options.calib)
    tokens = calibration_token_ids(texts, tokenizer, options.calib_samples, options.calib_seq_len)
    return LayerwiseCalibration(ckpt, family, plan, tokens, sequential=options.calib_sequential,
                                device=options.calib_device, progress=progress,
                                source_stream=options.resolved_methods(True)["refit"] != "none")


# ---- the portable profile's kv_a_layernorm, calibrated by measurement ---------------------------
NORM_CALIBRATIONS = ("rms", "mean", "channel")


@dataclass
class CalibratedNorm:
    latent_scale: float  # divide kv_a's latent rows by it (and multiply kv_b's columns): unit-RMS latents
    weight: torch.Tensor  # (r,) kv_a_layernorm's weight (r + k with stabiliser channels)
    stabilizer: torch.Tensor | None = None  # (k, D) kv_a rows of the stabiliser channels


def calibrated_norm(
    down: torch.Tensor,
    input_covariance: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
    input_sample: torch.Tensor | None = None,
    method: str = "rms",
) -> CalibratedNorm:
    """The portable profile's kv_a_layernorm (DESIGN §2). The norm turns a latent c into w ⊙ c / ρ(c)
    with ρ the token's RMS; we want that to be c itself (in the units kv_b_proj expects).

    - ``rms``: w = 1 after scaling the latent to unit expected RMS, s = sqrt(E ρ²) (norm.expected_rms);
      a token at the RMS passes unchanged.
    - ``mean``: the least-squares scalar over tokens, min E||w c/ρ - c||² → w = E[ρ] (in units of s).
    - ``channel``: per channel, min E(w_j c_j/ρ - c_j)² → w_j = E[c_j²/ρ] / E[c_j²/ρ²].

    ``mean`` and ``channel`` need ``input_sample`` (tokens' x); without it they fall back to ``rms``.
    """
    if method not in NORM_CALIBRATIONS:
        raise ValueError(f"unknown norm calibration {method!r}")
    scale = expected_rms(down, input_covariance, input_scale)
    r = down.shape[0]
    if method == "rms" or input_sample is None:
        return CalibratedNorm(latent_scale=scale, weight=torch.ones(r, dtype=down.dtype))
    latent = input_sample.to(down.dtype) @ down.T / scale  # (n, r), unit RMS on average
    rho = latent.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)  # (n, 1): per-token RMS
    if method == "mean":
        weight = torch.full((r,), float(rho.mean()), dtype=down.dtype)
    else:
        square = latent.pow(2)
        weight = (square / rho).mean(0) / (square / rho.pow(2)).mean(0).clamp_min(1e-30)
    return CalibratedNorm(latent_scale=scale, weight=weight)


def stabilized_norm(down: torch.Tensor, input_covariance: torch.Tensor | None, input_sample: torch.Tensor,
                    channels: int = 1, steps: int = 400) -> CalibratedNorm:
    """kv_a_layernorm made nearly the identity with ``channels`` extra latent channels that kv_b_proj
    never reads: their only job is to keep each token's RMS steady.

    The norm divides a token's latent by its RMS. Most tokens' latents have about the same RMS, but
    some do not — above all the attention-sink tokens (the first of a sequence), whose latent is
    several times smaller in deep layers, so a plain norm blows their keys and values up. A
    stabiliser channel s = a·x grows exactly where the real latent is small. Its rows ``a`` and the
    norm weight are fitted on the calibration tokens to minimise the mean *relative* error
    E[‖w ⊙ c/ρ([c; s]) − c‖² / ‖c‖²], which weighs the rare sink tokens as much as they matter.
    """
    scale = expected_rms(down, input_covariance)
    x = input_sample.to(torch.float64)  # (n, D)
    latent = x @ down.T / scale  # (n, r): unit RMS on average
    n, r = latent.shape
    total = r + channels
    energy = latent.pow(2).sum(-1)  # (n,)
    # start: least squares for a stabiliser that tops every token's energy up to a typical level
    target_energy = torch.quantile(energy, 0.9)
    target = (target_energy - energy).clamp_min(0).sqrt()  # (n,)
    ridge = 1e-3 * x.pow(2).mean() * torch.eye(x.shape[1], dtype=x.dtype)
    first = torch.linalg.solve(x.T @ x / n + ridge, x.T @ target / n)  # (D,)
    # the fit runs in float32 (4× faster than float64 on CPU; the objective is a smooth mean over tokens)
    f32 = torch.float32
    rows = torch.zeros(channels, x.shape[1], dtype=f32)
    rows[0] = first.to(f32)
    if channels > 1:
        rows[1:] = 1e-3 * torch.randn(channels - 1, x.shape[1], dtype=f32, generator=torch.Generator().manual_seed(0))
    rows.requires_grad_(True)
    log_weight = torch.zeros(r, dtype=f32, requires_grad=True)
    optimizer = torch.optim.Adam([rows, log_weight], lr=1e-2)

    # per token t, ‖w ⊙ c/ρ − c‖² / ‖c‖² = Σ_j (w_j/ρ − 1)² a_tj with a_tj = c_tj² / ‖c_t‖²: two
    # matrix-vector products per step instead of elementwise work on the (n, r) latent
    share = (latent.pow(2) / energy.clamp_min(1e-12)[:, None]).to(f32)  # (n, r)
    present = share.sum(-1)  # (n,): 1, or 0 for a token whose latent is zero
    x, energy = x.to(f32), energy.to(f32)

    def relative_error():
        stabiliser = x @ rows.T  # (n, k)
        rho = ((energy + stabiliser.pow(2).sum(-1)) / total).sqrt().clamp_min(1e-12)  # (n,)
        weight = log_weight.exp()
        return (share @ weight.pow(2) / rho.pow(2) - 2 * (share @ weight) / rho + present).mean()

    for _ in range(steps):
        optimizer.zero_grad()
        loss = relative_error()
        loss.backward()
        optimizer.step()
    weight = torch.cat([log_weight.detach().exp(), torch.ones(channels, dtype=f32)])
    return CalibratedNorm(latent_scale=scale, weight=weight.to(down.dtype), stabilizer=rows.detach().to(down.dtype))
