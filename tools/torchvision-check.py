#!/usr/bin/env python3
"""torchvision models on Fashion-MNIST, through memfit's import, checked against PyTorch (issue 30's
acceptance): export a model adapted to Fashion-MNIST (one input channel, 28 x 28, 10 classes), then
check that memfit's saved weights load strictly into the same PyTorch module and that PyTorch's
validation accuracy on memfit's validation images equals the one memfit reports; and measure PyTorch's
own training step (time and peak) for the same model and batch.

    python3 tools/torchvision-check.py export NAME OUT.pt2
    memfit train --model OUT.pt2 --save W.safetensors --report R.json
    python3 tools/torchvision-check.py check NAME W.safetensors R.json   # exits 1 when they differ
    python3 tools/torchvision-check.py measure NAME BATCH [STEPS]
    python3 tools/torchvision-check.py export-rgb TORCHVISION_NAME OUT.pt2 [SIZE]

`export-rgb` exports any torchvision classification model as torchvision builds it (3 x SIZE x SIZE
images, 64 by default, 10 classes) for `memfit bench --model OUT.pt2`, which times it on synthetic
data of its shapes (Fashion-MNIST cannot train it).

NAME: resnet18, mobilenet_v3_small or vit (torchvision's VisionTransformer, narrow: patch 7, 4 layers
of width 128). Needs torch, torchvision, numpy and safetensors (PyTorch 2.11-2.15). The validation
images are the embedded subset's (the last 2,000 of Fashion-MNIST's t10k, crates/data/assets), or the
t10k set of the folder given as DATA=... when memfit trained with --data.
"""
import gzip, json, os, statistics, sys, time
import numpy as np
import torch, torch.nn as nn, torch.nn.functional as F, torchvision
from torch.export import export, Dim
from torchvision.models.vision_transformer import VisionTransformer

HERE = os.path.dirname(os.path.abspath(__file__))
ASSETS = os.path.join(HERE, "..", "crates", "data", "assets")


def build(name):
    torch.manual_seed(0)
    if name == "resnet18":
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    elif name == "mobilenet_v3_small":
        m = torchvision.models.mobilenet_v3_small(num_classes=10)
        m.features[0][0] = nn.Conv2d(1, 16, 3, 2, 1, bias=False)
    elif name == "vit":
        m = VisionTransformer(image_size=28, patch_size=7, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512,
                              num_classes=10)
        m.conv_proj = nn.Conv2d(1, 128, 7, 7)
    else:
        sys.exit(f"unknown model {name}: resnet18, mobilenet_v3_small or vit")
    return m


def idx(path):
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def validation():
    folder = os.environ.get("DATA")
    if folder:
        images = idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz"))
        labels = idx(os.path.join(folder, "t10k-labels-idx1-ubyte.gz"))
        return images, labels
    images = idx(os.path.join(ASSETS, "t10k-images-idx3-ubyte.gz"))[8000:]
    labels = idx(os.path.join(ASSETS, "t10k-labels-idx1-ubyte.gz"))[8000:]
    return images, labels


def main():
    cmd, name = sys.argv[1], sys.argv[2]
    if cmd == "export":
        m = build(name).train()
        program = export(m, (torch.randn(2, 1, 28, 28),), dynamic_shapes=({0: Dim("batch", min=2)},))
        torch.export.save(program, sys.argv[3])
        print(f"{sys.argv[3]}: {name}, {sum(p.numel() for p in m.parameters()):,} parameters")
    elif cmd == "export-rgb":
        size = int(sys.argv[4]) if len(sys.argv) > 4 else 64
        torch.manual_seed(0)
        m = getattr(torchvision.models, name)(num_classes=10).train()
        program = export(m, (torch.randn(2, 3, size, size),), dynamic_shapes=({0: Dim("batch", min=2)},))
        torch.export.save(program, sys.argv[3])
        print(f"{sys.argv[3]}: {name} at 3x{size}x{size}, {sum(p.numel() for p in m.parameters()):,} parameters")
    elif cmd == "check":
        from safetensors.torch import load_file
        from safetensors import safe_open
        weights, report = sys.argv[3], json.load(open(sys.argv[4]))
        m = build(name)
        m.load_state_dict(load_file(weights), strict=True)  # raises on a missing or unexpected name
        meta = safe_open(weights, "pt").metadata()
        mean, std = float(meta["memfit.input.mean"]), float(meta["memfit.input.std"])
        images, labels = validation()
        x = (torch.from_numpy(images.copy()).float().unsqueeze(1) / 255 - mean) / std
        m.eval()
        with torch.no_grad():
            predicted = torch.cat([m(x[i:i + 500]).argmax(1) for i in range(0, len(x), 500)])
        accuracy = (predicted == torch.from_numpy(labels.astype(np.int64))).float().mean().item()
        theirs = report["val_accuracy"]
        print(f"{name}: loaded strictly ({len(m.state_dict())} entries); PyTorch's validation accuracy "
              f"{accuracy:.4f} on {len(x)} images, memfit's {theirs:.4f}, difference {abs(accuracy - theirs):.4f}")
        sys.exit(0 if abs(accuracy - theirs) <= 0.002 else 1)
    elif cmd == "measure":
        from torch.distributed._tools.mem_tracker import MemTracker
        batch = int(sys.argv[3])
        steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
        torch.set_num_threads(os.cpu_count())
        m = build(name).train()
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

        def step():
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        mt = MemTracker()
        mt.track_external(m, opt)
        with mt:
            step()
        peak = sum(d["Total"] for d in mt.get_tracker_snapshot("peak").values()) / 2**20
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1000)
        print(f"PyTorch {torch.__version__} {name} b{batch} AdamW: step median {statistics.median(times):.1f} ms, "
              f"peak {peak:.1f} MiB (MemTracker), {os.cpu_count()} threads")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
