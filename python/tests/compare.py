"""``python compare.py A.pt B.pt LABEL``: the largest difference between two runs' final
parameters (``train.py --out``); exits 1 past 1e-5."""

import sys

import torch

a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
d = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
print(f"  {sys.argv[3]}: max |difference| {d:.1e}")
sys.exit(d > 1e-5)
