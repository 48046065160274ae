"""R1.1/R1.2: artifacts resolve from packages or local folders, with a manifest and revision."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import L3, L6, words
from vllm_srun.runtime.artifact import DEFAULT_MODEL, resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.errors import ArtifactError, InputTooLong, Unsupported
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import Pooling, Task


def test_default_model_is_the_packaged_l6():
    m = resolve(None)
    assert (m.name, m.task, m.pooling, m.normalize, m.max_tokens, m.hidden_size) == (
        DEFAULT_MODEL, Task.EMBED, Pooling.MEAN, True, 256, 384)
    assert len(m.revision) == 16 and m.safetensors_path is not None


def test_revision_is_a_stable_content_digest(tmp_path):
    a = resolve(L6)
    assert resolve(f"sentence-transformers/{L6}").revision == a.revision
    copy = tmp_path / "copy"
    shutil.copytree(a.path, copy)
    assert resolve(str(copy)).revision == a.revision
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert resolve(str(copy)).revision != a.revision


def test_l3_is_onnx_only_with_its_own_limit():
    m = resolve(L3)
    assert (m.max_tokens, m.normalize, m.safetensors_path) == (128, False, None)
    with pytest.raises(Unsupported, match="safetensors"):
        load_backend(m, "torch")


def test_unknown_model_names_the_choices(tmp_path):
    with pytest.raises(ArtifactError, match="neither a built-in model"):
        resolve(str(tmp_path / "missing"))


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    shutil.copy(resolve(L6).tokenizer_path, tmp_path / "tokenizer.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ArtifactError, match="pickle"):
        resolve(str(tmp_path))


def test_folder_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ArtifactError):
        resolve(str(tmp_path))


def test_classifier_folder_is_a_classify_artifact(classifier_dir):
    m = resolve(str(classifier_dir))
    assert (m.task, m.labels, m.max_tokens) == (
        Task.CLASSIFY, ("negative", "neutral", "positive"), 128)


def test_tokenizer_refuses_or_cuts_over_the_limit():
    m = resolve(L6)
    tok = Tokenizer(m.tokenizer_path, m.max_tokens)
    assert len(tok.encode([words(254)])[0]) == 256
    with pytest.raises(InputTooLong, match=r"input\[7\] has 257 tokens"):
        tok.encode([words(255)], positions=[7])
    cut = tok.encode([words(300)], truncate=True)[0]
    assert len(cut) == 256 and cut[-1] == 102
    assert len(tok.encode([words(200)])[0]) == 202  # shipped fixed padding is off


def _prompted(folder, config) -> str:
    """L6's files (linked) with this config_sentence_transformers.json."""
    src = resolve(L6).path
    folder.mkdir()
    for path in (p for p in Path(src).iterdir()
                 if p.name != "config_sentence_transformers.json"):
        (folder / path.name).symlink_to(path)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    return str(folder)


def test_prompts_of_the_sentence_transformers_config_are_read_and_checked(tmp_path):
    """R7.5: ``prompts`` and ``default_prompt_name`` reach the manifest; a default that is
    not one of the prompts, or a prompt that is not text, is refused naming the key."""
    assert (resolve(L6).prompts, resolve(L6).default_prompt_name) == ((), None)
    m = resolve(_prompted(tmp_path / "ok", {"prompts": {"query": "query: ", "doc": ""},
                                            "default_prompt_name": "query"}))
    assert (m.prompts, m.default_prompt_name) == ((("query", "query: "), ("doc", "")), "query")
    with pytest.raises(ArtifactError, match="default_prompt_name 'passage' is not one of"):
        resolve(_prompted(tmp_path / "bad-default", {"prompts": {"query": "q: "},
                                                     "default_prompt_name": "passage"}))
    with pytest.raises(ArtifactError, match="prompts must map names to prompt texts"):
        resolve(_prompted(tmp_path / "bad-prompt", {"prompts": {"query": 3}}))
