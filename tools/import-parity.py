#!/usr/bin/env python3
"""memfit's five models, exported from PyTorch and imported, train step for step like the native ones
started from the same weights (issue 30's acceptance): for each, the PyTorch reference model
(../shared/pytorch-reference/torch_models.py, sized as memfit's native model: Fashion-MNIST's 1x28x28
images; the GPT's vocabulary that of Moby Dick) is exported with torch.export and its initial weights
saved; `memfit train --model NAME.pt2` and `memfit train --model NAME --load` those weights then run the
same steps on the same data, and their final losses and parameters are compared.

    python3 tools/import-parity.py MEMFIT DIR [STEPS]    # MEMFIT: the memfit binary; exits 1 on a gap

Needs torch, torchvision (its BasicBlock for the ResNet) and safetensors. A parameter's gap is
|imported - native| / |native| in norm (the check: at most 1e-6), and the largest element's gap
relative to the largest |native|; the loss's is relative.
"""
import gzip, json, os, subprocess, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.export import export, Dim
from torchvision.models.resnet import BasicBlock
from safetensors.torch import save_file, load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "shared", "pytorch-reference"))
from torch_models import mlp, SimpleCNN, GPT  # noqa: E402

TOLERANCE = 1e-6


class DeepCnn28(nn.Module):
    """torch_models.DeepCNN for 1x28x28 images, as memfit's deepcnn on Fashion-MNIST (fc 128*3*3)."""

    def __init__(s):
        super().__init__()
        s.c1 = nn.Conv2d(1, 32, 3, padding=1); s.c2 = nn.Conv2d(32, 64, 3, padding=1)
        s.c3 = nn.Conv2d(64, 128, 3, padding=1); s.fc = nn.Linear(128 * 3 * 3, 10)

    def forward(s, x):
        for c in (s.c1, s.c2, s.c3):
            x = F.max_pool2d(F.relu(c(x)), 2)
        return s.fc(x.flatten(1))


class SmallResNet(nn.Module):
    """memfit's resnet: a 3x3 stem, stages of one torchvision BasicBlock (16, 32, 64 channels)."""

    def __init__(s):
        super().__init__()
        s.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False); s.bn1 = nn.BatchNorm2d(16)
        def stage(cin, cout, stride):
            down = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            return nn.Sequential(BasicBlock(cin, cout, stride, down))
        s.layer1, s.layer2, s.layer3 = stage(16, 16, 1), stage(16, 32, 2), stage(32, 64, 2)
        s.fc = nn.Linear(64, 10)

    def forward(s, x):
        x = F.relu(s.bn1(s.conv1(x)))
        x = s.layer3(s.layer2(s.layer1(x)))
        return s.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class FlatMlp(nn.Module):
    """torch_models.mlp() taking images (memfit's mlp flattens them): the same `0`, `2`, `4` names."""

    def __init__(s):
        super().__init__()
        s.net = mlp()

    def forward(s, x):
        return s.net(x.flatten(1))


def moby_dick_chars():
    """The text's characters in memfit's order (its vocabulary: sorted, each once)."""
    with gzip.open(os.path.join(HERE, "..", "crates", "data", "assets", "moby-dick.txt.gz"), "rt") as f:
        return "".join(sorted(set(f.read())))


def main():
    memfit, out = sys.argv[1], sys.argv[2]
    steps = sys.argv[3] if len(sys.argv) > 3 else "20"
    os.makedirs(out, exist_ok=True)
    models = {
        "mlp": (FlatMlp, lambda: torch.randn(2, 1, 28, 28)),
        "simplecnn": (SimpleCNN, lambda: torch.randn(2, 1, 28, 28)),
        "deepcnn": (DeepCnn28, lambda: torch.randn(2, 1, 28, 28)),
        "resnet": (SmallResNet, lambda: torch.randn(2, 1, 28, 28)),
        "gpt": (lambda: GPT(vocab=len(moby_dick_chars())), lambda: torch.randint(0, 10, (2, 128))),
    }
    failed = False
    for name, (make, example) in models.items():
        torch.manual_seed(0)
        model = make().train()
        archive = os.path.join(out, f"{name}.pt2")
        torch.export.save(export(model, (example(),), dynamic_shapes=({0: Dim("batch")},)), archive)
        state = {k.removeprefix("net."): v.contiguous() for k, v in model.state_dict().items()}
        init = os.path.join(out, f"{name}.init.safetensors")
        # A GPT checkpoint names its sizes and vocabulary, as memfit's --load asks.
        metadata = {"memfit.model": "gpt", "memfit.vocab": moby_dick_chars(), "memfit.gpt.context": "128",
                    "memfit.gpt.d_model": "256", "memfit.gpt.heads": "4", "memfit.gpt.layers": "4"}
        save_file(state, init, metadata if name == "gpt" else None)
        runs = {}
        for kind, model_arg in [("imported", archive), ("native", name)]:
            saved, report = os.path.join(out, f"{name}.{kind}.safetensors"), os.path.join(out, f"{name}.{kind}.json")
            args = [memfit, "train", "--model", model_arg, "--max-steps", steps, "--no-eval", "--save", saved,
                    "--report", report]
            if kind == "native":
                args += ["--load", init]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            r = json.load(open(report))
            runs[kind] = (load_file(saved), r["final_train_loss"], r["step_time_ms_median"], r["peak_allocated_bytes"])
        (a, loss_a, ms_a, peak_a), (b, loss_b, ms_b, peak_b) = runs["imported"], runs["native"]
        a = {k.removeprefix("net."): v for k, v in a.items()}
        gaps, norm_gaps = {}, {}
        for k, v in b.items():
            if not v.dtype.is_floating_point:
                continue
            x = a[k]
            if k.endswith("attn.in_proj_bias"):
                # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
                # a row's scores): both runs step it by rounding noise, which Adam scales up to lr. Its
                # query and value thirds are compared.
                d = v.numel() // 3
                x, v = torch.cat([x[:d], x[2 * d:]]), torch.cat([v[:d], v[2 * d:]])
            gaps[k] = ((x - v).abs().max() / v.abs().max().clamp_min(1e-30)).item()
            norm_gaps[k] = ((x - v).norm() / v.norm().clamp_min(1e-30)).item()
        worst = max(gaps, key=gaps.get)
        worst_norm = max(norm_gaps, key=norm_gaps.get)
        loss_gap = abs(loss_a - loss_b) / abs(loss_b)
        ok = set(a) == set(b) and norm_gaps[worst_norm] <= TOLERANCE and loss_gap <= TOLERANCE
        failed |= not ok
        print(f"{name:10} after {steps} steps: loss {loss_a:.6f} imported, {loss_b:.6f} native (gap {loss_gap:.1e}); "
              f"largest parameter gap {norm_gaps[worst_norm]:.1e} in norm ({worst_norm}), {gaps[worst]:.1e} in "
              f"an element ({worst}); step {ms_a:.1f} vs {ms_b:.1f} ms, peak {peak_a / 2**20:.2f} vs "
              f"{peak_b / 2**20:.2f} MiB {'ok' if ok else 'DIFFERENT'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
