"""`enhancer-train grow`: the wider model computes what the trained one computes, keeps every trained
tensor, and trains its new units; narrowing is refused."""
from __future__ import annotations

import pytest
import torch

from enhancer import load_checkpoint, save_checkpoint
from tests.enhancer.test_streaming import torch_streaming
from tests.tolerance import assert_close_to_peak, snr_db
from tests.training.test_average import checkpoint, tiny_config
from training.cli import main
from training.data.manifests import DataError
from training.grow import grow_checkpoint


def noise_input() -> torch.Tensor:
    """The (1, 8000) signal every test here enhances: 0.5 s of seeded noise."""
    return 0.1 * torch.randn(1, 8000, generator=torch.Generator().manual_seed(1))


def same_input_outputs(trained, grown):
    """Both models (in eval mode) enhance `noise_input()`: (trained's output, grown's)."""
    wav = noise_input()
    trained.eval()
    grown.eval()
    with torch.no_grad():
        return trained.enhance(wav), grown.enhance(wav)


@pytest.mark.parametrize("mechanisms", [1, 2])
def test_grown_model_has_the_same_output(tmp_path, mechanisms):
    cfg = tiny_config(n_mechanisms=mechanisms)
    path, _ = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    small = load_checkpoint(path)
    out = grow_checkpoint(path, tmp_path / "wide.pt", d_ffn=3 * cfg.d_ffn)
    wide = load_checkpoint(out)
    assert wide.config.d_ffn == 3 * cfg.d_ffn
    assert sum(p.numel() for p in wide.parameters()) > sum(p.numel() for p in small.parameters())
    want, got = same_input_outputs(small, wide)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # the trained tensors are the leading slices of the grown ones
    s, w = small.state_dict(), wide.state_dict()
    for k, v in s.items():
        assert torch.equal(w[k][tuple(slice(0, n) for n in v.shape)], v), k
    # the new units are live: random input weights, so their output weights get a gradient
    blk = next(b for b in wide.blocks if b.ffn_in.weight.shape[-1] > cfg.d_ffn // b.g)
    new_in = blk.ffn_in.weight[..., cfg.d_ffn // blk.g:]
    assert new_in.abs().sum() > 0
    assert torch.count_nonzero(blk.ffn_out.weight[:, cfg.d_ffn // blk.g:]) == 0


def test_narrowing_and_odd_widths_are_refused(tmp_path):
    cfg = tiny_config(n_mechanisms=2)
    path, _ = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    with pytest.raises(DataError, match="only widens"):
        grow_checkpoint(path, tmp_path / "x.pt", d_ffn=cfg.d_ffn - 2)
    with pytest.raises(DataError, match="multiple"):
        grow_checkpoint(path, tmp_path / "x.pt", d_ffn=cfg.d_ffn + 1)
    assert not (tmp_path / "x.pt").exists()


def test_cli(tmp_path, capsys):
    path, _ = checkpoint(tmp_path, "a.pt", 3)
    assert main(["grow", str(path), "--d-ffn", str(2 * tiny_config().d_ffn), "-o", str(tmp_path / "w.pt")]) == 0
    assert "grew" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "w.pt").checkpoint["extra"]["grown_from"]["d_ffn"] == tiny_config().d_ffn


def test_attention_window_keeps_every_tensor_and_changes_only_the_context(tmp_path):
    cfg = tiny_config()
    path, _ = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    trained = load_checkpoint(path)
    assert main(["grow", str(path), "--attention-window", "4", "-o", str(tmp_path / "w4.pt")]) == 0
    short = load_checkpoint(tmp_path / "w4.pt")
    assert short.config.attention_window == 4 and short.config.d_ffn == cfg.d_ffn
    assert short.checkpoint["extra"]["grown_from"]["attention_window"] == cfg.attention_window
    s, w = trained.state_dict(), short.state_dict()
    assert s.keys() == w.keys() and all(torch.equal(s[k], w[k]) for k in s)
    logmag = torch.randn(1, 40, cfg.n_freqs, generator=torch.Generator().manual_seed(2)) - 4.0
    with torch.no_grad():
        (a, _), (b, _) = trained(logmag), short(logmag)
    first = 4 - cfg.lookahead  # output frames whose steps see no more than 4 frames either way
    torch.testing.assert_close(b[:, :first], a[:, :first], rtol=0, atol=1e-6)
    assert float((a - b)[:, first:].abs().max()) > 1e-3  # later frames lose context (gains in [0, 1])
    with pytest.raises(DataError, match="at least 1"):
        grow_checkpoint(path, tmp_path / "x.pt", attention_window=0)
    with pytest.raises(SystemExit):
        main(["grow", str(path), "-o", str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("mechanisms", [1, 2])
def test_added_blocks_start_from_the_trained_output(tmp_path, mechanisms):
    cfg = tiny_config(n_mechanisms=mechanisms)
    path, small = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    at = cfg.n_layers - cfg.last_plain  # the new blocks go after the last TIM block
    # a trained final norm is not a uniform scale: perturb the one the new blocks copy
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        norm = small.blocks[at - 1].norm_ffn
        norm.weight.mul_(1 + 0.03 * torch.randn(norm.weight.shape, generator=g))
        norm.bias.add_(0.02 * torch.randn(norm.bias.shape, generator=g))
    save_checkpoint(small, cfg, path)
    out = grow_checkpoint(path, tmp_path / "deep.pt", blocks=cfg.n_layers + 2)
    deep = load_checkpoint(out)
    assert deep.config.n_layers == cfg.n_layers + 2 and len(deep.blocks) == cfg.n_layers + 2
    assert deep.config.n_tim_layers == small.config.n_tim_layers + (2 if mechanisms > 1 else 0)
    s, d = small.state_dict(), deep.state_dict()
    for k, v in s.items():  # every trained tensor kept, the blocks after the insertion shifted by two
        if k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            k = f"blocks.{int(i) + 2 * (int(i) >= at)}.{rest}"
        assert torch.equal(d[k], v), k
    for j in (at, at + 1):  # the new blocks: the previous block's inputs, silent outputs
        new, prev = deep.blocks[j], small.blocks[at - 1]
        assert torch.equal(new.qkv.weight, prev.qkv.weight) and torch.equal(new.ffn_in.weight, prev.ffn_in.weight)
        assert torch.count_nonzero(new.out.weight) == 0 and torch.count_nonzero(new.ffn_out.weight) == 0
        assert torch.equal(new.norm_ffn.weight, prev.norm_ffn.weight)
        assert torch.equal(new.norm_attn.weight, torch.ones_like(prev.norm_attn.weight))
    want, got = same_input_outputs(small, deep)
    assert snr_db(want, got) > 25  # close to the trained output (not exact: post-norm has no identity)
    # with a uniform final norm the silent blocks are the identity
    with torch.no_grad():
        for m in (small, deep):
            for j in [at - 1] + ([at, at + 1] if m is deep else []):
                m.blocks[j].norm_ffn.weight.fill_(1.0)
                m.blocks[j].norm_ffn.bias.zero_()
    want, got = same_input_outputs(small, deep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # the silent outputs learn: their weights get a gradient
    deep.train()
    logmag = torch.randn(1, 20, cfg.n_freqs, generator=g) - 4.0
    gains, _ = deep(logmag)
    gains.mean().backward()
    assert deep.blocks[at].out.weight.grad.abs().sum() > 0
    assert deep.blocks[at].ffn_out.weight.grad.abs().sum() > 0


def test_fewer_blocks_are_refused(tmp_path):
    cfg = tiny_config()
    path, _ = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    with pytest.raises(DataError, match="only adds blocks"):
        grow_checkpoint(path, tmp_path / "x.pt", blocks=cfg.n_layers - 1)
    assert not (tmp_path / "x.pt").exists()
    # mechanisms but no TIM block: no block of the right kind to copy
    none_path, _ = checkpoint(tmp_path, "plain.pt", 3, cfg=tiny_config(n_mechanisms=2, first_plain=cfg.n_layers - 1))
    with pytest.raises(DataError, match="no block to copy"):
        grow_checkpoint(none_path, tmp_path / "x.pt", blocks=cfg.n_layers + 1)
    assert not (tmp_path / "x.pt").exists()
    assert main(["grow", str(path), "--blocks", str(cfg.n_layers + 1), "-o", str(tmp_path / "d.pt")]) == 0
    assert load_checkpoint(tmp_path / "d.pt").checkpoint["extra"]["grown_from"]["blocks"] == cfg.n_layers


@pytest.mark.parametrize("mechanisms,factor,c_out", [(1, 2, 32), (2, 2, 32), (2, 3, 24)])
def test_wider_stream_computes_the_trained_function(tmp_path, mechanisms, factor, c_out):
    # c_out 32 = d_model: the pre-encoder feeds the stream directly (no projection to copy)
    cfg = tiny_config(n_mechanisms=mechanisms, conv_channels=(32, 32, 16, c_out))
    path, small = checkpoint(tmp_path, "a.pt", 5, cfg=cfg)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():  # trained norms are not uniform: copies must keep each unit's own scale
        for p in small.parameters():
            if p.dim() == 2 and p.shape[-1] == cfg.d_model // p.shape[0]:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    save_checkpoint(small, cfg, path)
    out = grow_checkpoint(path, tmp_path / "broad.pt", d_model=factor * cfg.d_model)
    broad = load_checkpoint(out)
    assert broad.config.d_model == factor * cfg.d_model and broad.config.n_heads == factor * cfg.n_heads
    assert broad.config.head_dim == cfg.head_dim
    assert broad.checkpoint["extra"]["grown_from"]["d_model"] == cfg.d_model
    want, got = same_input_outputs(small, broad)
    assert snr_db(want, got) > 100  # the same function, to float rounding
    # the competition scores agree too (the mechanisms keep their roles)
    logmag = torch.randn(1, 30, cfg.n_freqs, generator=torch.Generator().manual_seed(7)) - 4.0
    with torch.no_grad():
        (ga, ca), (gb, cb) = small(logmag), broad(logmag)
    torch.testing.assert_close(gb, ga, rtol=0, atol=1e-5)  # gains and scores lie in [0, 1]
    if mechanisms > 1:
        torch.testing.assert_close(cb, ca, rtol=0, atol=1e-5)
    # every trained parameter is a copy: the broad stream holds each unit `factor` times
    assert torch.equal(broad.blocks[0].norm_ffn.weight.unique(), small.blocks[0].norm_ffn.weight.unique())
    # training tells the copies apart: with dropout their gradients differ
    broad.train()
    gains, _ = broad(logmag)
    gains.mean().backward()
    w = broad.blocks[0].ffn_in.weight.grad[0]  # (factor * dm, F): row r and its copies
    dm = w.shape[0] // factor
    assert not torch.allclose(w[:dm], w[dm:2 * dm])


def test_odd_hidden_sizes_are_refused(tmp_path):
    cfg = tiny_config(n_mechanisms=2)
    path, _ = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    for d in (cfg.d_model - 2, cfg.d_model + cfg.d_model // 2):
        with pytest.raises(DataError, match="whole multiple"):
            grow_checkpoint(path, tmp_path / "x.pt", d_model=d)
    assert not (tmp_path / "x.pt").exists()
    assert main(["grow", str(path), "--d-model", str(2 * cfg.d_model), "-o", str(tmp_path / "b.pt")]) == 0


@pytest.mark.parametrize("c_out,channels", [(24, (64, 32, 32, 48)), (32, (32, 32, 16, 64))])
def test_wider_preencoder_computes_the_trained_function(tmp_path, c_out, channels):
    # c_out 32 = d_model: the last convolution wrote the stream itself (an identity projection to split)
    cfg = tiny_config(n_mechanisms=2, conv_channels=(32, 32, 16, c_out))
    path, small = checkpoint(tmp_path, "a.pt", 8, cfg=cfg)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # trained norms are not uniform: each copy must keep its channel's own scale
        for layer in small.pre.layers:
            layer.norm.weight.mul_(1 + 0.3 * torch.randn(layer.norm.weight.shape, generator=g))
            layer.norm.bias.add_(0.1 * torch.randn(layer.norm.bias.shape, generator=g))
    save_checkpoint(small, cfg, path)
    assert main(["grow", str(path), "--conv-channels", ",".join(map(str, channels)), "-o", str(tmp_path / "c.pt")]) == 0
    wide = load_checkpoint(tmp_path / "c.pt")
    assert wide.config.conv_channels == channels and wide.config.d_model == cfg.d_model
    assert wide.checkpoint["extra"]["grown_from"]["conv_channels"] == list(cfg.conv_channels)
    want, got = same_input_outputs(small, wide)
    assert snr_db(want, got) > 100  # the same function, to float rounding
    # the step graph of the wider model (its convolution tails sized by the new widths) streams the same
    assert_close_to_peak(torch_streaming(wide, noise_input()[0].numpy()), got[0].numpy())
    # each widened convolution holds its trained filters, copied; what reads the copies sums to the trained read
    for i, (o, n) in enumerate(zip(cfg.conv_channels, channels)):
        w_old, w_new = small.pre.layers[i].conv.weight.detach(), wide.pre.layers[i].conv.weight.detach()
        rows = torch.arange(n) % o
        if i:
            prev_o, prev_n = cfg.conv_channels[i - 1], channels[i - 1]
            folded = w_new.reshape(n, prev_n // prev_o, prev_o, -1).sum(1)  # the copies' parts summed
            torch.testing.assert_close(folded, w_old.index_select(0, rows), rtol=1e-5, atol=1e-6 * float(w_old.abs().max()))
        else:  # the first reads the signal itself: its filters copied exactly
            assert torch.equal(w_new, w_old.index_select(0, rows))
    # the copies part under training: unequal splits give their filters different gradients
    wide.train()
    logmag = torch.randn(1, 30, cfg.n_freqs, generator=torch.Generator().manual_seed(7)) - 4.0
    gains, _ = wide(logmag)
    gains.mean().backward()
    i = next(i for i, (o, n) in enumerate(zip(cfg.conv_channels, channels)) if n > o)
    grad, o = wide.pre.layers[i].conv.weight.grad, cfg.conv_channels[i]
    assert not torch.allclose(grad[:o], grad[o:2 * o])


def test_odd_preencoder_widths_are_refused(tmp_path):
    cfg = tiny_config(conv_channels=(32, 32, 16, 16))
    path, _ = checkpoint(tmp_path, "a.pt", 3, cfg=cfg)
    for channels in ((32, 32, 8, 16), (32, 32, 24, 16), (32, 32, 32)):
        with pytest.raises(DataError, match="whole multiple"):
            grow_checkpoint(path, tmp_path / "x.pt", conv_channels=channels)
    assert cfg.d_model == 32
    with pytest.raises(DataError, match="drop the projection"):  # a last width equal to the hidden size
        grow_checkpoint(path, tmp_path / "x.pt", conv_channels=(32, 32, 16, 32))
    assert not (tmp_path / "x.pt").exists()
