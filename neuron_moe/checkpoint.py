"""Strict loading (and atomic saving) of HF-layout Gemma-4 MoE checkpoints.

Accepted: a directory with config.json and either model.safetensors or shards listed in
model.safetensors.index.json; text weights under `model.layers.` (Gemma4ForCausalLM) or
`model.language_model.layers.` (Gemma4ForConditionalGeneration, the real 26B checkpoint).

Strict means: every tensor the text model needs is present with the right shape, nothing
unexplained is left over, and every error names the key, shape or file. transformers'
`Gemma4ForCausalLM.from_pretrained` on a multimodal checkpoint instead reports every key
missing and random-initialises the model without raising — the trap this module exists for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.initialization import no_init_weights

from .config import geometry_differences, read_config_file
from .errors import UserError
from .report import atomic_dir, dumps, native_write_errors, read_json_object
from .tokenizer import TOKENIZER_MODELS

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MULTIMODAL_TEXT_PREFIX = "model.language_model."
# Other modalities of Gemma4ForConditionalGeneration: present in the real checkpoint, not ours to load.
MULTIMODAL_OTHER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_HEADERS = ("F32", "BF16", "F16")  # the same, as safetensors headers name them
_FINITE_CHUNK = 1 << 24


class CheckpointError(UserError):
    pass


def _listing(keys, limit: int = 20) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def read_config(ckpt_dir: Path, expected: Gemma4TextConfig | None = None, port: str = "") -> Gemma4TextConfig:
    """The checkpoint's config; with `expected` (a port's), refused unless it is the same model:
    a checkpoint of another model must not silently stand in for the port's."""
    config = read_config_file(Path(ckpt_dir) / CONFIG, CheckpointError)
    diffs = geometry_differences(expected, config) if expected is not None else []
    if diffs:
        raise CheckpointError(
            f"{Path(ckpt_dir) / CONFIG}: not the model of port {port!r}: {'; '.join(diffs)} "
            "(give this port's checkpoint, or a port whose [config] is this checkpoint's)"
        )
    return config


def _weight_map(ckpt_dir: Path) -> dict[str, Path]:
    """checkpoint key -> file that holds it (every file checked to exist)."""
    index = ckpt_dir / INDEX
    if index.is_file():
        weight_map = read_json_object(index, CheckpointError, f"{index}: unreadable").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: not a safetensors index (need a 'weight_map' object of key -> file name)")
        for name in set(weight_map.values()):
            if Path(name).name != name or name in ("", ".", ".."):  # a shard is a file of this directory
                raise CheckpointError(f"{index}: shard name {name!r} is not a file name in {ckpt_dir}")
        files = {name: ckpt_dir / name for name in set(weight_map.values())}
        for name, path in files.items():
            if not path.is_file():
                raise CheckpointError(f"{index}: lists shard {name}, which does not exist")
        return {key: files[name] for key, name in weight_map.items()}
    single = ckpt_dir / SINGLE
    if not single.is_file():
        raise CheckpointError(f"{ckpt_dir}: neither {SINGLE} nor {INDEX}")
    return {key: single for key in _file_keys(single)}


def _file_keys(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error type, or OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _text_key(key: str, multimodal: bool) -> str | None:
    """Checkpoint key -> Gemma4ForCausalLM key; None for another modality's weight."""
    if not multimodal:
        return key
    if key.startswith(MULTIMODAL_TEXT_PREFIX):
        return "model." + key[len(MULTIMODAL_TEXT_PREFIX) :]
    if key.startswith(MULTIMODAL_OTHER_PREFIXES):
        return None
    return key  # lm_head.weight, or something unexpected that the key check will name


def expected_shapes(config: Gemma4TextConfig) -> dict[str, tuple[int, ...]]:
    """Every persistent tensor of Gemma4ForCausalLM, from the config, on the meta device."""
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def _wanted(ckpt_dir: Path, config: Gemma4TextConfig) -> tuple[dict[str, tuple[str, Path]], dict]:
    """(Gemma4ForCausalLM key -> (checkpoint key, file), the expected shapes), every key accounted
    for: a missing or unexpected one is an error that lists them."""
    weight_map = _weight_map(ckpt_dir)
    multimodal = any(k.startswith(MULTIMODAL_TEXT_PREFIX) for k in weight_map)
    wanted = {}
    for key, path in weight_map.items():
        text_key = _text_key(key, multimodal)
        if text_key is not None:
            wanted[text_key] = (key, path)
    if config.tie_word_embeddings:
        wanted.pop("lm_head.weight", None)  # tied: the embedding is the head, as HF does

    expected = expected_shapes(config)
    missing, unexpected = set(expected) - set(wanted), set(wanted) - set(expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_listing(unexpected)}")
        raise CheckpointError(f"{ckpt_dir}: " + "; ".join(parts))
    return wanted, expected


def _each_tensor(wanted: dict[str, tuple[str, Path]], visit) -> None:
    """`visit(f, text_key, key, path)` for every wanted tensor, each file opened once; a file that
    is not safetensors, or lacks a key its index lists, is an error naming it."""
    by_file: dict[Path, list[str]] = {}
    for text_key, (_, path) in wanted.items():
        by_file.setdefault(path, []).append(text_key)
    for path, text_keys in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                present = set(f.keys())
                for text_key in text_keys:
                    key = wanted[text_key][0]
                    if key not in present:
                        raise CheckpointError(f"{path}: index lists {key} in this shard, but it is not there")
                    visit(f, text_key, key, path)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error type, or OSError
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _check_tensor(key: str, path: Path, shape: tuple, expected: tuple, dtype, floats: tuple) -> None:
    if shape != expected:
        raise CheckpointError(f"{key}: shape {shape} in {path.name}, expected {expected}")
    if dtype not in floats:
        raise CheckpointError(f"{key}: dtype {dtype} in {path.name} is not a float type")


def read_state_dict(ckpt_dir: Path, config: Gemma4TextConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    wanted, expected = _wanted(Path(ckpt_dir), config)
    state = {}

    def load(f, text_key, key, path):
        tensor = f.get_tensor(key)
        _check_tensor(key, path, tuple(tensor.shape), expected[text_key], tensor.dtype, _FLOAT_DTYPES)
        _check_finite(tensor, key, path)
        state[text_key] = tensor.to(dtype)

    _each_tensor(wanted, load)
    return state


def check_checkpoint(
    ckpt_dir: Path, expected: Gemma4TextConfig | None = None, port: str = "", tokenizer: bool = False
) -> Gemma4TextConfig:
    """Everything about a checkpoint directory that is known without reading its weights, in one
    place so that every command says the same about the same mistake before it starts its work (or
    a server binds its socket): the directory, config.json (with `expected`: that it is the port's
    model), every weight file, key, shape and dtype (the safetensors headers), and with `tokenizer`
    the tokenizer's files. Non-finite weights are found when they are read (`read_state_dict`)."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: {'not a directory' if path.exists() else 'no such directory'}")
    if not (path / CONFIG).is_file():
        raise CheckpointError(
            f"checkpoint {path}: no {CONFIG} (an HF-layout checkpoint holds {CONFIG} and "
            f"{SINGLE}, or {INDEX} and its shards)"
        )
    config = read_config(path, expected, port)
    wanted, shapes = _wanted(path, config)

    def check(f, text_key, key, file):
        header = f.get_slice(key)
        _check_tensor(key, file, tuple(header.get_shape()), shapes[text_key], header.get_dtype(), _FLOAT_HEADERS)

    _each_tensor(wanted, check)
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_MODELS):
        raise CheckpointError(
            f"checkpoint {path}: no tokenizer ({' or '.join(TOKENIZER_MODELS)}); port {port!r} "
            "takes its tokenizer from its checkpoint"
        )
    return config


def _check_finite(tensor: torch.Tensor, key: str, path: Path) -> None:
    """NaN or inf in a weight makes every output NaN (empty text, failed sampling): refuse it at
    load. One pass of isfinite over each tensor, a small share of reading the file."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHUNK):  # chunks: a bool mask of 2^24, not of the tensor
        if not torch.isfinite(flat[start : start + _FINITE_CHUNK]).all():
            bad = flat.numel() - int(torch.isfinite(flat).sum())
            raise CheckpointError(f"{key} in {path.name}: {bad} non-finite value(s) (NaN or inf) of {flat.numel()}")


def model_from_state_dict(config: Gemma4TextConfig, state: dict[str, torch.Tensor]) -> Gemma4ForCausalLM:
    """Build the model without a random init, then take the checkpoint's tensors as its own."""
    with no_init_weights():
        model = Gemma4ForCausalLM(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:  # read_state_dict checked; belt and braces
        raise CheckpointError(f"load_state_dict disagreed: {result}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_checkpoint(
    ckpt_dir: Path, dtype: torch.dtype | None = None, expected: Gemma4TextConfig | None = None, port: str = ""
) -> Gemma4ForCausalLM:
    """The checkpoint's model; with `expected`, only if it is that config's model (`read_config`)."""
    config = read_config(Path(ckpt_dir), expected, port)
    return model_from_state_dict(config, read_state_dict(Path(ckpt_dir), config, dtype or torch.float32))


def save_checkpoint(
    model: Gemma4ForCausalLM, out_dir: Path, *, multimodal: bool = False, shard_bytes: int | None = None
) -> Path:
    """Write an HF-layout directory atomically: built beside it, then renamed in (`atomic_dir`)."""
    with atomic_dir(out_dir) as tmp:
        write_checkpoint(model, tmp, multimodal=multimodal, shard_bytes=shard_bytes)
    return Path(out_dir)


def write_checkpoint(
    model: Gemma4ForCausalLM, out_dir: Path, *, multimodal: bool = False, shard_bytes: int | None = None
) -> None:
    """The HF-layout files of `model` into the existing directory `out_dir`.

    `multimodal=True` writes the Gemma4ForConditionalGeneration layout (text under
    model.language_model., config under text_config) — what the real 26B checkpoint looks like.
    """
    out_dir = Path(out_dir)
    config = model.config
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if multimodal:
        state = {
            (MULTIMODAL_TEXT_PREFIX + k[len("model.") :] if k.startswith("model.") else k): v for k, v in state.items()
        }
        cfg = {
            "model_type": "gemma4",
            "architectures": ["Gemma4ForConditionalGeneration"],
            "text_config": config.to_dict(),
        }
    else:
        cfg = dict(config.to_dict(), architectures=["Gemma4ForCausalLM"])

    (out_dir / CONFIG).write_text(dumps(cfg, indent=2, sort_keys=True) + "\n")
    shards = _shard(state, shard_bytes)
    if len(shards) == 1:
        with native_write_errors(out_dir / SINGLE):
            save_file(shards[0], out_dir / SINGLE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with native_write_errors(out_dir / name):
            save_file(shard, out_dir / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _shard(state: dict[str, torch.Tensor], shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    if not shard_bytes:
        return [state]
    shards, current, size = [], {}, 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += nbytes
    shards.append(current)
    return shards


def iter_expert_weights(ckpt_dir: Path, config: Gemma4TextConfig):
    """(gate_up_proj, down_proj) of each layer read straight from the files, one layer in memory
    at a time, in the stored dtype: for offline passes over models too big to load (reader prep)."""
    ckpt_dir = Path(ckpt_dir)
    weight_map = _weight_map(ckpt_dir)
    multimodal = any(k.startswith(MULTIMODAL_TEXT_PREFIX) for k in weight_map)
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for i in range(config.num_hidden_layers):
        pair = []
        for name, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            key = f"model.layers.{i}.experts.{name}"
            if multimodal:
                key = MULTIMODAL_TEXT_PREFIX + key[len("model.") :]
            if key not in weight_map:
                raise CheckpointError(f"{ckpt_dir}: missing key {key}")
            try:
                with safe_open(weight_map[key], framework="pt") as f:
                    tensor = f.get_tensor(key)
            except Exception as e:
                raise CheckpointError(f"{weight_map[key]}: not a readable safetensors file ({e})") from None
            if tuple(tensor.shape) != shape or tensor.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{key}: {tensor.dtype} {tuple(tensor.shape)} in {weight_map[key].name}, "
                    f"expected a float tensor of shape {shape}"
                )
            _check_finite(tensor, key, weight_map[key])
            pair.append(tensor)
        yield tuple(pair)
