"""entrollm.torch: PyTorch modules whose weights stay in entrollm's weight forms.

:class:`Linear` replaces a ``torch.nn.Linear``: its matrix is held in a weight form (lossless
``dtans``, ``df11``, ``pal-bf16``/``pal-fp8``, ``dense``; GGUF blocks as stored, ``ggml`` or
``int``; ``lossy`` at a rate) and its forward runs the form's Rust CPU code:

* one input row (batch 1, a decode step): the form's fused decode-in-GEMV (the matrix is never
  materialised), in f32, the result cast to the input's dtype;
* more rows: the matrix decoded to a workspace and ``torch.nn.functional.linear`` in the input's
  dtype, so the output is bit for bit that of a ``torch.nn.Linear`` holding the decoded weight.

The forward is the custom op ``torch.ops.entrollm.linear`` (``torch.library``) with a fake kernel,
so ``torch.compile`` traces a model of these modules. CPU tensors only.

    import torch, entrollm.torch as et
    lin = et.Linear.from_linear(torch.nn.Linear(4096, 4096).bfloat16(), form="dtans")
    y = lin(torch.randn(1, 4096, dtype=torch.bfloat16))
"""

import itertools
import os
import shutil
import tempfile
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

import entrollm

from . import _native
from ._native import EntrollmError, Matrix

__all__ = ["Linear", "Matrix", "forms", "variants", "linear", "matrix_of", "compress_module",
           "load_into", "save", "write_checkpoint"]

# torch dtype ↔ the forms' name of its values.
_KINDS = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8",
}
_DTYPES = {kind: dtype for dtype, kind in _KINDS.items()}


def forms():
    """The weight forms' names (docs/forms.md)."""
    return list(_native.form_names())


def _kind(t):
    try:
        return _KINDS[t.dtype]
    except KeyError:
        raise ValueError(f"weights of dtype {t.dtype}: expected one of "
                         f"{', '.join(str(d) for d in _KINDS)}") from None


def _host(t):
    """`t` as a contiguous CPU tensor (the caller keeps it alive while Rust reads it)."""
    if t.device.type != "cpu":
        raise ValueError(f"entrollm.torch runs on CPU tensors, not {t.device}")
    return t.detach().contiguous()


def _matrix_args(weight):
    if weight.dim() != 2:
        raise ValueError(f"a weight matrix has 2 dimensions, not {weight.dim()}")
    w = _host(weight)
    return w, (w.shape[0], w.shape[1], _kind(w), w.data_ptr(), w.numel() * w.element_size())


def variants(weight, form):
    """``[(variant, predicted bytes)]`` that ``form`` offers for ``weight``, smallest first."""
    w, args = _matrix_args(weight)
    return _native.variants(form, *args)


# Custom ops take tensors and numbers, not Python objects: a module's matrix is passed as a handle
# into this table, which holds it as long as its module does.
_MATRICES = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _register(matrix):
    h = next(_HANDLES)
    _MATRICES[h] = matrix
    return h


@torch.library.custom_op("entrollm::linear", mutates_args=(), device_types="cpu")
def linear(x: torch.Tensor, matrix: int, out_features: int,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ Wᵀ + bias`` for the matrix of handle ``matrix`` (see :class:`Linear`)."""
    m = _MATRICES[matrix]
    if x.shape[-1] != m.cols:
        raise ValueError(f"input of {x.shape[-1]} features for a {m.rows}×{m.cols} matrix")
    lead = x.shape[:-1]
    x2 = _host(x).reshape(-1, m.cols)
    n = x2.shape[0]
    if n == 1:
        xf = x2.to(torch.float32).contiguous()
        y = torch.empty(1, m.rows, dtype=torch.float32, device="cpu")
        m.matmul(xf.data_ptr(), 1, y.data_ptr())
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*lead, m.rows)
    w = torch.empty(m.rows, m.cols, dtype=torch.float32, device="cpu")
    m.decode_into(w.data_ptr())
    # On the input as it came (not flattened): torch picks its kernel by shape, and this is the
    # call a torch.nn.Linear makes, so the output is its bit for bit.
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


@linear.register_fake
def _(x, matrix, out_features, bias=None):
    return x.new_empty(*x.shape[:-1], out_features)


class Linear(torch.nn.Module):
    """A linear layer whose matrix is an entrollm :class:`Matrix` (a weight form); see the
    module's doc for its forward. Build it from a ``torch.nn.Linear`` with :meth:`from_linear`,
    from GGUF blocks with :meth:`from_ggml`, or from a matrix read from a container."""

    def __init__(self, matrix, bias=None):
        super().__init__()
        if not isinstance(matrix, Matrix):
            raise TypeError(f"expected an entrollm Matrix, not {type(matrix).__name__}")
        self.matrix = matrix
        self.in_features = matrix.cols
        self.out_features = matrix.rows
        self._handle = _register(matrix)
        if bias is not None:
            if tuple(bias.shape) != (matrix.rows,):
                raise ValueError(f"a bias of shape {tuple(bias.shape)} for {matrix.rows} rows")
            bias = torch.nn.Parameter(_host(bias).clone(), requires_grad=False)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear, form="dtans", variant=None, bits=None, quantizer="tcq32"):
        """``linear``'s matrix in ``form`` (its ``variant``; None: the smallest the form offers),
        exactly; with ``form="lossy"``, coded at ``bits`` a weight by ``quantizer`` as
        ``compress --bits`` codes it. The bias is kept as it is."""
        matrix = matrix_of(linear.weight, form=form, variant=variant, bits=bits,
                           quantizer=quantizer)
        return cls(matrix, linear.bias)

    @classmethod
    def from_ggml(cls, ggml_type, blocks, rows, cols, form="ggml", variant=None, bias=None):
        """A ``rows × cols`` matrix of GGUF blocks of ``ggml_type`` (``"Q4_K"``; ``blocks``: the
        tensor's bytes as the file stores them, a ``torch.uint8`` tensor or ``bytes``) held in
        ``form``: ``ggml`` (the blocks as stored), ``int`` (legacy types' codes), ``dtans``."""
        if isinstance(blocks, (bytes, bytearray)):
            blocks = torch.frombuffer(bytearray(blocks), dtype=torch.uint8)
        b = _host(blocks).view(torch.uint8).reshape(-1)
        m = Matrix.encode(form, variant, rows, cols, f"ggml:{ggml_type}", b.data_ptr(), b.numel())
        return cls(m, bias)

    def __deepcopy__(self, memo):
        # A matrix is immutable: copies share it (a Matrix has no copy of its own).
        bias = None if self.bias is None else self.bias.detach().clone()
        new = Linear(self.matrix, bias)
        new.__dict__.update({k: v for k, v in self.__dict__.items()
                             if k.startswith("_entrollm")})
        memo[id(self)] = new
        return new

    @property
    def form(self):
        return self.matrix.form

    @property
    def variant(self):
        return self.matrix.variant

    @property
    def stored_bytes(self):
        return self.matrix.stored_bytes

    def forward(self, x):
        return torch.ops.entrollm.linear(x, self._handle, self.out_features, self.bias)

    def decoded_weight(self):
        """The matrix decoded to f32: what every product multiplies (for a lossless form, the
        source values widened exactly)."""
        return decoded_weight(self.matrix)

    def values(self):
        """The exact values held, as a tensor of their dtype (bf16, f16, f32, float8_e4m3fn);
        GGUF blocks as a ``torch.uint8`` tensor of their bytes; integer codes with group scales
        (no torch dtype) as their f32 values."""
        return values_of(self.matrix)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, form={self.matrix.form}"
                f"{':' + self.matrix.variant if self.matrix.variant else ''}, "
                f"stored_bytes={self.matrix.stored_bytes}")


def matrix_of(weight, form="dtans", variant=None, bits=None, quantizer="tcq32"):
    """``weight`` (a 2-D CPU tensor) as a :class:`Matrix` in ``form`` (see
    :meth:`Linear.from_linear`)."""
    w, args = _matrix_args(weight)
    if form == "lossy":
        if bits is None:
            raise ValueError("form='lossy' needs bits (stored bits a weight, e.g. 4)")
        if variant is not None:
            raise ValueError("form='lossy' takes quantizer=..., not a variant")
        return Matrix.lossy(*args, float(bits), quantizer)
    if bits is not None:
        raise ValueError(f"bits= is for form='lossy'; form {form!r} is exact")
    return Matrix.encode(form, variant, *args)


def decoded_weight(matrix):
    w = torch.empty(matrix.rows, matrix.cols, dtype=torch.float32, device="cpu")
    matrix.decode_into(w.data_ptr())
    return w


def values_of(matrix):
    got = matrix.values()
    if got is None:
        return decoded_weight(matrix)
    kind, data = got
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if kind.startswith("ggml:"):
        return raw
    return raw.view(_DTYPES[kind]).reshape(matrix.rows, matrix.cols)


# ---- module trees and containers ----

_CODERS = ("dtans", "df11")


def write_checkpoint(module, path):
    """Writes ``module``'s tensors as the checkpoint ``compress_module`` compresses: a Hugging
    Face model through its ``save_pretrained`` (safetensors, config.json), any other module as a
    ``.safetensors`` file of its ``state_dict``. Returns the path to compress."""
    import safetensors.torch

    if hasattr(module, "save_pretrained") and hasattr(module, "config"):
        module.save_pretrained(path, safe_serialization=True)
        return path
    os.makedirs(path, exist_ok=True)
    state = {k: _host(v).clone() for k, v in module.state_dict().items()}
    file = os.path.join(path, "model.safetensors")
    safetensors.torch.save_file(state, file)
    return file


def compress_module(module, form=None, bits=None, budget=None, **options):
    """Codes ``module``'s linear layers (any module tree) as ``entrollm compress`` codes a
    checkpoint and replaces each ``torch.nn.Linear`` by a :class:`Linear` in the form it is
    stored or served in: ``form=None`` as the command does by default (lossless), ``"dtans"`` or
    ``"df11"`` that coder (``--coder``), ``bits=R`` lossy at R bits a weight (``--bits``; with
    ``quantizer="e8"`` …), ``budget="2GB"`` the forms a plan chooses (``--budget``, for models the
    engine knows). Other keyword arguments are the command's options (``min_elements=0``,
    ``threads=2``). The container it writes stays with the module: :func:`save` writes it.
    Returns ``module``."""
    if form is not None and form not in _CODERS:
        raise ValueError(f"form={form!r}: a container codes with {' or '.join(_CODERS)}; other "
                         "forms are made in memory by Linear.from_linear or chosen by budget=")
    for key, value in (("coder", form), ("bits", bits), ("budget", budget)):
        if value is not None:
            options[key] = value
    work = tempfile.mkdtemp(prefix="entrollm-module-")
    try:
        src = write_checkpoint(module, os.path.join(work, "checkpoint"))
        out = os.path.join(work, "container")
        entrollm.compress(src, output=out, **options)
        shutil.rmtree(os.path.join(work, "checkpoint"))
        load_into(module, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    weakref.finalize(module, shutil.rmtree, work, True)
    return module


def _parent(root, name):
    *path, leaf = name.split(".")
    parent = root
    for p in path:
        parent = getattr(parent, p)
    return parent, leaf


def _tensor(container, name):
    kind, shape, data = container.tensor(name)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)
    return raw.view(_DTYPES[kind]).reshape(shape)


def _coded_linears(module, container, path):
    """The coded :class:`Linear` for each linear layer of ``module`` whose matrix the container
    holds (read and checked, ``module`` unchanged)."""
    held = set(container.names())
    linears = {}
    for name, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Linear, Linear)) and f"{name}.weight" in held:
            if name == "":
                raise ValueError("load_into takes a module tree, not a lone linear layer")
            m = container.matrix(f"{name}.weight")
            if (m.rows, m.cols) != (sub.out_features, sub.in_features):
                raise EntrollmError(f"{path}: tensor '{name}.weight' is {m.rows}×{m.cols}, the "
                                    f"module's {name} is {sub.out_features}×{sub.in_features}")
            bias = _tensor(container, f"{name}.bias") if f"{name}.bias" in held else None
            if (bias is None) != (sub.bias is None):
                raise EntrollmError(f"{path}: module {name} "
                                    f"{'has a' if sub.bias is not None else 'has no'} bias, the "
                                    f"container {'lacks' if bias is None else 'holds'} '{name}.bias'")
            linears[name] = Linear(m, bias)
            linears[name]._entrollm_container = path
    return linears


def _other_tensors(module, container, path, coded):
    """The container's values of every parameter and buffer of ``module`` outside the linear
    layers ``coded``; a tensor tied to one the container holds (a tied LM head) is left to it."""
    held = set(container.names())
    state = module.state_dict(keep_vars=True)
    by_storage = {}
    for key, value in state.items():
        by_storage.setdefault(id(value), []).append(key)
    tensors = {}
    for key, value in state.items():
        if any(key.startswith(f"{n}.") for n in coded):
            continue
        if key not in held:
            if any(k in held for k in by_storage[id(value)]):
                continue
            raise EntrollmError(f"{path}: the container holds no tensor '{key}'")
        t = _tensor(container, key)
        if tuple(t.shape) != tuple(value.shape):
            raise EntrollmError(f"{path}: tensor '{key}' has shape {tuple(t.shape)}, the "
                                f"module's {tuple(value.shape)}")
        tensors[key] = t
    return tensors


def _set_linears(module, linears):
    for name, lin in linears.items():
        parent, leaf = _parent(module, name)
        setattr(parent, leaf, lin)


def load_into(module, path):
    """Loads the container at ``path`` into ``module`` (the tree it was compressed from, or one of
    the same architecture): each ``torch.nn.Linear`` (or :class:`Linear`) whose weight the
    container holds becomes a :class:`Linear` of that matrix in the form the container stores or
    records it in; every other parameter and buffer takes the container's values (one tied to a
    tensor the container holds, as a tied LM head, follows it). Everything is read and checked
    before ``module`` is changed; a tensor the container lacks, or of another shape, is an error
    naming it. Returns ``module``."""
    path = os.fspath(path)
    container = _native.Container(path)
    linears = _coded_linears(module, container, path)
    tensors = _other_tensors(module, container, path, linears)
    _set_linears(module, linears)
    with torch.no_grad():
        state = module.state_dict(keep_vars=True)
        for key, t in tensors.items():
            state[key].copy_(t.to(state[key].dtype))
    module._entrollm_container = path
    return module


def save(module, path, overwrite=False):
    """Writes the container ``module``'s coded linears were loaded from (:func:`compress_module`
    or :func:`load_into`) to ``path``, byte for byte, after checking the module still holds it:
    every coded linear from that container, every other tensor equal to the container's."""
    src = getattr(module, "_entrollm_container", None)
    if src is None:
        raise ValueError("this module was not coded by compress_module or loaded by load_into")
    container = _native.Container(src)
    held = set(container.names())
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear):
            if f"{name}.weight" in held:
                raise ValueError(f"module {name} is no longer the coded linear the container holds")
        elif isinstance(sub, Linear) and getattr(sub, "_entrollm_container", None) != src:
            raise ValueError(f"module {name} was not loaded from {src}")
    coded = {n for n, s in module.named_modules() if isinstance(s, Linear)}
    for key, value in module.state_dict().items():
        if key.rsplit(".", 1)[0] in coded:
            continue
        if key not in held or not torch.equal(_tensor(container, key).to(value.dtype), value):
            raise ValueError(f"tensor {key} differs from the container's: the module changed "
                             "since it was coded; compress it again")
    path = os.fspath(path)
    if os.path.lexists(path):
        if not overwrite:
            raise EntrollmError(f"{path} exists: give overwrite=True to replace it")
    tmp = tempfile.mkdtemp(prefix=".entrollm-save-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        out = os.path.join(tmp, "container")
        shutil.copytree(src, out)
        if os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.rename(out, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
