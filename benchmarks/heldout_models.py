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
