"""Per-layer compute of ResNet-50, VGG-19 and a base Transformer on a GPU: when each layer's forward
runs and when each layer's gradient is ready in the backward pass (the timeline P3's schedule
depends on), with CUDA events.

    python3 bench/profile_layers.py --out profile_layers.json        # needs CUDA and torchvision

Method. For every module that owns parameters directly (a "layer": conv, linear, batch norm,
embedding, layer norm, attention projections), a forward pre-hook and a forward hook record CUDA
events around its forward; a post-accumulate-grad hook on each of its parameters records an event
when that parameter's gradient has been accumulated (the moment a parameter server could push it).
Events are recorded on the compute stream as autograd reaches them, so their elapsed times are
the GPU's. Per layer: forward_ms (its own forward), ready_ms (when its last gradient was ready,
measured from the start of backward) and backward_ms (ready_ms minus the previous layer's, in
backward order). A step without hooks is timed separately (the hooks' cost is that difference).
Medians over --iters steps after --warmup. fp32 weights; torch's defaults for TF32 (convolutions
may use TF32, matrix products not), recorded in the output.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Optional

import torch

DEVICE = "cuda"
from torch import nn


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


class SockeyeSizedTransformer(nn.Module):
    """Transformer base (Vaswani et al. 2017): 6 + 6 layers, d_model 512, 8 heads, ffn 2048, shared
    32k vocabulary; source and target embeddings and output projection tied (as Sockeye's
    --weight-tying-type src_trg_softmax)."""

    def __init__(self, vocab: int = 32000, d_model: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model=d_model, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                                          dim_feedforward=2048, dropout=0.1, batch_first=True)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, src, tgt):
        mask = self.transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.out(h)


def build(name: str, batch: int, device, seq_len: int = 20):
    if name in ("resnet50", "vgg19"):
        import torchvision
    if name == "resnet50":
        model = torchvision.models.resnet50()
        x = torch.randn(batch, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        return model, (x,), lambda out: nn.functional.cross_entropy(out, y)
    if name == "vgg19":
        model = torchvision.models.vgg19()
        x = torch.randn(batch, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        return model, (x,), lambda out: nn.functional.cross_entropy(out, y)
    if name == "sockeye_rnn":  # trainers/models.py's (P3's Sockeye 1.5 RNN), run as the trainers run it
        from trainers.models import SockeyeRNN, SockeyeRNNParams

        model = SockeyeRNN(SockeyeRNNParams(), max_target_tokens=seq_len)
        tokens = torch.randint(0, SockeyeRNNParams.target_vocab, (batch, seq_len), device=device)
        return model, (tokens,), lambda out: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens.reshape(-1))
    if name == "transformer":
        model = SockeyeSizedTransformer()
        src = torch.randint(0, 32000, (batch, 50), device=device)
        tgt = torch.randint(0, 32000, (batch, 50), device=device)
        return model, (src, tgt), lambda out: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))
    raise ValueError(name)


def forward_ms_of(calls: list[list]) -> Optional[float]:
    """One layer's forward time in one step: the sum over its calls (an RNN's decoder cells run
    once per token) of each call's start-to-end time, from [start, end] event pairs (CUDA events,
    or anything with ``elapsed_time``); None when a call has no end (its forward hook did not run)."""
    if not calls or any(len(pair) != 2 for pair in calls):
        return None
    return sum(start.elapsed_time(end) for start, end in calls)


def profile(name: str, batch: int, warmup: int, iters: int, seq_len: int = 20) -> dict:
    device = torch.device(DEVICE)
    model, inputs, loss_of = build(name, batch, device, seq_len)
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(model(*inputs)).backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    plain = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        plain.append(start.elapsed_time(end))

    layers = layers_of(model)
    fwd_events: dict[str, list] = {}
    ready_events: dict[str, torch.cuda.Event] = {}
    handles = []
    seen_params: set[int] = set()
    for lname, module in layers:
        def pre(_m, _a, lname=lname):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            fwd_events.setdefault(lname, []).append([ev])  # a layer may run more than once (an RNN's cells)

        def post(_m, _a, _o, lname=lname):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            fwd_events[lname][-1].append(ev)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
        for p in module.parameters(recurse=False):
            if id(p) in seen_params:  # a tied weight belongs to the first layer that owns it
                continue
            seen_params.add(id(p))

            def ready(_p, lname=lname):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                ready_events[lname] = ev  # the last of the layer's parameters wins

            handles.append(p.register_post_accumulate_grad_hook(ready))

    rows: dict[str, dict[str, list]] = {lname: {"forward_ms": [], "ready_ms": []} for lname, _ in layers}
    forward_total, backward_total = [], []
    for _ in range(warmup + iters):
        fwd_events.clear()
        ready_events.clear()
        opt.zero_grad(set_to_none=True)
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t2 = torch.cuda.Event(enable_timing=True)
        t0.record()
        loss = loss_of(model(*inputs))
        t1.record()
        loss.backward()
        t2.record()
        opt.step()
        torch.cuda.synchronize()
        if _ < warmup:
            continue
        forward_total.append(t0.elapsed_time(t1))
        backward_total.append(t1.elapsed_time(t2))
        for lname, calls in fwd_events.items():
            forward_ms = forward_ms_of(calls)
            if forward_ms is not None:
                rows[lname]["forward_ms"].append(forward_ms)
                rows[lname]["calls"] = len(calls)
        for lname, ev in ready_events.items():
            rows[lname]["ready_ms"].append(t1.elapsed_time(ev))
    for h in handles:
        h.remove()

    params, counted = {}, set()
    for lname, m in layers:  # a tied weight counts once, for the first layer that owns it
        own = [p for p in m.parameters(recurse=False) if id(p) not in counted]
        counted.update(id(p) for p in own)
        params[lname] = sum(p.numel() for p in own)
    out_rows = []
    for lname, _ in layers:
        r = rows[lname]
        out_rows.append({
            "layer": lname,
            "parameters": params[lname],
            "forward_ms": round(statistics.median(r["forward_ms"]), 4) if r["forward_ms"] else None,
            "ready_ms": round(statistics.median(r["ready_ms"]), 4) if r["ready_ms"] else None,
            "calls": r.get("calls", 1),
        })
    in_backward = sorted((row for row in out_rows if row["ready_ms"] is not None), key=lambda row: row["ready_ms"])
    previous = 0.0
    for row in in_backward:
        row["backward_ms"] = round(row["ready_ms"] - previous, 4)
        previous = row["ready_ms"]
    return {
        "model": name,
        "batch": batch,
        **({"seq_len": seq_len} if name == "sockeye_rnn" else {}),
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_ms_without_hooks": round(statistics.median(plain), 3),
        "forward_ms": round(statistics.median(forward_total), 3),
        "backward_ms": round(statistics.median(backward_total), 3),
        "layers": out_rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,vgg19,transformer")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=20, help="sockeye_rnn: tokens per sentence (source and target)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_layers: needs a CUDA device; torch sees none")
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "python": platform.python_version(),
        "method": "CUDA events: forward pre/post hooks per layer, post-accumulate-grad hooks per parameter",
        "models": [],
    }
    for name in args.models.split(","):
        p = profile(name, args.batch, args.warmup, args.iters, args.seq_len)
        result["models"].append(p)
        print(f"{name:12s} params {p['parameters']:>11,d}  step {p['step_ms_without_hooks']:8.2f} ms  "
              f"forward {p['forward_ms']:7.2f}  backward {p['backward_ms']:7.2f}  layers {len(p['layers'])}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
