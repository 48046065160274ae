"""R1.1 (amended): a Hugging Face Hub id names an artifact through ``huggingface_hub``'s cache,
honouring HF_HUB_OFFLINE and HF_HOME / HF_HUB_CACHE; an existing path wins over a Hub id of
the same spelling. Every test is offline (conftest sets HF_HUB_OFFLINE=1): the cache is laid
out here in the layout huggingface_hub writes (``models--ORG--NAME/blobs``, ``snapshots/<commit>``
of links into the blobs, ``refs/<branch>``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Server, run_cli
from vllm_srun.runtime.artifact import resolve, weights_digest
from vllm_srun.runtime.errors import ArtifactError
from vllm_srun.runtime.hub import is_hub_id

REPO = "tiny-org/tiny-bert"
MAIN, V2 = "a" * 40, "b" * 40


def lay_out(cache: Path, repo_id: str, commit: str, folder: Path, ref: str = "main") -> Path:
    """``folder``'s files as snapshot ``commit`` of ``repo_id`` in the Hub cache ``cache``,
    ``refs/<ref>`` pointing at it, as ``huggingface_hub`` downloads them."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hub cache holding REPO: ``main`` and the tag ``v2`` (other weights)."""
    from tests.tiny_models import bert_embedder

    cache = tmp_path_factory.mktemp("hub-cache")
    lay_out(cache, REPO, MAIN, bert_embedder(tmp_path_factory.mktemp("main"), seed=7))
    lay_out(cache, REPO, V2, bert_embedder(tmp_path_factory.mktemp("v2"), seed=8), ref="v2")
    return cache


@pytest.fixture
def in_cache(hub_cache, monkeypatch) -> Path:
    """This process's huggingface_hub reads ``hub_cache`` (its constants are read at import,
    so the environment is patched where it was read)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


@pytest.mark.parametrize("text,hub", [
    ("BAAI/bge-small-en-v1.5", True), ("bert-base-uncased", True), ("org/name_1.x", True),
    ("/abs/path", False), ("./rel", False), ("~/model", False), ("a/b/c", False),
    ("a/../b", False), ("org/name.git", False), ("", False), ("a b/c", False)])
def test_what_reads_as_a_hub_id(text, hub):
    assert is_hub_id(text) is hub


def test_hub_id_resolves_to_its_cached_snapshot_and_keeps_its_id(in_cache):
    main = resolve(REPO)
    assert main.name == REPO
    assert Path(main.path) == in_cache / "models--tiny-org--tiny-bert" / "snapshots" / MAIN
    v2 = resolve(REPO, "v2")
    assert Path(v2.path).name == V2 and v2.name == REPO
    assert v2.revision != main.revision  # other weights, other content digest
    assert resolve(REPO, V2).path == v2.path  # a commit names the same snapshot


def test_an_existing_folder_wins_over_the_hub_id_of_the_same_spelling(in_cache, tmp_path,
                                                                      monkeypatch):
    local = tmp_path / "tiny-org" / "tiny-bert"
    shutil.copytree(in_cache / "models--tiny-org--tiny-bert" / "snapshots" / V2, local)
    monkeypatch.chdir(tmp_path)
    m = resolve(REPO)
    assert Path(m.path) == Path(REPO) and m.name == "tiny-bert"
    assert m.revision == weights_digest(local / "model.safetensors")
    with pytest.raises(ArtifactError, match="revision 'v2' applies to Hugging Face Hub ids"):
        resolve(REPO, "v2")


def test_hub_id_not_in_the_cache_offline_names_the_id_and_the_cache(in_cache):
    with pytest.raises(ArtifactError) as err:
        resolve("tiny-org/absent")
    assert "'tiny-org/absent'" in str(err.value) and str(in_cache) in str(err.value)
    assert "HF_HUB_OFFLINE" in str(err.value)
    with pytest.raises(ArtifactError, match="'tiny-org/tiny-bert' at revision 'nope'"):
        resolve(REPO, "nope")


def test_serve_refuses_an_uncached_hub_id_naming_it_and_the_cache(hub_cache):
    r = run_cli("serve", "tiny-org/absent", "--port", "0",
                env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "http://" not in r.stdout
    assert "deployments.primary.artifact" in r.stderr and "'tiny-org/absent'" in r.stderr
    assert str(hub_cache) in r.stderr


def test_hf_home_locates_the_cache(hub_cache, tmp_path):
    """HF_HOME (without HF_HUB_CACHE) is honoured: the cache is $HF_HOME/hub."""
    (tmp_path / "hub").symlink_to(hub_cache)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    out = subprocess.run(
        [sys.executable, "-c", "from vllm_srun.runtime.artifact import resolve; "
                               f"print(resolve({REPO!r}).path)"],
        capture_output=True, text=True, timeout=60,
        env={**env, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == (
        hub_cache / "models--tiny-org--tiny-bert" / "snapshots" / MAIN).resolve()


def test_server_serves_a_hub_id_from_the_offline_cache(hub_cache):
    """The whole path: `serve ORG/NAME --revision v2` with HF_HUB_OFFLINE=1 starts workers on
    the cached snapshot, lists the Hub id in /v1/models and answers requests naming it."""
    server = Server(REPO, "--revision", "v2", "--threads", "1", "--backend", "torch",
                    env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}).wait_ready()
    try:
        (entry,) = server.client.get("/v1/models").json()["data"]
        digest = weights_digest(hub_cache / "models--tiny-org--tiny-bert" / "snapshots" / V2
                                / "model.safetensors")
        assert (entry["id"], entry["revision"], entry["dimensions"]) == (REPO, digest, 64)
        r = server.client.post("/v1/embeddings", json={"model": REPO, "input": ["hello"]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == REPO and len(r.json()["data"][0]["embedding"]) == 64
    finally:
        server.close()
