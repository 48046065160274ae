"""Hugging Face Hub ids as artifacts (R1.1 as amended): ``BAAI/bge-small-en-v1.5`` names the
snapshot folder ``huggingface_hub`` keeps in its cache (``HF_HUB_CACHE``, else
``$HF_HOME/hub``), which then loads like any local folder.

The rule that tells a Hub id from a path: an existing path always wins; otherwise a string
``huggingface_hub`` accepts as a repository id (``NAME`` or ``ORG/NAME``, not absolute, no
``~``, ``./`` or ``..``) is a Hub id. With ``HF_HUB_OFFLINE`` set nothing is downloaded: an id
not in the cache is an :class:`ArtifactError` naming the id and the cache folder. Online, only
the files an encoder needs are downloaded (the weights as safetensors, else ONNX).
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_srun.runtime.errors import ArtifactError

# what _from_folder reads; the weights come in a second step, safetensors first
_SMALL_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json", "modules.json", "sentence_bert_config.json",
                "config_sentence_transformers.json", "1_Pooling/config.json"]
_WEIGHTS = (["model.safetensors"], ["model.onnx", "onnx/model.onnx"])
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def is_hub_id(model: str) -> bool:
    """Whether ``model``, which names no existing path, reads as a Hub repository id."""
    return bool(_ID.match(model)) and ".." not in model and not model.endswith(".git") \
        and len(model) <= 96


def cache_dir() -> Path:
    """The Hub cache ``huggingface_hub`` reads (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as ``huggingface_hub`` reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (default: the ``main``
    branch), downloaded first unless ``HF_HUB_OFFLINE`` is set."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    cache, local_only = cache_dir(), offline()
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=local_only,
                                        allow_patterns=_SMALL_FILES + _WEIGHTS[0]))
        if not (folder / _WEIGHTS[0][0]).is_file() and not local_only:
            folder = Path(snapshot_download(repo_id, revision=revision,
                                            allow_patterns=_WEIGHTS[1]))
    except LocalEntryNotFoundError:
        how = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if local_only
               else "the Hub could not be reached")
        raise ArtifactError(f"model {where} is not a local folder and not in the Hugging Face "
                            f"cache {cache} ({how})") from None
    except (HFValidationError, HfHubHTTPError, OSError) as exc:
        raise ArtifactError(f"model {where}: cannot fetch it from the Hugging Face Hub into "
                            f"{cache}: {exc}") from None
    return folder
