"""Models named by their Hugging Face Hub id (``ORG/NAME``, ``ORG/NAME@REVISION``): ``linmem eval`` and ``linmem
probe`` run from a Hub-layout cache with ``HF_HUB_OFFLINE=1``; the config is checked before any weights are asked
for; an unknown id, a gated repository and a missing revision each give one line; a local folder of the same name
wins; ``load_hf_hybrid`` takes a Hub id.

The cache is built by hand, as huggingface_hub lays it out: ``models--ORG--NAME/refs/main`` holds the commit,
``snapshots/COMMIT/`` links each file to ``blobs/``. The model is a tiny sharded Qwen3.5 (tests/test_hf_hybrids.py's
builder) with the zoo's tokenizer. No test reaches the network: huggingface_hub reads ``HF_HUB_CACHE`` and
``HF_HUB_OFFLINE`` once, when it is imported (as transformers does), so the tests in this process set its
``constants`` too, and one test starts a fresh process with the environment alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

import linmem.zoo
from linmem.cli import main
from linmem.data.build import BuildOptions, SplitFractions, build_dataset
from linmem.data.sources import open_path
from linmem.io.manifest import DamagedFileError
from linmem.io.models import resolve_model_folder
from linmem.models.hf_import import load_hf_hybrid
from linmem.models.loading import check_hub_config, load_weights
from tests.test_hf_hybrids import ZOO_TOKENIZER, hf_model
from tests.test_train_support import write_corpus  # noqa: F401 (a fixture)

REPO, COMMIT = "tiny-org/qwen35", "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(cache: Path, repo: str, commit: str, files: Path) -> Path:
    """Put the files of the folder ``files`` into the Hub cache ``cache`` as ``repo`` at ``commit`` (the ``main``
    branch): each snapshot file a relative link to its blob, as huggingface_hub writes them. Returns the snapshot."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot, blobs = storage / "snapshots" / commit, storage / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for path in sorted(files.iterdir()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """``HF_HOME`` with ``hub/`` holding the tiny Qwen3.5 as ``REPO`` (config, tokenizer, index, 3+ shards)."""
    home = tmp_path_factory.mktemp("hf_home")
    saved = home / "saved"
    hf_model("qwen3_5", torch.float32, vocab_size=4096).save_pretrained(saved, max_shard_size="300KB")
    shutil.copy(ZOO_TOKENIZER, saved / "tokenizer.json")
    assert len(list(saved.glob("*.safetensors"))) >= 2 and (saved / "model.safetensors.index.json").is_file()
    add_to_cache(home / "hub", REPO, COMMIT, saved)
    shutil.rmtree(saved)
    return home


@pytest.fixture()
def offline(hub_home, monkeypatch) -> Path:
    """``HF_HOME`` = ``hub_home``, ``HF_HUB_OFFLINE=1``, in the environment and in huggingface_hub's constants."""
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_home


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """A folder of a few text files (filler for the probe, held-out text for eval)."""
    return write_corpus(tmp_path_factory.mktemp("text") / "corpus", documents=16)


def test_eval_runs_on_a_hub_id(offline, text, tmp_path):
    data = tmp_path / "data"
    build_dataset([open_path(text)], data, BuildOptions(tokenizer=str(ZOO_TOKENIZER), progress=False,
                                                        fractions=SplitFractions(0.5, 0.25, 0.25)))
    assert main(["eval", REPO, "--tasks", "ppl", "--data", str(data), "--device", "cpu"]) == 2  # no --out: refused
    out = tmp_path / "eval"
    assert main(["eval", REPO, "--tasks", "ppl", "--data", str(data), "--out", str(out), "--device", "cpu",
                 "--seq-len", "32", "--batch-size", "2", "--max-tokens", "256"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["model"] == str(offline / "hub" / "models--tiny-org--qwen35" / "snapshots" / COMMIT)
    assert report["tasks"]["ppl"]["metrics"]["loss"] > 0
    assert not list((offline / "hub").rglob("eval"))  # nothing written into the cache


def test_probe_runs_on_a_hub_id_at_a_revision(offline, text, tmp_path):
    out = tmp_path / "probe"
    assert main(["probe", f"{REPO}@main", "--out", str(out), "--device", "cpu", "--sources", str(text),
                 "--filler", "24", "--bindings", "2", "--repeats", "1", "--dev-sources", "2",
                 "--confirm-sources", "2", "--only", "logit_lens"]) == 0
    header = json.loads((out / "results.json").read_text())["header"]
    assert header["model"] == f"{REPO}@main" and header["model_folder"].endswith(f"snapshots/{COMMIT}")


def test_config_is_checked_before_weights_are_asked_for(offline, tmp_path, monkeypatch):
    """A model type linmem cannot load is refused after config.json alone; a supported one then asks for the
    shards its index lists, not every file."""
    saved = tmp_path / "llama"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (saved / "model.safetensors").write_bytes(b"weights")
    add_to_cache(offline / "hub", "tiny-org/llama", COMMIT, saved)
    asked, real = [], huggingface_hub.snapshot_download

    def recording(repo_id, **options):
        asked.append((repo_id, options["allow_patterns"]))
        return real(repo_id, **options)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    with pytest.raises(ValueError, match=r"tiny-org/llama: model type 'llama' is not supported .*not downloaded"):
        resolve_model_folder("tiny-org/llama", check_hub_config)
    assert asked == [("tiny-org/llama", ["config.json"])]
    asked.clear()
    snapshot = resolve_model_folder(REPO, check_hub_config)
    shards = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert asked == [(REPO, ["config.json"]), (REPO, ["*.json"]), (REPO, sorted({"model.safetensors", *shards}))]


def test_a_manifest_names_what_is_fetched_and_is_verified(offline, monkeypatch):
    """A linmem model on the Hub (the shipped gdn folder): every file its manifest lists is fetched, and a file that
    differs from the manifest is named as damaged at load, as in a local folder."""
    shipped = Path(linmem.zoo.path("gdn"))
    snapshot = add_to_cache(offline / "hub", "tiny-org/gdn", COMMIT, shipped)
    asked, real = [], huggingface_hub.snapshot_download

    def recording(repo_id, **options):
        asked.append(options["allow_patterns"])
        return real(repo_id, **options)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    model, folder = load_weights("tiny-org/gdn")
    assert folder == snapshot and asked[-1] == sorted(json.loads((shipped / "manifest.json").read_text())["files"])
    (snapshot / "README.md").resolve().write_text("edited")
    with pytest.raises(DamagedFileError, match=r"README\.md: damaged"):
        load_weights("tiny-org/gdn")


@pytest.mark.parametrize("name, said", [
    ("tiny-org/absent", r"tiny-org/absent: no such folder, and tiny-org/absent is not in the Hugging Face cache "
                        r"\S+ while HF_HUB_OFFLINE is set"),
    (f"{REPO}@v9", rf"{REPO}@v9: no such folder, and the Hugging Face cache \S+ holds {REPO} at main only, not at "
                   rf"v9 while HF_HUB_OFFLINE is set"),
])
def test_offline_misses_are_one_line(offline, name, said):
    with pytest.raises(ValueError, match=said) as caught:
        resolve_model_folder(name, check_hub_config)
    assert "\n" not in str(caught.value)


def _hub_error(kind: type[Exception]) -> Exception:
    """An instance of ``kind`` without the HTTP response its constructor wants (linmem reads only its type)."""
    error = kind.__new__(kind)
    Exception.__init__(error, f"{kind.__name__}\nwith a second line")
    return error


@pytest.mark.parametrize("kind, said", [
    (RepositoryNotFoundError, r"org/name@v1: no such folder, and no model org/name on the Hugging Face Hub \(for a "
                              r"private one, log in"),
    (GatedRepoError, r"org/name@v1 is a gated model on the Hugging Face Hub: accept its conditions at "
                     r"https://huggingface.co/org/name, then log in"),
    (RevisionNotFoundError, r"org/name@v1: the Hugging Face model org/name has no revision 'v1'"),
])
def test_hub_refusals_are_one_line(monkeypatch, kind, said):
    def refusing(repo_id, **options):
        raise _hub_error(kind)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refusing)
    with pytest.raises(ValueError, match=said) as caught:
        resolve_model_folder("org/name@v1", check_hub_config)
    assert "\n" not in str(caught.value)


def test_a_local_folder_wins_and_other_names_stay_folder_errors(offline, tmp_path, monkeypatch):
    assert resolve_model_folder(REPO, check_hub_config).name == COMMIT
    monkeypatch.chdir(tmp_path)
    local = tmp_path / REPO
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", None)  # the Hub is not asked
    assert resolve_model_folder(REPO, check_hub_config) == Path(REPO)
    for name in ("tiny-org/qwen35/more", "./tiny-org/absent", "tiny--org/qwen35", "tiny-org/qwen35@"):
        with pytest.raises(ValueError, match=r"not a model folder: .* \(no such folder; give a model or run folder"):
            resolve_model_folder(name, check_hub_config)


def test_load_hf_hybrid_takes_a_hub_id(offline):
    model = load_hf_hybrid(f"{REPO}@{COMMIT}", dtype=torch.float32)
    assert model.config.vocab_size == 4096 and not model.training


def test_hub_errors_answer_before_torch_from_the_environment(hub_home, text, tmp_path):
    """A fresh process, HF_HOME and HF_HUB_OFFLINE set in its environment only: an unknown id and a missing revision
    are one line each on stderr, exit code 2, before torch is imported."""
    filler = next(text.iterdir())
    cases = [["eval", "tiny-org/absent", "--out", str(tmp_path / "e")],
             ["probe", f"{REPO}@v9", "--out", str(tmp_path / "p"), "--sources", str(filler)]]
    script = ("import json, sys\nsys.argv[0] = 'linmem'  # as the console command starts\nfrom linmem.cli import main\n"
              "print(json.dumps([[main(args), 'torch' in sys.modules] for args in json.loads(sys.argv[1])]))\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env={**env, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", "LINMEM_DEBUG": ""},
                          timeout=120)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[2, False], [2, False]], done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and "tiny-org/absent is not in the Hugging Face cache" in lines[0], done.stderr
    assert f"holds {REPO} at main only, not at v9" in lines[1], done.stderr
