"""entrollm.torch.compress_module / save / load_into: a module tree's linears coded through a
container, round trips, and the container the CLI writes for the same checkpoint and options."""

import copy
import os
import subprocess
from pathlib import Path

import pytest
import torch

import entrollm
import entrollm.torch as et
from test_commands import binary, same_tree


class Block(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(Block(128, 320), Block(128, 320), torch.nn.Linear(128, 72))
    return m.to(torch.bfloat16).eval()


def coded_linears(m):
    return {n: s for n, s in m.named_modules() if isinstance(s, et.Linear)}


@pytest.mark.parametrize("form", [None, "dtans", "df11"])
def test_lossless_compress_module_keeps_every_output_and_round_trips(tmp_path, form):
    src = model()
    m = et.compress_module(copy.deepcopy(src), form=form, min_elements=0)
    lin = coded_linears(m)
    assert set(lin) == {"0.up", "0.down", "1.up", "1.down", "2"}
    if form is not None:
        assert {l.form for l in lin.values()} == {form}
    for name, l in lin.items():
        want = src.get_submodule(name).weight.detach()
        assert torch.equal(l.values().view(torch.int16), want.view(torch.int16)), name
    x = torch.randn(5, 128).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(m(x), src(x))
    path = et.save(m, tmp_path / "saved")
    fresh = et.load_into(model(seed=1), path)
    with torch.no_grad():
        assert torch.equal(fresh(x), src(x))
        one = x[:1]
        assert torch.equal(fresh(one), m(one))
    assert {n: (l.form, l.variant) for n, l in coded_linears(fresh).items()} == {
        n: (l.form, l.variant) for n, l in lin.items()}


@pytest.mark.parametrize("options", [{}, {"coder": "df11"}, {"bits": 4}],
                         ids=["default", "df11", "bits4"])
def test_a_module_compressed_from_python_is_the_clis_container(tmp_path, options):
    src = model()
    ckpt = et.write_checkpoint(src, tmp_path / "ckpt")
    cli = tmp_path / "cli"
    args = [binary(), "compress", str(ckpt), "-o", str(cli)]
    for k, v in options.items():
        args += [f"--{k}", str(v)]
    subprocess.run(args, check=True, capture_output=True)
    form = options.get("coder")
    m = et.compress_module(copy.deepcopy(src), form=form, bits=options.get("bits"))
    ours = et.save(m, tmp_path / "py")
    assert same_tree(Path(ours), cli)
    if "bits" in options:
        lossy = [l for l in coded_linears(m).values() if l.form == "lossy"]
        assert lossy, "--bits 4 codes the larger matrices lossily"
        x = torch.randn(3, 128).to(torch.bfloat16)
        with torch.no_grad():
            got, want = m(x).float(), src(x).float()
        assert ((got - want).norm() / want.norm()).item() < 0.1


def test_load_into_refuses_another_architecture_and_leaves_it_unchanged(tmp_path):
    m = et.compress_module(model(), min_elements=0)
    path = et.save(m, tmp_path / "c")
    other = torch.nn.Sequential(Block(128, 256), Block(128, 256), torch.nn.Linear(128, 72))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(entrollm.EntrollmError, match="0.up.weight"):
        et.load_into(other, path)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert not coded_linears(other)


def test_save_refuses_a_changed_module_and_an_existing_path(tmp_path):
    m = et.compress_module(model(), min_elements=0)
    (tmp_path / "taken").mkdir()
    with pytest.raises(entrollm.EntrollmError, match="overwrite"):
        et.save(m, tmp_path / "taken")
    et.save(m, tmp_path / "taken", overwrite=True)
    assert (tmp_path / "taken" / "entrollm.json").exists()
    with torch.no_grad():
        m[0].norm.weight.add_(1)
    with pytest.raises(ValueError, match="0.norm.weight"):
        et.save(m, tmp_path / "again")
    assert not os.path.exists(tmp_path / "again")
    with pytest.raises(ValueError, match="compress_module"):
        et.save(model(), tmp_path / "never")


def test_a_damaged_container_is_an_error_naming_the_file(tmp_path):
    m = et.compress_module(model(), min_elements=0)
    path = Path(et.save(m, tmp_path / "c"))
    shard = next(p for p in path.iterdir() if p.name != "entrollm.json" and p.is_file()
                 and p.stat().st_size > 10000)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(entrollm.EntrollmError) as e:
        et.load_into(model(seed=2), path)
    assert str(path) in str(e.value) and "tensor" in str(e.value)
