"""A diffusion transformer (diffusers' Flux transformer, tiny and random) with its linears coded
losslessly by entrollm.torch.compress_module: the uncompressed model's output exactly, and the
same after a round trip through the container into a fresh model."""

import copy

import diffusers
import torch

import entrollm.torch as et


def flux(seed):
    torch.manual_seed(seed)
    m = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8))
    return m.to(torch.bfloat16).eval()


def inputs(batch=2, image=16, text=8):
    g = torch.Generator().manual_seed(3)
    return dict(
        hidden_states=torch.randn(batch, image, 16, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(batch, text, 32, generator=g).bfloat16(),
        pooled_projections=torch.randn(batch, 32, generator=g).bfloat16(),
        timestep=torch.rand(batch, generator=g).bfloat16(),
        img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3))


def test_a_coded_diffusion_transformer_gives_the_uncompressed_output_exactly(tmp_path):
    src = flux(0)
    coded = et.compress_module(copy.deepcopy(src), form="dtans", min_elements=0)
    lin = [s for s in coded.modules() if isinstance(s, et.Linear)]
    assert lin and {s.form for s in lin} == {"dtans"}
    assert not any(type(s) is torch.nn.Linear for s in coded.modules())
    # Batch 2: every linear sees more than one row, so each product is torch's on the decoded
    # weight (a single row would take the Rust GEMV, within its tolerance, not bit for bit).
    x = inputs()
    with torch.no_grad():
        want = src(**x).sample
        assert torch.equal(coded(**x).sample, want)
        path = et.save(coded, tmp_path / "flux")
        fresh = et.load_into(flux(1), path)
        assert torch.equal(fresh(**x).sample, want)
