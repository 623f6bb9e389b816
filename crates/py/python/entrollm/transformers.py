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
import logging
import os
import re
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
    """Loads a model from an entrollm container. Before transformers reads the shards, each
    ``torch.nn.Linear`` whose matrix the container holds becomes an ``entrollm.torch.Linear``
    of it (on the meta skeleton); transformers then loads the plain tensors from the shards
    itself (its renaming rules apply), leaving the coded arrays, which it does not know; after,
    the quantizer gives the tensors the container codes outside linear layers (an embedding)
    their decoded values. A GGUF's container is read by the engine's loader instead
    (Llama-family models: the matrices as the engine serves them, norms and embeddings f32)."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._fill = {}
        self._quiet = None

    def validate_environment(self, *args, **kwargs):
        path = self.quantization_config.container
        if path is not None and not (is_container(path) or path in _ENGINE):
            raise ValueError(f"quantization_config 'entrollm' names no container ({path!r})")
        device_map = kwargs.get("device_map")
        places = (device_map.values() if isinstance(device_map, dict)
                  else [] if device_map in (None, "auto") else [device_map])
        if any(str(d) not in ("cpu", "meta") for d in places):
            raise ValueError("entrollm's transformers integration runs on the CPU "
                             f"(device_map {device_map})")

    def update_device_map(self, device_map):
        if device_map == "auto":
            # The modules run on the CPU: accelerate places every layer there.
            return {"": "cpu"}
        return device_map

    def update_dtype(self, dtype):
        return dtype

    def param_needs_quantization(self, model, param_name, **kwargs):
        return False

    def _container(self, checkpoint_files):
        path = self.quantization_config.container
        if path is None:
            # from_pretrained(CONTAINER): the shards config.json names are the container's.
            if not checkpoint_files:
                raise ValueError("quantization_config 'entrollm' without a container")
            path = os.path.dirname(os.path.abspath(checkpoint_files[0]))
            if not is_container(path):
                raise entrollm.EntrollmError(f"{path}: not an entrollm container")
            self.quantization_config.container = path
        return path

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        # The skeleton is on the meta device: only modules are swapped here.
        path = self._container(checkpoint_files)
        if path in _ENGINE or _engine_loads(path):
            linears, self._fill, ignore = _engine_parts(model, path)
        else:
            linears, self._fill, ignore = _container_parts(model, path)
        et._set_linears(model, linears)
        # What transformers finds in the shards but does not load (coded arrays, a GGUF's
        # tensors) and what it cannot find there (the tensors filled after loading) are ours.
        model._keys_to_ignore_on_load_unexpected = (
            set(model._keys_to_ignore_on_load_unexpected or ()) | {ignore})
        ours = set(self._fill)
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            if source in ours or target in ours:
                ours |= {source, target}
        model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | {
            "^" + re.escape(k) + "$" for k in ours}
        # transformers ties an LM head to its embedding before the quantizer fills the embedding,
        # and warns that both are absent: true of the shards, not of the container.
        self._quiet = _TiedFilter(ours)
        _MODELING_LOGGER.addFilter(self._quiet)
        model._entrollm_container = path
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        _MODELING_LOGGER.removeFilter(self._quiet)
        state = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, fill in self._fill.items():
                t = fill()
                if tuple(t.shape) != tuple(state[key].shape):
                    raise entrollm.EntrollmError(
                        f"{model._entrollm_container}: tensor '{key}' has shape "
                        f"{tuple(t.shape)}, the model's {tuple(state[key].shape)}")
                state[key].copy_(t.to(state[key].dtype))
        self._fill = {}
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


_MODELING_LOGGER = logging.getLogger("transformers.modeling_utils")


class _TiedFilter(logging.Filter):
    """Drops transformers' warning that tied tensors are absent from the checkpoint for the
    tensors the quantizer fills itself (``keys``)."""

    def __init__(self, keys):
        super().__init__()
        self.keys = keys

    def filter(self, record):
        msg = record.getMessage()
        return not ("both are absent" in msg and any(k in msg for k in self.keys))


def _container_parts(model, path):
    """``(coded linears, {model key: values}, unexpected-key pattern)`` of a container of a
    checkpoint for ``model``: the linear layers whose matrices it holds, the other tensors it
    codes (given their decoded values after loading; transformers reads the plain ones)."""
    c = _native.Container(path)
    linears = _linears(model, path)
    coded_linears = {f"{n}.weight" for n in linears}
    keys = _model_keys(model, c.names())
    fill = {}
    coders = {n: c.coder(n) for n in c.names()}
    for name, coder in coders.items():
        if coder is None:
            continue
        key = keys[name]
        if key is None:
            raise entrollm.EntrollmError(
                f"{path}: tensor '{name}' is coded and transformers converts it as it loads "
                "(merged, split or permuted); open the model with entrollm.transformers."
                "from_pretrained after decompressing, or compress it without coding it")
        if key not in coded_linears:
            fill[key] = (lambda c=c, name=name: et._tensor(c, name))
    ignore = r"^__entrollm__\." + "".join(
        rf"|\.{re.escape(k)}\.[A-Za-z0-9_-]+$" for k in sorted(set(coders.values()) - {None}))
    return linears, fill, ignore


def _engine_parts(model, path):
    """The same for a model the engine loads (a GGUF's container): every tensor but the coded
    linears is filled from the engine's model; none of the shards' keys (GGUF names) is read."""
    if path not in _ENGINE:
        cfg_json, matrices, vectors, tok = _native.engine_model(path)
        _ENGINE[path] = (dict(matrices), dict(vectors))
        model._entrollm_tokenizer = tok
    try:
        linears = _linears(model, path)
        matrices, vectors = _ENGINE[path]
    finally:
        _ENGINE.pop(path, None)
    # Decoded after loading: the skeleton is built under torch's meta device.
    fill = {}
    for name, m in matrices.items():
        if name.rsplit(".", 1)[0] not in linears:  # the embedding: its values
            fill[name] = (lambda m=m: et.decoded_weight(m))
    for name, data in vectors.items():
        fill[name] = (lambda d=data: torch.frombuffer(bytearray(d), dtype=torch.float32))
    return linears, fill, ".*"


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


def state_dict(path, model_class, cfg):
    """The tensors of the container at ``path`` that transformers loads itself: those it stores
    plain (the quantizer makes the coded matrices of linear layers :class:`entrollm.torch.Linear`
    modules and gives the other coded tensors their decoded values), each checked against the
    manifest; none for a model the engine loads."""
    if path in _ENGINE:
        return {}
    c = _native.Container(path)
    return {n: et._tensor(c, n) for n in c.names() if c.coder(n) is None}


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
    cls = model_class or transformers.AutoModelForCausalLM
    if "config.json" in _native.Container(path).generated():
        # The container is a directory transformers opens itself (its config.json names the
        # quantizer and the shards).
        model = cls.from_pretrained(path, dtype=dtype, **kwargs)
        if work is not None:
            weakref.finalize(model, shutil.rmtree, work, True)
        return model
    # A container written before format 1.2: its config.json is the source's.
    cfg = config(path)
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
        model = cls.from_pretrained(None, config=cfg, state_dict={}, dtype=torch.float32,
                                    **kwargs)
    finally:
        _ENGINE.pop(path, None)
    model._entrollm_tokenizer = tok
    return model


def tokenizer(path, **kwargs):
    """The tokenizer a container keeps (``AutoTokenizer`` over its verbatim files)."""
    holder = _Holder()
    d = _files_dir(os.fspath(path), holder)
    tok = transformers.AutoTokenizer.from_pretrained(d, **kwargs)
    tok._entrollm_files = holder
    return tok
