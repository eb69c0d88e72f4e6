"""A core install (no extras): `convert` and `inspect` of a Hugging Face folder work, and each command whose extra is
missing says in one sentence which extra to install, exit 2. The extras' modules are hidden in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from common import build_source

from mha2mla.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]

# Hides the extras' modules from every import finder (as if not installed), then runs each command in-process and
# prints [exit code, stdout, stderr] per command as JSON (a crash is the code "crash" and its traceback).
DRIVER = r"""
import contextlib, io, json, sys, traceback
HIDDEN = set(sys.argv[1].split(","))
class Hide:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
from mha2mla.cli.main import main
results = []
for args in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["mha2mla", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code
        except Exception:  # a crash fails that command's test only
            code = "crash"
            err.write(traceback.format_exc())
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""

HIDDEN = sorted({"lm_eval", "peft", "accelerate", "matplotlib", "gguf", "triton"})


def run_without_extras(commands: list[list[str]]) -> list[list]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", DRIVER, ",".join(HIDDEN), json.dumps(commands)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packaging")
    source = build_source(folder / "source", "llama", num_heads=4, num_kv_heads=2)
    (folder / "model.gguf").write_bytes(b"GGUF")
    commands = {
        "convert": ["convert", str(source), str(folder / "out"), "--calib", "none", "--no-progress"],
        "inspect": ["inspect", str(folder / "out")],
        "eval": ["eval", str(folder / "out"), "--out", str(folder / "eval")],
        "recover": ["recover", str(folder / "out"), "--data", str(folder / "text.txt"), "--out", str(folder / "rec"),
                    "--max-steps", "1"],
        "export-gguf": ["export-gguf", str(folder / "out"), str(folder / "out.gguf")],
        "gguf-source": ["convert", str(folder / "model.gguf"), str(folder / "from-gguf"), "--calib", "none"],
    }
    outcome = dict(zip(commands, run_without_extras(list(commands.values()))))
    return folder, outcome


def test_extras_hold_the_hidden_modules():
    assert set(HIDDEN) == {name for names in EXTRAS.values() for name in names}


def test_convert_and_inspect_need_no_extra(results):
    folder, outcome = results
    code, stdout, stderr = outcome["convert"]
    assert code == 0, stderr[-2000:]
    assert (folder / "out" / "config.json").is_file() and "wrote" in stdout
    code, stdout, stderr = outcome["inspect"]
    assert code == 0 and "deepseek_v3" in stdout, stderr[-2000:]


@pytest.mark.parametrize(("name", "extra"), [("eval", "eval"), ("recover", "recover"), ("export-gguf", "gguf"),
                                             ("gguf-source", "gguf")])
def test_a_missing_extra_is_one_sentence(results, name, extra):
    folder, outcome = results
    code, stdout, stderr = outcome[name]
    assert code == 2
    assert stderr.strip().startswith("error: ") and len(stderr.strip().splitlines()) == 1, stderr
    assert f"pip install 'mha2mla[{extra}]'" in stderr and "Traceback" not in stderr
    assert not any(path.name in ("eval", "rec", "out.gguf", "from-gguf") for path in folder.iterdir())


def test_core_dependencies_leave_the_extras_out():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for heavy in ("lm-eval", "peft", "accelerate", "matplotlib", "gguf", "triton"):
        assert heavy not in core
    extras = project["optional-dependencies"]
    assert {"eval", "recover", "gguf", "kernels", "all"} <= extras.keys()
    assert extras["all"] == ["mha2mla[eval,recover,gguf,kernels]"]


def test_a_checkout_finds_its_own_cache(monkeypatch):
    """Run from a checkout, the library reads the cache that the entry point scripts/assets.py (make assets) fills."""
    from mha2mla.io.cache import cache_dir

    monkeypatch.delenv("MHA2MLA_CACHE", raising=False)
    assert (ROOT / "scripts" / "assets.py").is_file()
    assert cache_dir() == ROOT / ".cache"
