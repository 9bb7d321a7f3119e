"""Models named by their Hugging Face Hub id, ``ORG/NAME`` or ``ORG/NAME@REVISION`` (a branch, tag or commit), for
every command and loader that takes a model folder (``linmem.io.models.resolve_model_folder`` asks here when no
file or folder of that name exists).

``huggingface_hub.snapshot_download`` fetches the files into the user's Hugging Face cache as transformers does: the
cache of ``HF_HOME`` / ``HF_HUB_CACHE``, nothing but the cache with ``HF_HUB_OFFLINE=1``, the token of ``HF_TOKEN``
or ``hf auth login``. It is asked three times, each time for the commit the first answer names (so a branch that
moves meanwhile cannot mix two revisions), and nothing large comes before linmem knows it can load the model:

1. ``config.json``: the caller's check (``linmem.models.loading.check_hub_config``) refuses a ``model_type``
   without a loader and settings that type's converter cannot reproduce (a RoPE scaling, ``kimi_linear``'s decay);
2. the JSON files beside it (tokenizer, index of shards, linmem's ``manifest.json`` and records);
3. the safetensors weights the index lists (else ``model.safetensors``) and every file ``manifest.json`` lists, so
   the loader verifies the manifest as for a local folder. Pickled weights (``.bin``, ``.pt``) are never fetched.

A failure of the Hub is one ``ValueError`` line naming the model: an unknown (or private) id, a gated repository, a
missing revision, a model not in the cache while offline. Only ``huggingface_hub`` (no torch) is imported until
``config.json`` is there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

# a Hub model id as ORG/NAME: letters, digits, '-', '_', '.'; '--' and '..' are not allowed by the Hub
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}", re.ASCII)
HUB_FILES = ("*.json",)  # step 2: config, tokenizer, index of shards, manifest and records
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MANIFEST_NAME = "manifest.json"
# refuses (ValueError) a config.json linmem cannot load: linmem.models.loading.check_hub_config, handed down
# by the caller, since io sits below models
ConfigCheck = Callable[[Path, str], None]


def parse_hub_name(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of ``ORG/NAME`` or ``ORG/NAME@REVISION`` (revision None: the default branch); None for
    a text that is no Hub model id."""
    repo_id, at, revision = text.partition("@")
    if at and not revision:
        return None
    if not _HUB_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith((".", "-")):
        return None
    return repo_id, revision or None


def resolve_hub_model(repo_id: str, revision: str | None, check_config: ConfigCheck) -> Path:
    """The cached snapshot folder of the Hub model ``repo_id`` at ``revision``, with its config checked before any
    weights are fetched, then its weights and the files its manifest lists (``ValueError``, one line, otherwise)."""
    name = repo_id + (f"@{revision}" if revision else "")
    folder = _fetch(repo_id, revision, ["config.json"], name)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{name}: the repository has no config.json, so it holds no model linmem can load")
    check_config(folder, name)
    commit = folder.name  # snapshots/COMMIT: the later fetches ask for this commit, whatever the branch does meanwhile
    _fetch(repo_id, commit, list(HUB_FILES), name)
    return _fetch(repo_id, commit, files_to_load(folder, name), name)


def files_to_load(folder: Path, name: str) -> list[str]:
    """The files of step 3: the shards ``WEIGHTS_INDEX`` lists (else ``WEIGHTS_NAME``) and those of
    ``MANIFEST_NAME``, read from ``folder`` (``ValueError`` when either is not readable)."""
    files = [WEIGHTS_NAME]
    for listing, table in ((WEIGHTS_INDEX, "weight_map"), (MANIFEST_NAME, "files")):
        path = folder / listing
        if not path.is_file():
            continue
        try:
            names = json.loads(path.read_text(encoding="utf-8"))[table]
            files += [str(entry) for entry in (names.values() if table == "weight_map" else names)]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
            raise ValueError(f"{name}: {listing} is not readable ({error}); the repository is damaged") from None
    return sorted(set(files))


def _fetch(repo_id: str, revision: str | None, patterns: list[str], name: str) -> Path:
    """``snapshot_download`` of the files matching ``patterns``; its errors as one ``ValueError`` line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ValueError(f"{name} is a gated model on the Hugging Face Hub: accept its conditions at "
                         f"https://huggingface.co/{repo_id}, then log in (hf auth login, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{name}: no such folder, and no model {repo_id} on the Hugging Face Hub (for a private "
                         f"one, log in: hf auth login, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"{name}: the Hugging Face model {repo_id} has no revision {revision!r}; give a branch, "
                         f"tag or commit of it as {repo_id}@REVISION") from None
    except LocalEntryNotFoundError as error:
        raise ValueError(_not_cached(repo_id, revision, name, error)) from None
    except (HfHubHTTPError, HFValidationError) as error:
        raise ValueError(f"{name}: the Hugging Face Hub did not give the model ({first_line(error)})") from None


def _not_cached(repo_id: str, revision: str | None, name: str, error: Exception) -> str:
    """Why ``name`` could not be fetched from the cache alone: offline, or the Hub unreachable."""
    from huggingface_hub import constants, errors

    cache = Path(constants.HF_HUB_CACHE)
    refs = cache / f"models--{repo_id.replace('/', '--')}" / "refs"
    held = sorted(str(path.relative_to(refs)) for path in refs.rglob("*") if path.is_file()) if refs.is_dir() else []
    if isinstance(error, getattr(errors, "IncompleteSnapshotError", ())) or (revision or "main") in held:
        where = f"the cached snapshot of {repo_id} in {cache} is incomplete"
    elif held:
        where = f"the Hugging Face cache {cache} holds {repo_id} at {', '.join(held)} only, not at {revision}"
    else:
        where = f"{repo_id} is not in the Hugging Face cache {cache}"
    if constants.is_offline_mode():
        return f"{name}: no such folder, and {where} while HF_HUB_OFFLINE is set; unset it to download the model"
    return f"{name}: no such folder, {where} and the Hugging Face Hub could not be reached; connect and try again"


def first_line(error: Exception) -> str:
    """The first line of ``error``'s message (its kind's name when the message is empty)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
