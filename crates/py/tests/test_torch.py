"""entrollm.torch.Linear in every weight form against torch.nn.functional.linear of its decoded
weight: batch 1 (the form's fused decode-matvec, within the tolerance the Rust forms' tests use:
1e-4 of the largest output) and batch > 1 (decoded to a workspace, then torch's product: bit for
bit), on ragged shapes; lossless forms give back the source bit for bit; torch.compile traces the
custom op."""

import copy
import zlib

import pytest
import torch
import torch.nn.functional as F

import entrollm
import entrollm.torch as et

# GGUF block layouts: weights a block, bytes a block, byte offsets of its f16 scales.
BLOCKS = {
    "Q4_0": (32, 18, [0]),
    "Q4_1": (32, 20, [0, 2]),
    "Q8_0": (32, 34, [0]),
    "Q4_K": (256, 144, [0, 2]),
    "Q5_K": (256, 176, [0, 2]),
    "Q6_K": (256, 210, [208]),
}


def seed(*what):
    """A generator seeded from the test's parameters (the same every run)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(what).encode()))


def ggml_blocks(ty, rows, cols, gen):
    """Random blocks of `ty`: random codes, scales of a plausible size (any bytes are valid codes)."""
    per, size, halves = BLOCKS[ty]
    assert cols % per == 0
    n = rows * cols // per
    b = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=gen)
    for off in halves:
        s = (torch.rand(n, generator=gen) * 0.02 + 0.001).to(torch.float16)
        b[:, off:off + 2] = s.view(torch.uint8).reshape(n, 2)
    return b.reshape(-1)


def weight(rows, cols, dtype, gen):
    w = torch.randn(rows, cols, generator=gen) * 0.05
    return w.to(dtype)


def check_products(lin, gen, bias=None):
    """The module's outputs against F.linear of its decoded weight, batch 1 and > 1."""
    w = lin.decoded_weight()
    assert w.shape == (lin.out_features, lin.in_features) and w.dtype == torch.float32
    for n in [1, 2, 7]:
        x = torch.randn(n, lin.in_features, generator=gen)
        y = lin(x)
        want = F.linear(x, w, bias)
        assert y.shape == want.shape and y.dtype == torch.float32
        if n == 1:
            # The Rust CPU product (eight partial sums in a fixed order, not torch's).
            scale = max(want.abs().max().item(), 1e-3)
            assert (y - want).abs().max().item() <= 1e-4 * scale, lin
        else:
            assert torch.equal(y, want), lin
    # Leading dimensions are kept; a bf16 input gives a bf16 output, batch > 1 bit for bit.
    x = torch.randn(2, 3, lin.in_features, generator=gen).to(torch.bfloat16)
    y = lin(x)
    assert y.shape == (2, 3, lin.out_features) and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, w.to(torch.bfloat16), None if bias is None
                                   else bias.to(torch.bfloat16)))
    one = lin(x[:1, :1])
    assert one.shape == (1, 1, lin.out_features)


SHAPES = [(203, 448), (67, 1088), (1, 320)]

# (dtype of the source, form, variant or None for the smallest the form offers)
FLOAT_FORMS = [
    (torch.bfloat16, "dense", None),
    (torch.bfloat16, "dense", "f32"),
    (torch.bfloat16, "dtans", None),
    (torch.bfloat16, "df11", None),
    (torch.bfloat16, "pal-bf16", None),
    (torch.float16, "dense", None),
    (torch.float16, "dtans", None),
    (torch.float32, "dense", None),
    (torch.float8_e4m3fn, "dense", None),
    (torch.float8_e4m3fn, "dtans", None),
    (torch.float8_e4m3fn, "pal-fp8", None),
]


@pytest.mark.parametrize("dtype,form,variant", FLOAT_FORMS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_lossless_forms_multiply_as_their_decoded_weight_and_give_back_the_source(
        dtype, form, variant, shape):
    gen = seed(str(dtype), form, shape)
    rows, cols = shape
    src = torch.nn.Linear(cols, rows, bias=True)
    with torch.no_grad():
        src.weight.copy_(weight(rows, cols, torch.float32, gen))
    w = weight(rows, cols, dtype, gen)
    lin = et.Linear(et.matrix_of(w, form=form, variant=variant), bias=src.bias)
    assert lin.form == form
    if variant is not None:
        assert lin.variant == variant
    # Lossless: the values held are the source's, bit for bit, and decode to it exactly.
    got = lin.values()
    if variant == "f32":  # widened exactly
        assert got.dtype == torch.float32 and torch.equal(got, w.float())
    else:
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(lin.decoded_weight(), w.to(torch.float32))
    check_products(lin, gen, bias=src.bias.detach())


def test_coded_forms_are_smaller_than_the_source():
    gen = torch.Generator().manual_seed(5)
    w = weight(256, 1024, torch.bfloat16, gen)
    for form in ["dtans", "df11", "pal-bf16"]:
        m = et.matrix_of(w, form=form)
        assert m.stored_bytes < w.numel() * 2, (form, m.stored_bytes)
    assert et.variants(w, "dtans")[0][1] < w.numel() * 2


@pytest.mark.parametrize("ty,form", [
    ("Q4_0", "ggml"), ("Q4_1", "ggml"), ("Q8_0", "ggml"), ("Q4_K", "ggml"), ("Q5_K", "ggml"),
    ("Q6_K", "ggml"), ("Q4_0", "int"), ("Q4_1", "int"), ("Q8_0", "int"), ("Q4_1", "dtans"),
])
@pytest.mark.parametrize("rows", [1, 37])
def test_gguf_blocks_in_their_forms(ty, form, rows):
    gen = seed(ty, form, rows)
    cols = BLOCKS[ty][0] * 3
    blocks = ggml_blocks(ty, rows, cols, gen)
    lin = et.Linear.from_ggml(ty, blocks, rows, cols, form=form)
    assert lin.form == form
    as_stored = et.Linear.from_ggml(ty, bytes(blocks.numpy()), rows, cols, form="ggml")
    # The blocks as stored come back byte for byte; every form decodes them to the same weights.
    assert torch.equal(as_stored.values(), blocks)
    assert torch.equal(lin.decoded_weight(), as_stored.decoded_weight())
    assert torch.isfinite(lin.decoded_weight()).all() and lin.decoded_weight().abs().max() > 0
    check_products(lin, gen)


@pytest.mark.parametrize("quantizer", ["tcq32", "e8"])
@pytest.mark.parametrize("shape", [(45, 512), (128, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_lossy_at_a_rate(quantizer, shape):
    gen = seed(quantizer, shape)
    rows, cols = shape
    w = weight(rows, cols, torch.bfloat16, gen)
    lin = et.Linear(et.matrix_of(w, form="lossy", bits=4, quantizer=quantizer))
    assert lin.form == "lossy" and lin.variant.startswith(quantizer[:3])
    # About the rate asked for, and a reconstruction near the source (4 bits: a few percent).
    assert lin.stored_bytes * 8 / w.numel() < 5.0
    d = lin.decoded_weight()
    rel = ((d - w.float()).norm() / w.float().norm()).item()
    assert 0 < rel < 0.15, rel
    # What it holds is the reconstruction in the source's dtype.
    assert torch.equal(lin.values().float(), d)
    check_products(lin, gen)


def test_from_linear_replaces_a_torch_linear():
    gen = torch.Generator().manual_seed(9)
    src = torch.nn.Linear(448, 96).to(torch.bfloat16)
    lin = et.Linear.from_linear(src, form="df11")
    assert torch.equal(lin.values().view(torch.int16), src.weight.detach().view(torch.int16))
    assert torch.equal(lin.bias, src.bias)
    x = torch.randn(5, 448, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(x), src(x))
    assert "form=df11" in repr(lin)
    twin = copy.deepcopy(lin)
    assert twin.matrix is lin.matrix and torch.equal(twin(x), lin(x))


def test_bad_inputs_are_errors_not_crashes():
    w = torch.randn(16, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="unknown weight form"):
        et.matrix_of(w, form="no-such-form")
    with pytest.raises(entrollm.EntrollmError, match="cannot hold"):
        et.matrix_of(w.float(), form="df11")
    with pytest.raises(ValueError, match="dtype"):
        et.matrix_of(w.to(torch.int32), form="dense")
    with pytest.raises(ValueError, match="bits"):
        et.matrix_of(w, form="lossy")
    with pytest.raises(ValueError, match="unknown ggml type"):
        et.Linear.from_ggml("Q9_9", bytes(18), 1, 32)
    with pytest.raises(entrollm.EntrollmError):
        et.Linear.from_ggml("Q4_0", bytes(17), 1, 32)  # not whole blocks
    lin = et.Linear(et.matrix_of(w, form="dense"))
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(2, 63))


def test_torch_compile_traces_the_custom_op_and_matches_eager():
    gen = torch.Generator().manual_seed(11)
    model = torch.nn.Sequential(
        torch.nn.Linear(320, 448), torch.nn.GELU(), torch.nn.Linear(448, 130)).to(torch.bfloat16)
    coded = torch.nn.Sequential(
        et.Linear.from_linear(model[0], form="dtans"), torch.nn.GELU(),
        et.Linear.from_linear(model[2], form="df11"))
    compiled = torch.compile(coded, fullgraph=True)
    for n in [1, 6]:
        x = torch.randn(n, 320, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            eager = coded(x)
            got = compiled(x)
        torch.testing.assert_close(got, eager, rtol=0, atol=0)
    # Batch > 1 is the uncompressed model's output exactly.
    with torch.no_grad():
        assert torch.equal(coded(x), model(x))
