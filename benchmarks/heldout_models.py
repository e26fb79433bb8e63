"""Models built in code for the held-out benchmarks (alloc_replay.py, planner_heldout.py)."""

from __future__ import annotations


def unet(c: int = 32):
    """A small UNet: three downsampling stages, a middle, three upsampling stages joined to
    the encoder by concatenation; each stage two 3x3 convolutions with GroupNorm and SiLU."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def block(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU(),
                             nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU())

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.d1, self.d2, self.d3 = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
            self.mid = block(4 * c, 8 * c)
            self.u3, self.u2, self.u1 = block(12 * c, 4 * c), block(6 * c, 2 * c), block(3 * c, c)
            self.out = nn.Conv2d(c, 3, 1)

        def forward(self, x):
            a = self.d1(x)
            b = self.d2(F.max_pool2d(a, 2))
            m3 = self.d3(F.max_pool2d(b, 2))
            m = self.mid(F.max_pool2d(m3, 2))
            u = self.u3(torch.cat([F.interpolate(m, scale_factor=2), m3], 1))
            u = self.u2(torch.cat([F.interpolate(u, scale_factor=2), b], 1))
            return self.out(self.u1(torch.cat([F.interpolate(u, scale_factor=2), a], 1)))

    return UNet()


def moe_lm(vocab: int = 8000, d: int = 256, layers: int = 4, experts: int = 8, top: int = 2):
    """A decoder-style language model whose feed-forward layers are mixtures of experts with
    top-k routing: the tokens each expert gets, and so the sizes of its activations, depend
    on the data and change at every step."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, experts)
            self.up = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(experts))
            self.down = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(experts))

        def forward(self, x):
            flat = x.reshape(-1, d)
            weight, chosen = self.gate(flat).softmax(-1).topk(top, -1)
            out = torch.zeros_like(flat)
            for e in range(experts):
                token, slot = (chosen == e).nonzero(as_tuple=True)
                if token.numel() == 0:
                    continue
                y = self.down[e](F.gelu(self.up[e](flat.index_select(0, token))))
                out = out.index_add(0, token, y * weight[token, slot].unsqueeze(-1))
            return out.reshape(x.shape)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.attn = nn.ModuleList(nn.MultiheadAttention(d, 4, batch_first=True) for _ in range(layers))
            self.norm1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
            self.norm2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
            self.moe = nn.ModuleList(MoE() for _ in range(layers))
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.embed(ids)
            for attn, n1, n2, moe in zip(self.attn, self.norm1, self.norm2, self.moe):
                h = n1(x)
                x = x + attn(h, h, h, need_weights=False)[0]
                x = x + moe(n2(x))
            return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())

    return Model()


def gcn(features: int = 128, hidden: int = 256, classes: int = 16, layers: int = 3):
    """A graph convolutional network: each layer a linear map, then a sum over the edges
    (index_select + index_add). Returns the class scores of the nodes."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            dims = [features] + [hidden] * (layers - 1) + [classes]
            self.lin = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

        def forward(self, x, src, dst):
            for i, lin in enumerate(self.lin):
                x = lin(x)
                x = torch.zeros_like(x).index_add(0, dst, x.index_select(0, src))
                if i < len(self.lin) - 1:
                    x = F.relu(x)
            return x

    return GCN()


def lstm_lm(vocab: int = 10000, d: int = 512, layers: int = 2):
    """An embedding, a stacked LSTM and a linear head, with the cross-entropy in forward."""
    import torch.nn.functional as F
    from torch import nn

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.rnn = nn.LSTM(d, d, layers, batch_first=True)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            out = self.head(self.rnn(self.embed(ids))[0])
            return F.cross_entropy(out.flatten(0, 1), ids.flatten())

    return LSTMLM()


def gru_seq2seq(vocab: int = 4000, d: int = 256, layers: int = 2):
    """A GRU encoder and a GRU decoder started from the encoder's last state (teacher
    forcing), sharing one embedding, with the cross-entropy in forward."""
    import torch.nn.functional as F
    from torch import nn

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.encoder = nn.GRU(d, d, layers, batch_first=True)
            self.decoder = nn.GRU(d, d, layers, batch_first=True)
            self.head = nn.Linear(d, vocab)

        def forward(self, src, tgt):
            _, state = self.encoder(self.embed(src))
            out, _ = self.decoder(self.embed(tgt), state)
            return F.cross_entropy(self.head(out).flatten(0, 1), tgt.flatten())

    return Seq2Seq()


def lstm_classifier(vocab: int = 5000, d: int = 128, hidden: int = 256, classes: int = 5):
    """An embedding, a two-layer bidirectional LSTM, the mean over time and a linear head."""
    from torch import nn

    class LSTMClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.rnn = nn.LSTM(d, hidden, 2, batch_first=True, bidirectional=True)
            self.head = nn.Linear(2 * hidden, classes)

        def forward(self, ids):
            return self.head(self.rnn(self.embed(ids))[0].mean(1))

    return LSTMClassifier()


def encoder_lm(vocab: int = 6000, d: int = 256, layers: int = 3):
    """PyTorch's own nn.TransformerEncoder (dropout on, post-norm) over an embedding, with a
    linear head over the vocabulary."""
    from torch import nn

    class EncoderLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            return self.head(self.encoder(self.embed(ids)))

    return EncoderLM()


def conv_autoencoder(c: int = 32):
    """Three strided convolutions with BatchNorm down, three transposed convolutions up."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, c, 3, 2, 1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, 2, 1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.Conv2d(2 * c, 4 * c, 3, 2, 1), nn.ReLU(),
        nn.ConvTranspose2d(4 * c, 2 * c, 4, 2, 1), nn.ReLU(),
        nn.ConvTranspose2d(2 * c, c, 4, 2, 1), nn.ReLU(),
        nn.ConvTranspose2d(c, 3, 4, 2, 1))
