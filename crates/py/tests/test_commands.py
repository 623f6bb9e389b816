"""The Python package's commands against the binary's: the same bytes, the same errors.

Needs ENTROLLM_BIN (the `entrollm` binary of the same checkout: scripts/test-python sets it).
"""

import filecmp
import json
import os
import subprocess
from pathlib import Path

import pytest

import entrollm

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "crates/model/tests/data/families/qwen3-bf16"


def binary():
    b = os.environ.get("ENTROLLM_BIN")
    assert b, "set ENTROLLM_BIN to the entrollm binary of this checkout (scripts/test-python does)"
    return b


def same_tree(a: Path, b: Path):
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), f"{n} differs"
    return names


def test_compress_writes_the_binarys_container_and_decompress_restores_the_source(tmp_path):
    ours, theirs = tmp_path / "py.entrollm", tmp_path / "cli.entrollm"
    entrollm.compress(SRC, output=ours, threads=2)
    subprocess.run([binary(), "compress", str(SRC), "-o", str(theirs), "-t", "2"], check=True,
                   capture_output=True)
    files = same_tree(ours, theirs)
    assert any(str(n).endswith(".json") for n in files)
    restored = tmp_path / "restored"
    entrollm.decompress(ours, output=restored)
    for name in ["model.safetensors", "config.json", "tokenizer.json"]:
        assert filecmp.cmp(SRC / name, restored / name, shallow=False), name


def test_inspect_returns_the_binarys_json(tmp_path):
    got = entrollm.inspect(SRC)
    want = json.loads(subprocess.run([binary(), "inspect", str(SRC), "--json"], check=True,
                                     capture_output=True).stdout)
    assert got == want
    assert got  # the checkpoint's tensors are listed


def test_a_failed_command_raises_with_the_commands_message(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(entrollm.EntrollmError) as e:
        entrollm.compress(missing, output=tmp_path / "out")
    assert str(missing) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_refused_until_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(entrollm.EntrollmError, match="--overwrite"):
        entrollm.compress(SRC, output=out)
    assert (out / "keep.txt").read_text() == "mine"
    entrollm.compress(SRC, output=out, overwrite=True)
    assert (out / "entrollm.json").exists()


def test_an_unknown_option_is_a_value_error_with_the_usage():
    with pytest.raises(ValueError, match="--no-such-flag"):
        entrollm.compress(SRC, output="x", no_such_flag=3)


def test_the_server_is_refused_in_process():
    with pytest.raises(entrollm.EntrollmError, match="subprocess"):
        entrollm.command("serve", SRC)
