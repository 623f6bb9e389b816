"""entrollm.transformers: entrollm containers as Hugging Face transformers models.

A container (or a checkpoint directory, compressed first) opens as a transformers model of any
architecture transformers has, its linear layers :class:`entrollm.torch.Linear` modules in the
forms the container stores or records, everything else as transformers loads it; ``generate()``
works as for any model. Loading goes through transformers' own ``from_pretrained`` with the
quantization method ``entrollm`` (:class:`EntrollmConfig`, :class:`EntrollmQuantizer`, registered
with ``transformers.quantizers`` when this module is imported)::

    import entrollm.transformers as etf
    model = etf.from_pretrained("model.entrollm")          # AutoModelForCausalLM by default
    # or, the same through transformers:
    from transformers import AutoModelForCausalLM
    cfg = etf.config("model.entrollm")
    sd = etf.state_dict("model.entrollm", transformers.OPTForCausalLM, cfg)
    model = transformers.OPTForCausalLM.from_pretrained(None, config=cfg, state_dict=sd)

CPU only (``entrollm.torch``).
"""

import json
import os
import shutil
import tempfile
import weakref

import torch
import transformers
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

import entrollm

from . import _native
from . import torch as et

__all__ = ["EntrollmConfig", "EntrollmQuantizer", "config", "from_pretrained", "is_container"]


@register_quantization_config("entrollm")
class EntrollmConfig(QuantizationConfigMixin):
    """``quantization_config`` of a model whose weights an entrollm container holds:
    ``{"quant_method": "entrollm", "container": PATH}``."""

    def __init__(self, container=None, **kwargs):
        self.quant_method = "entrollm"
        self.container = None if container is None else os.fspath(container)

    def to_dict(self):
        return {"quant_method": self.quant_method, "container": self.container}


@register_quantizer("entrollm")
class EntrollmQuantizer(HfQuantizer):
    """Loads a model from an entrollm container: before transformers loads weights, each
    ``torch.nn.Linear`` whose matrix the container holds becomes an ``entrollm.torch.Linear``
    of it; after, every other tensor takes the container's values (``entrollm.torch.load_into``,
    which checks each against the manifest and the module's shapes)."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)

    def validate_environment(self, *args, **kwargs):
        path = self.quantization_config.container
        if path is None or not (is_container(path) or path in _ENGINE):
            raise ValueError(f"quantization_config 'entrollm' names no container ({path!r})")
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and any(
                str(d) not in ("cpu", "meta") for d in device_map.values()):
            raise ValueError("entrollm's transformers integration runs on the CPU "
                             f"(device_map {device_map})")

    def update_dtype(self, dtype):
        return dtype

    def param_needs_quantization(self, model, param_name, **kwargs):
        return False

    def _process_model_before_weight_loading(self, model, **kwargs):
        # The skeleton is on the meta device: only modules are swapped here.
        path = self.quantization_config.container
        et._set_linears(model, _linears(model, path))
        model._entrollm_container = path
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if left:
            raise entrollm.EntrollmError(
                f"{self.quantization_config.container}: nothing loaded {', '.join(left[:5])}")
        return model

    def is_serializable(self):
        return False

    @property
    def is_trainable(self):
        return False

    @property
    def is_compileable(self):
        return True


# Models the engine loaded for a from_pretrained under way (a GGUF file or container), by path:
# the quantizer takes their matrices from here.
_ENGINE = {}


def _model_keys(model, names):
    """``{container name: the model's key}`` for the tensors transformers renames as it loads
    them (``embed_out.weight`` → ``lm_head.weight``), by its own renaming rules for ``model``;
    a tensor one of its converters changes (merged, split, permuted) maps to ``None``: it is left
    to transformers, which converts it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 apply_converters, rename_source_key)

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for n in names:
        key = rename_source_key(n, renamings, [], prefix, meta)[0]
        out[n] = None if apply_converters(key, converters)[1] is not None else key
    return out


def _coded_names(model, path, container):
    """``{module name: container tensor name}`` of the linear layers of ``model`` whose matrices
    the container holds."""
    keys = _model_keys(model, container.names())
    by_key = {k: n for n, k in keys.items() if k is not None}
    return {name: by_key[f"{name}.weight"] for name, sub in model.named_modules()
            if isinstance(sub, torch.nn.Linear) and f"{name}.weight" in by_key}


def _linears(model, path):
    """The coded linear modules of ``model`` from ``path`` (see :func:`state_dict`)."""
    if path in _ENGINE:
        matrices = _ENGINE[path][0]
        out = {}
        for name, sub in model.named_modules():
            m = matrices.get(f"{name}.weight")
            if isinstance(sub, torch.nn.Linear) and m is not None:
                if (m.rows, m.cols) != (sub.out_features, sub.in_features):
                    raise entrollm.EntrollmError(f"{path}: matrix {name} is {m.rows}×{m.cols}, "
                                                 f"the model's {sub.out_features}×{sub.in_features}")
                out[name] = et.Linear(m)
        return out
    c = _native.Container(path)
    held = set(c.names())
    out = {}
    for name, cname in _coded_names(model, path, c).items():
        sub = model.get_submodule(name)
        m = c.matrix(cname)
        if (m.rows, m.cols) != (sub.out_features, sub.in_features):
            raise entrollm.EntrollmError(f"{path}: tensor '{cname}' is {m.rows}×{m.cols}, the "
                                         f"model's {name} is {sub.out_features}×{sub.in_features}")
        bias = cname[:-len("weight")] + "bias"
        out[name] = et.Linear(m, et._tensor(c, bias) if bias in held else None)
    return out


def is_container(path):
    """Whether ``path`` is an entrollm container (a directory with ``entrollm.json``)."""
    return os.path.isfile(os.path.join(os.fspath(path), "entrollm.json"))


def _files_dir(container, owner):
    """A directory with the container's verbatim files (config.json, tokenizer files), which
    transformers' loaders read by path; removed with ``owner``."""
    c = _native.Container(container)
    d = tempfile.mkdtemp(prefix="entrollm-hf-")
    weakref.finalize(owner, shutil.rmtree, d, True)
    for name in c.files():
        if "/" in name or name.startswith("."):
            continue
        with open(os.path.join(d, name), "wb") as f:
            f.write(c.file(name))
    if not os.path.exists(os.path.join(d, "config.json")):
        raise entrollm.EntrollmError(f"{container}: no config.json (not a transformers model)")
    return d


class _Holder:
    """Owns temporary directories for as long as a model uses them."""


def config(path, **kwargs):
    """The transformers config of the model in container ``path`` with ``quantization_config``
    naming the container: what ``from_pretrained(None, config=..., state_dict={})`` loads."""
    holder = _Holder()
    d = _files_dir(os.fspath(path), holder)
    cfg = transformers.AutoConfig.from_pretrained(d, **kwargs)
    cfg.quantization_config = EntrollmConfig(container=os.path.abspath(os.fspath(path))).to_dict()
    cfg._entrollm_files = holder
    return cfg


def _engine_state_dict(path, skeleton):
    matrices, vectors = _ENGINE[path]
    out = {}
    linears = {n for n, s in skeleton.named_modules() if isinstance(s, torch.nn.Linear)}
    for name, m in matrices.items():
        if name.rsplit(".", 1)[0] not in linears:  # the embedding: its values
            out[name] = et.decoded_weight(m)
    for name, data in vectors.items():
        out[name] = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return out


def state_dict(path, model_class, cfg):
    """The tensors of the container at ``path`` that transformers loads itself: all but the
    matrices of the linear layers of ``model_class`` (which the quantizer makes coded modules),
    each checked against the manifest."""
    with torch.device("meta"):
        skeleton = model_class(cfg)
    if path in _ENGINE:
        return _engine_state_dict(path, skeleton)
    # Every tensor but the coded matrices, by the container's names: transformers renames and
    # converts them as it does a checkpoint's, and reports what the model lacks.
    c = _native.Container(path)
    coded = set(_coded_names(skeleton, path, c).values())
    return {n: et._tensor(c, n) for n in c.names() if n not in coded}


def from_pretrained(path, model_class=None, dtype="auto", compress_options=None, **kwargs):
    """The model at ``path`` as a transformers model (``model_class``, default
    ``AutoModelForCausalLM``) with entrollm linears. ``path`` is a container, or a checkpoint
    directory that is compressed first (``compress_options``: ``entrollm.compress``'s, e.g.
    ``{"bits": 4}``; lossless by default) into a container kept with the model, or a GGUF file
    or container of one (a Llama-family model the engine loads: its matrices as the engine serves
    them, the GGUF's blocks as stored; ``model._entrollm_tokenizer`` is the engine's tokenizer).
    Other keyword arguments go to transformers' ``from_pretrained``."""
    path = os.path.abspath(os.fspath(path))
    work = None
    if _engine_loads(path):
        if compress_options:
            raise ValueError("compress_options are for a checkpoint directory")
        return _from_engine(path, model_class, **kwargs)
    if not is_container(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise entrollm.EntrollmError(
                f"{path}: neither an entrollm container nor a checkpoint directory")
        work = tempfile.mkdtemp(prefix="entrollm-hf-")
        try:
            out = os.path.join(work, "container")
            entrollm.compress(path, output=out, **(compress_options or {}))
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        path = out
    elif compress_options:
        raise ValueError("compress_options are for a checkpoint directory; this is a container")
    cfg = config(path)
    cls = model_class or transformers.AutoModelForCausalLM
    if hasattr(cls, "_model_mapping"):
        # An Auto class resolves the model class from a path; with none, from the config.
        cls = cls._model_mapping[type(cfg)]
    model = cls.from_pretrained(None, config=cfg, state_dict=state_dict(path, cls, cfg),
                                dtype=dtype, **kwargs)
    model._entrollm_files = cfg._entrollm_files
    if work is not None:
        weakref.finalize(model, shutil.rmtree, work, True)
    return model


def _engine_loads(path):
    """A GGUF file, or a container without config.json (a GGUF's): what the engine loads."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return True
    return is_container(path) and "config.json" not in _native.Container(path).files()


def _from_engine(path, model_class=None, **kwargs):
    """A GGUF file or container of one as a transformers Llama model, loaded by the engine: its
    matrices in the forms the engine serves them in (the GGUF's blocks as stored)."""
    cfg_json, matrices, vectors, tok = _native.engine_model(path)
    cfg = transformers.LlamaConfig(**json.loads(cfg_json))
    cfg.quantization_config = EntrollmConfig(container=path).to_dict()
    cls = model_class or transformers.LlamaForCausalLM
    if hasattr(cls, "_model_mapping"):
        cls = cls._model_mapping[type(cfg)]
    _ENGINE[path] = (dict(matrices), dict(vectors))
    try:
        model = cls.from_pretrained(None, config=cfg, state_dict=state_dict(path, cls, cfg),
                                    dtype=torch.float32, **kwargs)
    finally:
        del _ENGINE[path]
    model._entrollm_tokenizer = tok
    return model


def tokenizer(path, **kwargs):
    """The tokenizer a container keeps (``AutoTokenizer`` over its verbatim files)."""
    holder = _Holder()
    d = _files_dir(os.fspath(path), holder)
    tok = transformers.AutoTokenizer.from_pretrained(d, **kwargs)
    tok._entrollm_files = holder
    return tok
