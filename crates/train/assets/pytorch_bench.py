"""PyTorch's side of `memfit bench --compare-pytorch PYTHON`: the bench cases' models written in
PyTorch, one AdamW training step timed as memfit times it (warm-up steps, then the median of the
timed steps, each ended by the loss read back as memfit reads it), and a steady-state step's peak
memory: on the cpu PyTorch's own estimate (MemTracker on fake tensors), on a GPU the caching
allocator's measured peak (`torch.cuda.max_memory_allocated`). memfit runs this script with its
arguments and reads one JSON object from stdout.

Usage: python pytorch_bench.py CASE WARMUP STEPS THREADS [DEVICE]   (DEVICE: cpu, or cuda:N)
With MEMFIT_BENCH_AUTOCAST=bf16 the forward runs under bf16 autocast (memfit's --precision bf16).
With MEMFIT_BENCH_COMPILE=1 the model runs under torch.compile (the optimizer step eager), compiled in
the warm-up steps (at least two).
"""
import contextlib
import json, os, statistics, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class SimpleCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 14 * 14, 10)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.conv1(x)), 2).flatten(1))


class DeepCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1),
                                    nn.Conv2d(64, 128, 3, padding=1)])
        self.fc = nn.Linear(128 * 8 * 8, 10)

    def forward(self, x):
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    """Pre-norm transformer block, as memfit's GPT block."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=96, d=256, heads=4, layers=4, context=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def mlp():
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


CASES = {  # memfit's bench case name: (model, batch of inputs and targets)
    "mlp-b256": (mlp, lambda: (torch.randn(256, 784), torch.randint(0, 10, (256,)))),
    "simplecnn-b128": (SimpleCNN, lambda: (torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,)))),
    "deepcnn-b64": (DeepCNN, lambda: (torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,)))),
    "gpt-b32": (GPT, lambda: (torch.randint(0, 96, (32, 128)), torch.randint(0, 96, (32, 128)))),
    "gpt2-124m-b8": (lambda: GPT(vocab=50304, d=768, heads=12, layers=12, context=1024),
                     lambda: (torch.randint(0, 50304, (8, 1024)), torch.randint(0, 50304, (8, 1024)))),
    "gpt2-124m-b16": (lambda: GPT(vocab=50304, d=768, heads=12, layers=12, context=1024),
                      lambda: (torch.randint(0, 50304, (16, 1024)), torch.randint(0, 50304, (16, 1024)))),
}


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def step_times(make_model, make_batch, warmup, steps, device):
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (t.to(device) for t in make_batch())
    compiled = os.environ.get("MEMFIT_BENCH_COMPILE") == "1"
    forward = torch.compile(model) if compiled else model
    if compiled:
        warmup = max(warmup, 2)

    # memfit's --precision: bf16 autocast, or fp16 autocast with GradScaler (its loss scale).
    mode = os.environ.get("MEMFIT_BENCH_AUTOCAST", "")
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=mode in ("bf16", "fp16")):
            loss = loss_of(forward, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        # memfit reads each step's loss back (its progress line): the same synchronisation here.
        return loss.item()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return times, peak


def steady_peak_bytes(make_model, make_batch, fake=True):
    """MemTracker's peak of a steady-state step (optimizer state present), or None if unavailable; on
    fake tensors (no memory, no arithmetic) unless `fake` is False."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:
        return None
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = make_model()
        x, y = make_batch()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    return int(sum(v for per_device in peak.values() for k, v in per_device.items() if str(k).endswith("Total")))


def steady_peak_or_none(make_model, make_batch):
    """`steady_peak_bytes`; an exported program's module, which loads only with real tensors, is
    tracked on real ones; None where MemTracker cannot follow the model."""
    for fake in (True, False):
        try:
            return steady_peak_bytes(make_model, make_batch, fake)
        except Exception:
            continue
    return None


def exported_case(args):
    """A model exported by torch.export.save: PATH BATCH, then `image C H W CLASSES` or `tokens T VOCAB`
    (the shapes memfit read from its signature). The program's module runs as exported (training mode)."""
    path, batch, task = args[0], int(args[1]), args[2]
    sizes = [int(a) for a in args[3:]]
    if task == "image":
        c, h, w, classes = sizes
        make_batch = lambda: (torch.randn(batch, c, h, w), torch.randint(0, classes, (batch,)))
    else:
        context, vocab = sizes
        make_batch = lambda: (torch.randint(0, vocab, (batch, context)), torch.randint(0, vocab, (batch, context)))
    return (lambda: torch.export.load(path).module()), make_batch


def main():
    case, warmup, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    device = torch.device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
    if case == "pt2":
        CASES[case] = exported_case(sys.argv[6:])
    if case not in CASES:
        print(json.dumps({"case": case, "error": "no PyTorch reference for this case"}))
        return
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    make_model, make_batch = CASES[case]
    times, measured_peak = step_times(make_model, make_batch, warmup, steps, device)
    print(json.dumps({
        "case": case,
        "median_ms": statistics.median(times),
        "peak_bytes": measured_peak if measured_peak is not None else steady_peak_or_none(make_model, make_batch),
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
