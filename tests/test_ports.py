import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from neuron_moe import cli
from neuron_moe.config import ConfigError
from neuron_moe.port import PortError, builtin_ports, load_port
from neuron_moe.spec import Reader

from conftest import port_text_elsewhere, with_reader_table

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_builtin_ports_load_by_name():
    assert {"tiny-gemma4-moe", "gemma4-26b-a4b"} <= set(builtin_ports())
    big = load_port("gemma4-26b-a4b").config
    assert (big.hidden_size, big.num_hidden_layers, big.num_experts, big.top_k_experts) == (2816, 30, 128, 8)
    assert (big.moe_intermediate_size, big.intermediate_size, big.vocab_size) == (704, 2112, 262144)
    assert big.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert big.attention_k_eq_v and big.per_layer_config[5].head_dim == 512
    assert big.per_layer_config[5].num_key_value_heads == 2


def test_tiny_port_is_shardable_and_has_both_layer_kinds():
    c = load_port("tiny-gemma4-moe").config
    assert c.hidden_size % 128 == 0 and c.num_attention_heads % 8 == 0 and c.num_experts % 8 == 0
    assert set(c.layer_types) == {"sliding_attention", "full_attention"}


def _write(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return str(path)


_TINY_PORT = load_port("tiny-gemma4-moe")
TINY = port_text_elsewhere(_TINY_PORT)


def test_a_port_whose_checkpoint_is_missing_says_so(tmp_path):
    text = _TINY_PORT.path.read_text()  # relative "tiny-gemma4-moe": not beside the copy
    with pytest.raises(PortError, match=r"\[weights\]: checkpoint directory .*tiny-gemma4-moe not found"):
        load_port(_write(tmp_path, text))


def test_port_loads_by_path(tmp_path):
    assert load_port(_write(tmp_path, TINY)).name == "tiny-gemma4-moe"


def test_expert_layout_defaults_to_channel(tmp_path):
    assert (
        _TINY_PORT.static.expert_layout == "channel" and load_port("gemma4-26b-a4b").static.expert_layout == "channel"
    )
    without = TINY.replace('expert_layout = "channel"', "")
    assert without != TINY and load_port(_write(tmp_path, without)).static.expert_layout == "channel"
    expert = TINY.replace('expert_layout = "channel"', 'expert_layout = "expert"')
    assert load_port(_write(tmp_path, expert)).static.expert_layout == "expert"


@pytest.mark.parametrize(
    "edit,error,message",
    [
        (
            lambda t: t.replace('name = "tiny-gemma4-moe"', 'name = "x"\nflavour = "mint"'),
            PortError,
            r"unknown field\(s\) \['flavour'\]",
        ),
        (lambda t: t.replace('dtype = "float32"', 'dtype = "float8"'), PortError, "dtype 'float8' is not one of"),
        (
            lambda t: t.replace('source = "checkpoint"', 'source = "random"'),
            PortError,
            r"\[weights\]: missing field 'seed'",
        ),
        (
            lambda t: t.replace("enable_moe_block = true", "enable_moe_block = false"),
            ConfigError,
            "not a Gemma-4 MoE config",
        ),
        (
            lambda t: t.replace("num_experts = 16", "num_experts = 16\nnum_expertz = 3"),
            ConfigError,
            r"unknown config field\(s\) \['num_expertz'\]",
        ),
        (lambda t: t.replace("top_k_experts = 4", "top_k_experts = 32"), ConfigError, "exceeds num_experts=16"),
        (lambda t: t + "\n[[[", PortError, "not valid TOML"),
        (
            lambda t: t.replace("buckets = [8, 24, 56]", "buckets = [56, 8]"),
            PortError,
            r"\[static\]: buckets must be strictly increasing, got \[56, 8\]",
        ),
        (lambda t: t.replace("buckets = [8, 24, 56]", "buckets = []"), PortError, "buckets must be a list of 1 to 64"),
        (
            lambda t: t.replace("max_cache_len = 96", "max_cache_len = 32"),
            PortError,
            "max_cache_len 32 is shorter than the largest bucket 56",
        ),
        (
            lambda t: t.replace("max_cache_len = 96", "max_cache_len = 1024"),
            PortError,
            "max_cache_len 1024 exceeds max_position_embeddings 512",
        ),
        (
            lambda t: t.replace('decode_experts = "selective"', 'decode_experts = "eager"'),
            PortError,
            "decode_experts 'eager' is not an experts implementation for static graphs",
        ),
        (lambda t: t.replace("batch_size = 2", "batch_size = 0"), PortError, "batch_size must be in \\[1, 1024\\]"),
        (lambda t: t.replace("batch_size = 2", "batch = 2"), PortError, r"\[static\]: unknown field\(s\) \['batch'\]"),
        (
            lambda t: t.replace('expert_layout = "channel"', 'expert_layout = "rows"'),
            PortError,
            r"\[static\]: expert_layout 'rows' is not one of \['channel', 'expert'\]",
        ),
        # [reader] as [static]: the file and the table named, each field's type and range checked at load
        (
            lambda t: with_reader_table(t, "budjet = 10"),
            PortError,
            r"p\.toml \[reader\]: unknown field\(s\) \['budjet'\]; expected \['budget', 'recovery_rank', 'sidecar'\]",
        ),
        (
            lambda t: with_reader_table(t, 'recovery_rank = "full"'),
            PortError,
            r"p\.toml \[reader\]: field 'recovery_rank' must be int, got str",
        ),
        (
            lambda t: with_reader_table(t, "sidecar = 3"),
            PortError,
            r"\[reader\]: field 'sidecar' must be str, got int 3",
        ),
        (
            lambda t: with_reader_table(t, "budget = true"),
            PortError,
            r"\[reader\]: field 'budget' must be int or float, got bool",
        ),
        (
            lambda t: with_reader_table(t, "budget = 0"),
            PortError,
            r"\[reader\]: budget must be in \(0, 100\] percent, got 0",
        ),
        (
            lambda t: with_reader_table(t, "recovery_rank = -1"),
            PortError,
            r"\[reader\]: recovery_rank must be 0 or more, got -1",
        ),
        (
            lambda t: t.split("\n[reader]\n")[0].replace(
                'name = "tiny-gemma4-moe"', 'name = "tiny-gemma4-moe"\nreader = 10'
            ),
            PortError,
            "field 'reader' must be dict, got int 10",
        ),
    ],
)
def test_bad_port_files_name_the_problem(tmp_path, edit, error, message):
    with pytest.raises(error, match=message):
        load_port(_write(tmp_path, edit(TINY)))


def test_reader_table_is_parsed_at_load(tmp_path):
    assert _TINY_PORT.reader == Reader(
        recovery_rank=0
    )  # recovery off by default; the sidecar prepped, the budget asked
    port = load_port(_write(tmp_path, with_reader_table(TINY, 'sidecar = "sc/tiny.safetensors"\nbudget = 30')))
    # the sidecar relative to the port file; the budget a float; the recovery rank left to the sidecar
    assert port.reader == Reader(sidecar=tmp_path / "sc/tiny.safetensors", budget=30.0)


# Wrong types, sizes and misspellings: each is one `error:` line naming the field, not a raw traceback
# (transformers' own error class, an unhashable value, a zero size that fails later) nor, for a
# misspelled key outside [config], silently ignored.
@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.replace('dtype = "float32"', "dtype = []"), "[weights]: field 'dtype' must be str, got list"),
        (lambda t: t.replace('kind = "checkpoint"', 'kind = ["checkpoint"]'), "[tokenizer]: field 'kind' must be str"),
        (
            lambda t: t.replace('[tokenizer]\nkind = "checkpoint"', "").replace(
                'name = "tiny-gemma4-moe"', 'name = "tiny-gemma4-moe"\ntokenizer = "checkpoint"'
            ),
            "field 'tokenizer' must be dict, got str",
        ),
        (
            lambda t: t.replace('dtype = "float32"', 'dtype = "float32"\nseeed = 3'),
            "[weights]: unknown field(s) ['seeed']",
        ),
        (lambda t: t.replace('kind = "checkpoint"', 'knd = "checkpoint"'), "[tokenizer]: unknown field(s) ['knd']"),
        (lambda t: with_reader_table(t, "budjet = 10"), "[reader]: unknown field(s) ['budjet']"),
        (
            lambda t: with_reader_table(t, 'recovery_rank = "full"'),
            "[reader]: field 'recovery_rank' must be int, got str",
        ),
        (lambda t: t.replace("hidden_size = 128", "hidden_size = 0"), "hidden_size = 0 is outside [1, 65536]"),
        (
            lambda t: t.replace("num_attention_heads = 8", "num_attention_heads = -8"),
            "num_attention_heads = -8 is outside",
        ),
        (lambda t: t.replace("top_k_experts = 4", 'top_k_experts = "4"'), "top_k_experts must be an integer, got '4'"),
        (
            lambda t: t.replace('layer_types = ["sliding_attention", "full_attention", ', "layer_types = ["),
            "`num_hidden_layers` (4) must be equal to the number of `layer_types` (2)",
        ),
        (
            lambda t: t.replace("final_logit_softcapping = 30.0", 'final_logit_softcapping = "30"'),
            "Validation error for field 'final_logit_softcapping'",
        ),  # transformers' strict dataclass check
        (
            lambda t: t.replace("num_key_value_heads = 4", "num_key_value_heads = 3"),
            "num_attention_heads 8 is not a multiple of layer 0's key-value heads 3",
        ),
        (lambda t: t.replace('expert_layout = "channel"', "expert_layout = []"), "field 'expert_layout' must be str"),
        (lambda t: t.replace("batch_size = 2", "batch_size = true"), "field 'batch_size' must be int, got bool"),
        (
            lambda t: t.replace("final_logit_softcapping = 30.0", "final_logit_softcapping = nan"),
            "final_logit_softcapping is not a finite number",
        ),
    ],
)
def test_wrong_fields_are_one_error_line(tmp_path, capsys, edit, message):
    text = edit(TINY)
    assert text != TINY
    assert cli.main(["info", "--model", _write(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err and "Traceback" not in err, err


# Absurd sizes (item 9): refused by the port check before anything is built from them.
@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.replace("batch_size = 2", "batch_size = 1_000_000_000"), "batch_size must be in [1, 1024]"),
        (
            lambda t: t.replace("num_hidden_layers = 4", "num_hidden_layers = 200_000").replace(
                'layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]', ""
            ),
            "num_hidden_layers = 200000 is outside [1, 256]",
        ),
        (
            lambda t: t.replace("vocab_size = 2048", "vocab_size = 1_000_000_000_000"),
            "vocab_size = 1000000000000 is outside",
        ),
    ],
)
def test_absurd_sizes_are_refused_at_once(tmp_path, capsys, edit, message):
    text = edit(TINY)
    assert text != TINY
    start = time.perf_counter()
    assert cli.main(["info", "--model", _write(tmp_path, text)]) == 2
    assert message in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # not built, then refused (200,000 meta layers take minutes)


def test_unknown_port_name_lists_the_builtins():
    with pytest.raises(PortError, match="unknown port 'nope'; built-in ports: gemma4-26b-a4b, tiny-gemma4-moe"):
        load_port("nope")


def _source_files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_ports_are_packaged_in_the_wheel(tmp_path):
    """A non-editable install finds the ports: the top-level ports/ ships as neuron_moe.ports, every
    port file and the whole tiny checkpoint."""
    # Built from a copy of what the images' build stage copies (docker/Dockerfile.*): an in-tree
    # build would reuse the checkout's build/lib, where a file since removed from ports/ lingers.
    src = tmp_path / "src"
    for name in ("neuron_moe", "ports"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=src,
        check=True,
    )
    (wheel,) = tmp_path.glob("neuron_moe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Paths inside the wheel: ports/ lands where the import name neuron_moe.ports puts it.
    shipped = {n[len("neuron_moe/ports/") :] for n in names if n.startswith("neuron_moe/ports/")}
    assert shipped == _source_files(ROOT / "ports")
    assert {
        "tiny-gemma4-moe.toml",
        "gemma4-26b-a4b.toml",
        "tiny-gemma4-moe/model.safetensors",
        "tiny-gemma4-moe/tokenizer.json",
        "tiny-gemma4-moe/config.json",
    } <= shipped


def test_a_checkout_with_nothing_installed_finds_its_ports(tmp_path):
    """PYTHONPATH=checkout and no install (the GPU session's way): neuron_moe.ports does not exist,
    and the ports come from the checkout's ports/."""
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
        f"sys.path.insert(0, {str(ROOT)!r}); import importlib.util as u; "
        "assert u.find_spec('neuron_moe.ports') is None; "
        "from neuron_moe.port import builtin_ports, load_port; "
        "print(builtin_ports(), load_port('tiny-gemma4-moe').checkpoint)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{builtin_ports()} {ROOT / 'ports' / 'tiny-gemma4-moe'}"


def test_pyproject_lists_every_package():
    """pyproject.toml lists the packages (find cannot see neuron_moe.ports, mapped from ports/). One
    left out would still ship, as its parent's data, with only a warning: so compare the list itself."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(("neuron_moe",) + Path(f).parent.parts)
        for f in _source_files(ROOT / "neuron_moe")
        if Path(f).name == "__init__.py"
    }
    assert set(setuptools["packages"]) == found | {"neuron_moe.ports"}
    assert setuptools["package-dir"] == {"neuron_moe.ports": "ports"}
