"""Where a checkpoint comes from: a local directory, or a Hugging Face Hub repository id.

`--checkpoint ORG/NAME` (a name that is not an existing path) is fetched with huggingface_hub's
`snapshot_download` into its cache, which honours the library's own settings: HF_HOME (or
HF_HUB_CACHE) for where, HF_TOKEN for private and gated repositories, HF_ENDPOINT for another hub,
HF_HUB_OFFLINE=1 for the cache alone. Only the files a command reads come down (the config, the
safetensors weights and their index, the tokenizer's files); what is already in the cache is
not fetched again. The directory it returns is then checked like any other
(`checkpoint.check_checkpoint`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    StrictDataclassError,
)

from transformers import Gemma4AssistantConfig

from .checkpoint import CONFIG, INDEX, CheckpointError, check_checkpoint
from .config import SIZES
from .errors import UserError
from .port import builtin_path
from .report import read_json_object
from .tokenizer import TOKENIZER_FILES

# What checkpoint.py and tokenizer.py read: the weights as model.safetensors or the shards its index
# names (model-00001-of-00012.safetensors: the name transformers writes); nothing else of the repo
# (README, other formats, original/ weights) is downloaded.
PATTERNS = (CONFIG, INDEX, "model*.safetensors", *TOKENIZER_FILES)
# Speculative decoding's assistants shipped with the project, by name: each a directory beside the
# built-in ports (ports/NAME: config.json, model.safetensors) for the port it drafts for.
ASSISTANTS = ("tiny-gemma4-moe-assistant",)
# ORG/NAME as the Hub spells repository ids: letters, digits, '-', '_', '.'; not a path
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def is_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.fullmatch(spec)) and ".." not in spec and not Path(spec).exists()


def resolve(spec: str | Path, revision: str | None = None) -> Path:
    """The local directory of `spec`: itself, or the Hub repository `spec` at `revision` (a branch,
    tag or commit; default main) downloaded into the Hugging Face cache. A failure is one
    CheckpointError that names the repository and what to do."""
    if not is_repo_id(str(spec)):
        if revision is not None:
            raise CheckpointError(
                f"--revision {revision} applies to a Hub repository id (ORG/NAME), not to the directory {spec}"
            )
        return Path(spec).expanduser()
    repo = str(spec)
    at = f"{repo}@{revision or 'main'}"
    if not constants.HF_HUB_OFFLINE:
        print(
            f"checkpoint {at}: from {constants.ENDPOINT} into {constants.HF_HUB_CACHE} (files already there "
            "are not fetched again)",
            file=sys.stderr,
        )
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(PATTERNS)))
    except GatedRepoError:
        raise CheckpointError(
            f"checkpoint {at}: a gated repository: accept its terms on the Hub with your "
            "account, then set HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(
            f"checkpoint {at}: no revision {revision!r} (a branch, tag or commit) in {repo}"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"checkpoint {at}: no such repository on {constants.ENDPOINT}, or a private one "
            "that HF_TOKEN does not open (and no such directory here)"
        ) from None
    except IncompleteSnapshotError:
        raise CheckpointError(
            f"checkpoint {at}: the Hugging Face cache {constants.HF_HUB_CACHE} holds part of it "
            "and the Hub cannot be reached to fetch the rest (HF_HUB_OFFLINE, or the "
            "network)"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(
                f"checkpoint {at}: not in the Hugging Face cache {constants.HF_HUB_CACHE}, and "
                "HF_HUB_OFFLINE=1 forbids downloading it: download it once online (unset "
                "HF_HUB_OFFLINE), or point HF_HOME at a cache that holds it (and no such "
                "directory here)"
            ) from None
        raise CheckpointError(
            f"checkpoint {at}: cannot reach {constants.ENDPOINT} and not in the cache "
            f"{constants.HF_HUB_CACHE}: {_first_line(e)}"
        ) from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"checkpoint {at}: the Hub answered {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def local_checkpoint(spec: str | Path, revision: str | None, port, tokenizer: bool = True) -> Path:
    """`--checkpoint` for `port` as a checked local directory: `resolve`, then `check_checkpoint`,
    the one check every command makes before its work (a server: before it binds its socket);
    `tokenizer`: the command reads text, so a port whose tokenizer is its checkpoint's needs one."""
    path = resolve(spec, revision)
    check_checkpoint(path, port.config, port.name, tokenizer=tokenizer and port.tokenizer == "checkpoint")
    return path


def resolve_assistant(spec: str, revision: str | None = None) -> Path:
    """The directory of a speculative-decoding assistant (`--speculative-config`'s "model"): a built-in
    one's by its name (`ASSISTANTS`), else `resolve`'s (a directory, or a Hub repository id), with its
    config.json in it."""
    path = builtin_path(spec) if spec in ASSISTANTS else resolve(spec, revision)
    if not (path / CONFIG).is_file():
        raise CheckpointError(
            f"assistant {spec}: no {CONFIG} in {path} (an assistant is a directory with its config.json "
            f"and safetensors, a Hub repository id, or a built-in one: {', '.join(ASSISTANTS)})"
        )
    return path


def read_assistant_config(path: Path, target) -> Gemma4AssistantConfig:
    """The config of the Gemma-4 assistant in directory `path`, refused unless it drafts for `target`
    (a Gemma4TextConfig): the target's vocabulary, and a backbone hidden size that is the target's."""
    where = path / CONFIG
    raw = read_json_object(where, CheckpointError, f"{path}: no {CONFIG}")
    text = raw.get("text_config")
    if raw.get("model_type") != "gemma4_assistant" or not isinstance(text, dict):
        raise CheckpointError(f"{where}: not a Gemma-4 assistant (model_type gemma4_assistant with a text_config)")
    for key, (least, most) in SIZES.items():
        if text.get(key) is not None and not (type(text[key]) is int and least <= text[key] <= most):
            raise CheckpointError(f"{where}: text_config.{key} = {text[key]!r} is not an integer in [{least}, {most}]")
    fits = {"vocab_size": (text.get("vocab_size"), target.vocab_size)}
    fits["backbone_hidden_size"] = (raw.get("backbone_hidden_size"), target.hidden_size)
    for key, (mine, theirs) in fits.items():
        if mine != theirs:
            raise CheckpointError(f"{where}: {key} {mine} does not fit the target's {theirs}")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")}
    try:
        config = Gemma4AssistantConfig(**fields)
        config.validate_architecture()
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, StrictDataclassError) as e:
        raise CheckpointError(f"{where}: not a usable Gemma-4 assistant config: {_first_line(e)}") from None
    return config


def check_assistant(speculative, target) -> Path | None:
    """The assistant's directory for a `--speculative-config` (a `speculative.SpeculativeConfig`) whose
    method is mtp (None for prompt lookup): its "model" resolved (`resolve_assistant`: a built-in name,
    a directory or a Hub id) and its config.json checked to fit `target`, the target's
    `Gemma4TextConfig` (`read_assistant_config`); a failure is one line naming the flag."""
    if speculative.method != "mtp":
        return None
    try:
        directory = resolve_assistant(speculative.model)
        read_assistant_config(directory, target)
    except UserError as e:
        raise UserError(f"--speculative-config: {' '.join(str(e).split())}") from None
    return directory
