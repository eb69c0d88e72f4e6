"""`mha2mla recover` on tiny random DeepSeek-V3 models: packing, LoRA/full training, distillation, the one train
step on any model, merge-and-write, exact resume after SIGKILL, DDP on two CPU processes, recipes, and
one-sentence errors for bad data, bad recipes and bad options."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from common import SAMPLE_TEXT, build_source
from transformers import AutoModelForCausalLM

from mha2mla.io.loader import load_tokenizer
from mha2mla.recipes import build_settings
from mha2mla.train import SOURCE_LORA_TARGETS, LoraSettings, RecoverConfig, losses, recover
from mha2mla.train.data.packing import RowOrder, pack_token_lists, target_mask
from mha2mla.train.devices import start_devices
from mha2mla.train.loop import RecoveryRun
from mha2mla.train.model.merge import write_recovered
from mha2mla.train.model.student import load_student
from mha2mla.train.model.trainable import make_trainable

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder of two text documents and one .jsonl file of short documents."""
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text(SAMPLE_TEXT * 3)
    (folder / "b.txt").write_text(SAMPLE_TEXT.upper() * 3)
    lines = [json.dumps({"text": sentence.strip() + "."}) for sentence in SAMPLE_TEXT.split(".") if sentence.strip()]
    (folder / "c.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _config(model: Path, data: Path, out: Path, **overrides) -> RecoverConfig:
    settings = {
        "model": str(model), "data": [str(data)], "out": str(out), "seq_len": 32, "batch_size": 4, "max_steps": 30,
        "learning_rate": 1e-2, "lora": {"rank": 8}, "eval_sequences": 4, "eval_every": 10, "save_every": 0,
    }
    settings.update(overrides)
    return RecoverConfig(**settings)


# ------------------------------------------------------------------------------------------- packing


def test_packing_restarts_positions_per_document():
    packed = pack_token_lists([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12]], seq_len=4)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    # doc 2 starts at position 0; a document cut by a row boundary restarts at the row start
    assert packed.position_ids.tolist() == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 2, 0]]
    assert packed.dropped_tokens == 0
    assert target_mask(packed.position_ids).tolist() == [[True, True, False], [False, True, True], [True, True, False]]


def test_packing_stops_reading_once_the_rows_are_filled_and_says_so():
    read = []

    def documents():
        for doc in ([1, 2, 3], [4, 5], [6, 7, 8], [9, 10]):
            read.append(doc[0])
            yield doc

    packed = pack_token_lists(documents(), seq_len=2, max_rows=2)
    assert packed.input_ids.tolist() == [[1, 2], [3, 4]]
    assert packed.num_documents == 2 and packed.unread
    assert read == [1, 4, 6]  # one document past the budget is looked at, not the whole corpus
    held_out, train = packed.split(1)
    assert train.unread
    whole = pack_token_lists(documents(), seq_len=2, max_rows=5)
    assert len(whole) == 5 and not whole.unread


def test_row_order_is_a_seeded_permutation_per_epoch():
    order = RowOrder(5, seed=3)
    first, second = order.rows(0, 5), order.rows(5, 5)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(5))
    assert torch.equal(RowOrder(5, seed=3).rows(3, 4), torch.cat([first[3:], second[:2]]))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_documents_do_not_attend_to_each_other(tiny_mla, attn_implementation):
    model = load_student(tiny_mla, attn_implementation).eval()
    torch.manual_seed(1)
    doc_a, doc_b = torch.randint(0, 256, (1, 7)), torch.randint(0, 256, (1, 9))
    packed = pack_token_lists([doc_a[0].tolist(), doc_b[0].tolist()], seq_len=16)
    with torch.no_grad():
        together = model(**packed.rows(slice(None)), use_cache=False).logits  # (1, 16, V)
        alone_a = model(input_ids=doc_a, use_cache=False).logits
        alone_b = model(input_ids=doc_b, use_cache=False).logits
    torch.testing.assert_close(together[:, :7], alone_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(together[:, 7:], alone_b, atol=1e-5, rtol=1e-4)


def _reference_losses(logits, teacher, ids, mask, temperature):
    """The LM and KL terms written out on whole (B, L-1, V) float64 tensors, as logit_losses defines them."""
    student, targets = logits[:, :-1].double(), ids[:, 1:]
    nll = F.cross_entropy(student.reshape(-1, student.shape[-1]), targets.reshape(-1), reduction="none")
    log_p = F.log_softmax(student / temperature, dim=-1)
    log_q = F.log_softmax(teacher[:, :-1].double() / temperature, dim=-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1).reshape(-1) * temperature**2
    weights = mask.reshape(-1).double() / mask.sum()
    return (nll * weights).sum(), (kl * weights).sum()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_logit_losses_match_the_plain_formulas_and_their_gradient(monkeypatch, temperature):
    monkeypatch.setattr(losses, "CHUNK_POSITIONS", 3)  # several chunks per row, the last one short
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 9, 11, dtype=torch.float64), torch.randn(2, 9, 11, dtype=torch.float64) * 2
    ids, mask = torch.randint(0, 11, (2, 9)), torch.rand(2, 8) > 0.3
    fused = logits.clone().requires_grad_()
    total, lm, kl = losses.logit_losses(fused, teacher, ids, mask, 0.3, 0.7, temperature)
    total.backward()
    plain = logits.clone().requires_grad_()
    ref_lm, ref_kl = _reference_losses(plain, teacher, ids, mask, temperature)
    (0.3 * ref_lm + 0.7 * ref_kl).backward()
    torch.testing.assert_close(lm.double(), ref_lm.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl.double(), ref_kl.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double(), (0.3 * ref_lm + 0.7 * ref_kl).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-5, atol=1e-7)
    assert fused.grad[:, -1].abs().max() == 0 and plain.grad.abs().max() > 1e-3  # the last position is no target


def test_kl_is_zero_only_for_matching_logits_and_bf16_logits_get_a_bf16_gradient():
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 4, dtype=torch.bool)
    assert losses.logit_losses(logits, logits, ids, mask, 0.0, 1.0, 2.0)[2].abs() < 1e-6
    assert losses.logit_losses(logits, torch.randn(2, 5, 11), ids, mask, 0.0, 1.0, 2.0)[2] > 0.01
    half = logits.bfloat16().requires_grad_()
    losses.lm_loss(half, ids, mask).backward()
    assert half.grad.dtype == torch.bfloat16
    reference = logits.bfloat16().float().requires_grad_()
    _reference_losses(reference, logits, ids, mask, 1.0)[0].float().backward()
    torch.testing.assert_close(half.grad.float(), reference.grad, rtol=2e-2, atol=1e-3)


# ------------------------------------------------------------------------------------------- training


def test_short_run_lowers_loss_and_writes_a_native_checkpoint(tiny_mla, corpus, tmp_path):
    out = tmp_path / "recovered"
    report = recover(_config(tiny_mla, corpus, out, save_every=10), show_progress=False)
    first, last = report["evaluations"][0], report["evaluations"][-1]
    assert (first["step"], last["step"]) == (0, 30)
    assert last["perplexity"] < 0.9 * first["perplexity"]
    assert sum(report["losses"][-5:]) < sum(report["losses"][:5])

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["q_lora_rank"] is None
    for name in ("model.safetensors", "absorbed.safetensors", "absorbed.json", "tokenizer.json",
                 "conversion_report.json", "recovery_report.json", "train_log.jsonl", "recover_config.json"):
        assert (out / name).exists(), name
    assert not (out / "checkpoints").exists()  # the finished OUT is the model: its resume checkpoints are removed
    assert "## Recovery fine-tuning" in (out / "README.md").read_text()
    assert not list(tmp_path.glob(".recovered.mha2mla-*"))
    loaded = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no remote code
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    assert not any("lora" in name for name in loaded.state_dict())
    from safetensors.torch import load_file

    absorbed = load_file(str(out / "absorbed.safetensors"))
    kv_b = loaded.model.layers[1].self_attn.kv_b_proj.weight.detach()
    torch.testing.assert_close(absorbed["layers.1.w_uk"], kv_b.view(4, 32, 24)[:, :16])


def test_the_written_config_keeps_the_converted_models_engine_keys(tiny_mla, corpus, tmp_path):
    """save_pretrained rebuilds config.json from DeepseekV3Config, which drops the pre-v5 top-level rope_theta the
    converter writes for engines; the recovered folder keeps it and the other keys written for engines, unchanged."""
    model = tmp_path / "converted"
    shutil.copytree(tiny_mla, model)
    config = json.loads((model / "config.json").read_text())
    theta = config["rope_parameters"]["rope_theta"]
    extra = {"rope_theta": theta, "moe_layer_freq": 1, "mha2mla": {"version": "0.1.0", "profile": "portable"}}
    (model / "config.json").write_text(json.dumps({**config, **extra}))
    out = tmp_path / "recovered"
    recover(_config(model, corpus, out, max_steps=2, eval_every=0), show_progress=False)
    written = json.loads((out / "config.json").read_text())
    assert {key: written.get(key) for key in extra} == extra
    assert written["rope_parameters"]["rope_theta"] == theta and written["model_type"] == "deepseek_v3"
    AutoModelForCausalLM.from_pretrained(out)  # still a plain transformers config


def test_merged_output_has_the_peft_models_logits(tiny_mla, tmp_path):
    config = _config(tiny_mla, tiny_mla, tmp_path / "out", lora={"rank": 4})
    model = make_trainable(load_student(tiny_mla), config.lora)
    torch.manual_seed(5)
    with torch.no_grad():  # a trained-looking adapter: non-zero B matrices and moved norms
        for _name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(0.2 * torch.randn_like(param))
    assert any("kv_a_layernorm" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before_merge = model(input_ids=ids).logits
    report = {"tokens_trained": 0, "steps": 0, "seconds": 0.0, "tokens_per_second": 0.0, "evaluations": []}
    write_recovered(model, load_tokenizer(tiny_mla), tiny_mla, tmp_path / "out", config.model_dump(mode="json"), report)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        after = loaded(input_ids=ids).logits
    assert not torch.allclose(before_merge, AutoModelForCausalLM.from_pretrained(tiny_mla)(input_ids=ids).logits, atol=1e-3)
    torch.testing.assert_close(after, before_merge, atol=2e-5, rtol=1e-4)


def test_full_attention_trains_every_attention_parameter_only(tiny_mla, tmp_path):
    model = make_trainable(load_student(tiny_mla), None)  # no LoRA settings: full attention
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if ".self_attn." in name}
    assert any("kv_a_layernorm" in name for name in trainable)


def test_full_layers_trains_the_decoder_layers_and_writes_them(tiny_mla, corpus, tmp_path):
    """--full-layers: attention, MLP and norms of every layer train; embeddings, final norm and lm_head do not. The
    written checkpoint holds the trained MLPs and the untouched embeddings."""
    model = make_trainable(load_student(tiny_mla), None, layers=True)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if ".layers." in name}
    assert any(".mlp." in name for name in trainable) and not any("embed_tokens" in name for name in trainable)
    out = tmp_path / "layers"
    report = recover(_config(tiny_mla, corpus, out, full_layers=True, max_steps=4, eval_every=0), show_progress=False)
    assert report["trainable_parameters"] == sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    before = AutoModelForCausalLM.from_pretrained(tiny_mla).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    mlp = next(name for name in before if ".mlp." in name and name.endswith("weight"))
    assert not torch.equal(before[mlp], after[mlp])
    torch.testing.assert_close(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"], rtol=0, atol=0)


def test_distillation_from_a_source_teacher(tiny_mla, corpus, tmp_path):
    teacher = build_source(tmp_path / "source", vocab_size=384)
    out = tmp_path / "distilled"
    report = recover(
        _config(tiny_mla, corpus, out, teacher=str(teacher), max_steps=6, eval_every=0, distill_weight=0.7, temperature=2.0),
        show_progress=False,
    )
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [record for record in log if "loss" in record]
    assert len(steps) == 6 and all(record["distill_loss"] > 0 for record in steps)
    mixed = 0.3 * steps[0]["lm_loss"] + 0.7 * steps[0]["distill_loss"]
    assert steps[0]["loss"] == pytest.approx(mixed, rel=1e-5)
    assert report["steps"] == 6 and (out / "model.safetensors").exists()



def test_a_teacher_given_as_a_hub_id_loads_from_the_hugging_face_cache(tiny_mla, corpus, tmp_path, monkeypatch):
    """--teacher owner/name: the source model as the hub keeps it, read from the Hugging Face cache (offline here, as
    in every test: a snapshot laid out the way huggingface_hub writes one), distils like the same folder would."""
    from huggingface_hub import constants

    hub = tmp_path / "hf-cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    build_source(hub / "models--someone--tiny-source" / "snapshots" / commit, vocab_size=384)
    (hub / "models--someone--tiny-source" / "refs").mkdir()
    (hub / "models--someone--tiny-source" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    reports = {}
    for name, teacher in {"hub": "someone/tiny-source", "folder": str(build_source(tmp_path / "source", vocab_size=384))}.items():
        settings = {"teacher": teacher, "max_steps": 2, "eval_every": 0, "distill_weight": 0.7}
        recover(_config(tiny_mla, corpus, tmp_path / f"out-{name}", **settings), show_progress=False)
        log = [json.loads(line) for line in (tmp_path / f"out-{name}" / "train_log.jsonl").read_text().splitlines()]
        reports[name] = [record["distill_loss"] for record in log if "loss" in record]
    assert len(reports["hub"]) == 2 and reports["hub"] == reports["folder"]


def test_train_step_trains_a_source_model_with_lora_settings(tmp_path):
    """The one train step (what benchmarks/recover_speed.py times) on a plain MHA/GQA model, outside a run."""
    source = build_source(tmp_path / "source", vocab_size=384)
    lora = LoraSettings(rank=4, alpha=8, targets=SOURCE_LORA_TARGETS)
    config = RecoverConfig(model=str(source), data=["unused"], out=str(tmp_path / "never-written"), max_steps=10,
                           batch_size=2, grad_accum=2, learning_rate=1e-2, lora=lora)
    recipe = RecoveryRun(config, start_devices(config), config.total_steps())
    recipe.setup_training(make_trainable(AutoModelForCausalLM.from_pretrained(source), config.lora))
    trainable = {name for name, p in recipe.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    batch = pack_token_lists([list(range(1, 300))], seq_len=16).rows(slice(0, 4))  # 2 micro-batches of 2 rows
    results = [recipe.train_step(batch) for _ in range(6)]
    assert set(results[0]) == {"loss", "lm_loss", "lr", "grad_norm"}
    assert all(0 < result["grad_norm"] < float("inf") for result in results)  # before clipping: above 1 at first
    assert results[0]["grad_norm"] > 1
    assert results[-1]["loss"] < 0.8 * results[0]["loss"]
    assert results[-1]["lr"] < results[0]["lr"]  # the cosine schedule moved once per step
    with pytest.raises(ValueError, match="micro-batches"):
        recipe.train_step(pack_token_lists([list(range(1, 300))], seq_len=16).rows(slice(0, 3)))
    assert not (tmp_path / "never-written").exists()


# ------------------------------------------------------------------------------------------- resume


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mha2mla.cli.main", "recover", *args]


def test_sigkill_then_resume_auto_ends_at_the_same_loss(tiny_mla, corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    common = ["--data", str(corpus), "--max-steps", "300", "--seq-len", "32", "--batch-size", "2", "--lr", "5e-3",
              "--lora-rank", "4", "--save-every", "10", "--eval-every", "0", "--eval-sequences", "2", "--no-progress",
              "--warmup-steps", "5"]
    reference = tmp_path / "reference"
    subprocess.run(_cli(str(tiny_mla), "--out", str(reference), *common), env=env, check=True, capture_output=True)

    killed = tmp_path / "killed"
    process = subprocess.Popen(_cli(str(tiny_mla), "--out", str(killed), *common), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (killed / "checkpoints" / "step-000020").exists() and process.poll() is None:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "config.json").exists()

    resumed = subprocess.run(_cli(str(tiny_mla), "--out", str(killed), *common, "--resume", "auto"),
                             env=env, capture_output=True, text=True, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = json.loads((reference / "recovery_report.json").read_text())
    got = json.loads((killed / "recovery_report.json").read_text())
    assert got["resumed_from"] is not None and int(Path(got["resumed_from"]).name[5:]) >= 20
    assert got["steps"] == expected["steps"] == 300
    assert got["final_loss"] == pytest.approx(expected["final_loss"], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-6, atol=1e-7)
    from safetensors.torch import load_file

    a, b = load_file(str(reference / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_resume_with_different_settings_is_refused(tiny_mla, corpus, tmp_path):
    out = tmp_path / "run"
    recover(_config(tiny_mla, corpus, out, max_steps=4, save_every=2, eval_every=0, keep_checkpoints_after_run=True),
            show_progress=False)
    (out / "config.json").unlink()  # pretend the run stopped before writing the model
    from mha2mla import UserError

    with pytest.raises(UserError, match="lora_rank"):
        recover(_config(tiny_mla, corpus, out, max_steps=4, save_every=2, eval_every=0, lora={"rank": 2}), resume="auto")


def test_ddp_on_two_cpu_processes(tiny_mla, corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "ACCELERATE_USE_CPU": "1"}
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "mha2mla.cli.main", "recover", str(tiny_mla), "--data", str(corpus), "--out", str(out),
               "--max-steps", "6", "--seq-len", "32", "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-2",
               "--lora-rank", "4", "--eval-sequences", "2", "--eval-every", "3", "--save-every", "3", "--no-progress",
               "--keep-checkpoints-after-run"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "recovery_report.json").read_text())
    assert report["num_processes"] == 2 and report["steps"] == 6
    assert report["tokens_trained"] == 6 * 2 * 2 * 2 * 32  # steps x batch x accumulation x processes x seq_len
    assert [e["step"] for e in report["evaluations"]] == [0, 3, 6]
    assert report["evaluations"][-1]["perplexity"] < report["evaluations"][0]["perplexity"]
    assert {"rng_state_0.pt", "rng_state_1.pt"} <= {p.name for p in (out / "checkpoints" / "step-000003").iterdir()}
    assert result.stdout.count("recovered model written") == 1


# ------------------------------------------------------------------------------------------- recipes


def test_recipe_recover_section_with_flags_over_it(tiny_mla, corpus, tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        f"source: tiny-source\nrecover:\n  data: {corpus}\n  max_steps: 8\n  seq_len: 32\n  batch_size: 2\n"
        "  learning_rate: 1.0e-2\n  eval_sequences: 2\n  eval_every: 0\n  save_every: 0\n  lora:\n    rank: 4\n    alpha: 8\n"
    )
    out = tmp_path / "out"
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), "--recipe", str(recipe), "--out", str(out),
                                                "--max-steps", "3", "--lora-rank", "2", "--no-progress"])
    assert code == 0, err
    report = json.loads((out / "recovery_report.json").read_text())
    settings = report["settings"]
    assert report["steps"] == 3  # the flag wins over the recipe
    assert settings["lora"]["rank"] == 2 and settings["lora"]["alpha"] == 8  # flag and recipe merge in `lora:`
    assert settings["data"] == [str(corpus)] and settings["seq_len"] == 32 and settings["learning_rate"] == 0.01
    assert settings["schedule"] == RecoverConfig.model_fields["schedule"].default  # neither: the config's default


@pytest.mark.parametrize(
    "section, flags, expected",
    [
        ("  lora_rnk: 4\n", [], "has an unknown recover setting 'lora_rnk'"),
        ("  lora:\n    rnak: 4\n", [], "has an unknown recover setting 'lora.rnak'"),
        ("  schedule: cosin\n", [], "`schedule` under `recover:` in"),
        ("", ["--schedule", "cosin"], "--schedule must be one of 'cosine', 'linear' or 'constant', not 'cosin'."),
        ("", ["--mixed-precision", "bf16"], "No such option: --mixed-precision"),  # the retired flag is gone
        ("  mixed_precision: bf16\n", [], "has an unknown recover setting 'mixed_precision'"),  # retired key
        ("  hidden_distill_weight: 1.0\n", [], "has an unknown recover setting 'hidden_distill_weight'"),  # removed
        ("", ["--compute-dtype", "float16"], "--compute-dtype must be one of 'auto', 'float32' or 'bfloat16'"),
        ("", ["--lora-rank", "0"], "invalid --lora-rank: input should be greater than or equal to 1."),
        ("", None, "give --out (or `out:` under `recover:` in a --recipe)."),  # None: no --out either
    ],
)
def test_bad_recipe_or_option_is_one_sentence(tiny_mla, corpus, tmp_path, monkeypatch, capsys, section, flags, expected):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"source: tiny-source\nrecover:\n  data: {corpus}\n  max_steps: 2\n" + section)
    out = tmp_path / "out"
    out_flags = [] if flags is None else ["--out", str(out), *flags]
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), "--recipe", str(recipe), *out_flags])
    assert code == 2
    message = err.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("error:") and expected in message[0], err
    assert not out.exists()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_recover_sections_are_valid(path):
    config = build_settings("recover", path, {"model": "out/converted", "out": "out/recovered"})
    assert config.data and config.max_tokens
    assert (config.teacher is not None) == (config.distill_weight > 0)  # a teacher only where it is distilled from


# ------------------------------------------------------------------------------------------- bad input


def _run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    from mha2mla.cli.main import main

    monkeypatch.setattr(sys, "argv", ["mha2mla", "recover", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "case, expected",
    [
        ("empty", "is empty"),
        ("not_utf8", "is not UTF-8"),
        ("too_short", "fewer than one packed sequence"),
        ("missing_teacher", "teacher"),
        ("hub_teacher_offline", "offline machine"),
        ("missing_data", "does not exist"),
    ],
)
def test_bad_input_is_one_sentence_and_leaves_no_output(tiny_mla, corpus, tmp_path, monkeypatch, capsys, case, expected):
    data, extra = tmp_path / "data.txt", []
    if case == "empty":
        data.write_text("  \n")
    elif case == "not_utf8":
        data.write_bytes(b"plain start \xff\xfe then latin-1 \xe9t\xe9\n" * 50)
    elif case == "too_short":
        data.write_text("only a few words here.\n")
    elif case == "missing_teacher":
        data = corpus
        extra = ["--teacher", str(tmp_path / "no-such-source.gguf")]
    elif case == "hub_teacher_offline":  # a hub id the empty Hugging Face cache does not hold, offline
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        data, extra = corpus, ["--teacher", "nosuch-owner/nosuch-model"]
    else:
        data = tmp_path / "nowhere.txt"
    out = tmp_path / "out"
    code, err = _run_main(monkeypatch, capsys, [str(tiny_mla), "--data", str(data), "--out", str(out),
                                                "--max-steps", "2", "--seq-len", "64", "--no-progress", *extra])
    assert code == 2
    message = err.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("error:") and expected in message[0], err
    assert "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".out.mha2mla-*"))
