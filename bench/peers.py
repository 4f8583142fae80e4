#!/usr/bin/env python3
"""The same stage computations in PyTorch, as users write them today (Megatron-Core / torchtitan
style, unfused eager ops), timed on the same GPU and shapes as the C++ benchmarks.

    python3 bench/peers.py router [--quick] [--json FILE]

Results are keyed by the same shape names as the C++ benchmark's JSON; bench/compare.py joins them.
"""
import argparse
import json

try:
    import torch
except ImportError:
    raise SystemExit("peers.py: needs PyTorch, which the peer comparisons run on")

T = 16384


# As bench_util.h's kSteadyStateMs: a busy GPU settles at a lower clock under its power cap within
# ~100 ms, and the C++ side measures its GEMM ceiling and times its GEMM-heavy work after this much
# load; the peer is timed in the same state.
STEADY_STATE_MS = 1000.0


def steady_state_calls(fn, warmup, world_max=None):
    """Calls of fn, after `warmup` of them, that fill STEADY_STATE_MS of GPU time. world_max, when
    given, turns the count into the largest over all ranks (steps that hold collectives)."""
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(max(warmup, 1)):
        fn()
    stop.record()
    stop.synchronize()
    per_call = max(start.elapsed_time(stop) / max(warmup, 1), 1e-3)
    calls = int(min(STEADY_STATE_MS / per_call, 1e5))
    return world_max(calls) if world_max else calls


def median_ms(fn, warmup, repeats, steady=False, world_max=None):
    """Median ms of fn over `repeats` calls after `warmup`; with steady, after enough further calls
    to bring the GPU to its clock under sustained load."""
    if steady:
        for _ in range(steady_state_calls(fn, warmup, world_max)):
            fn()
    else:
        for _ in range(warmup):
            fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def router(logits, bias, E, K, score, groups, group_topk, scale, aux_coeff, z_coeff):
    """Router forward as Megatron-Core's unfused path computes it; returns (probs, idx, loss)."""
    n = logits.shape[0]
    if score == "softmax":
        top_logits, idx = torch.topk(logits, K, dim=-1)
        probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        routing = scores + bias if bias is not None else scores
        if groups:
            group_scores = routing.view(n, groups, -1).topk(K // group_topk, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, group_topk, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(n, groups, E // groups).reshape(n, -1)
            routing = routing.masked_fill(~score_mask.bool(), float("-inf"))
        _, idx = torch.topk(routing, K, dim=-1)
        probs = scores.gather(1, idx)
        if K > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    probs = probs * scale
    loss = 0.0
    if aux_coeff:
        if score == "softmax":
            aux_scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            s = torch.sigmoid(logits.float())
            aux_scores = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
        _, aux_idx = torch.topk(aux_scores, K, dim=-1)
        routing_map = torch.zeros_like(aux_scores).scatter_(1, aux_idx, 1)
        tokens_per_expert = routing_map.sum(dim=0)
        loss = loss + (tokens_per_expert * aux_scores.sum(dim=0)).sum() * E * aux_coeff / (K * n * n)
    if z_coeff:
        loss = loss + torch.logsumexp(logits, dim=-1).square().sum() * z_coeff / n
    return probs, idx, loss


ROUTER_SHAPES = [
    # name (as bench_router), E, K, score, bias, groups, group_topk, scale
    ("E8 K2 softmax (mixtral)", 8, 2, "softmax", False, 0, 0, 1.0),
    ("E128 K8 softmax (qwen3)", 128, 8, "softmax", False, 0, 0, 1.0),
    ("E256 K8 sigmoid+bias 8/4 groups (deepseek-v3)", 256, 8, "sigmoid", True, 8, 4, 2.5),
    ("E1024 K8 sigmoid", 1024, 8, "sigmoid", False, 0, 0, 1.0),
]


def bench_router(quick):
    results = []
    warmup, repeats = (3, 20) if quick else (10, 100)
    for name, E, K, score, use_bias, groups, group_topk, scale in ROUTER_SHAPES:
        sets = max(1, min(16, (256 << 20) // (T * E * 4 * 2)))
        inputs = [torch.randn(T, E, device="cuda", requires_grad=True) for _ in range(sets)]
        bias = torch.zeros(E, device="cuda") if use_bias else None
        dp = torch.randn(T, K, device="cuda")
        state = {"i": 0}

        def step():
            logits = inputs[state["i"] % sets]
            state["i"] += 1
            logits.grad = None
            probs, _, loss = router(logits, bias, E, K, score, groups, group_topk, scale, 0.01, 0.001)
            ((probs * dp).sum() + loss).backward()

        ms = median_ms(step, warmup, repeats)
        results.append({"name": name, "total_us": ms * 1e3})
        print(f"{name:<48} {ms * 1e3:9.1f} us (PyTorch eager)")
    return {"bench": "router", "peer": f"PyTorch {torch.__version__} eager", "tokens": T, "results": results}


def bench_permute(quick):
    """Permute, combine and their backward as torchtitan-style code writes them: index_select with
    the sorted token indices, index_add for the weighted combine."""
    results = []
    warmup, repeats = (3, 20) if quick else (10, 50)
    n, E = 8192, 64
    for H in (2048, 4096, 7168):
        for K in (2, 8):
            idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(n)])
            prob = torch.full((n, K), 0.5, device="cuda")
            flat = idx.flatten()
            order = torch.argsort(flat, stable=True)  # expert-major, token order inside a group
            token_of_row = order // K
            prob_of_row = prob.flatten()[order]
            x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(n * K, H, device="cuda", dtype=torch.bfloat16)

            def permute():
                return x.index_select(0, token_of_row)

            def combine():
                out = torch.zeros(n, H, device="cuda", dtype=torch.bfloat16)
                return out.index_add_(0, token_of_row, y * prob_of_row[:, None].to(y.dtype))

            def combine_backward():
                g = x.index_select(0, token_of_row)
                return g * prob_of_row[:, None].to(g.dtype), (g.float() * y.float()).sum(-1)

            def permute_backward():
                out = torch.zeros(n, H, device="cuda", dtype=torch.bfloat16)
                return out.index_add_(0, token_of_row, y)

            times = [median_ms(f, warmup, repeats) * 1e3 for f in (permute, combine, combine_backward, permute_backward)]
            name = f"H{H} K{K}"
            results.append({"name": name, "total_us": sum(times), "stages_us": times})
            print(f"{name:<14} " + " ".join(f"{t:10.1f}" for t in times) + f" {sum(times):10.1f} us (PyTorch)")
    return {"bench": "permute", "peer": f"PyTorch {torch.__version__} index_select/index_add", "tokens": n,
            "results": results}


EXPERT_SHAPES = [  # name, H, F, E, K (the configs in configs/)
    ("mixtral-8x7b", 4096, 14336, 8, 2),
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("deepseek-v3", 7168, 2048, 256, 8),
]


def routed_offsets(tokens, topk, experts, align):
    """Row offsets as top-K routing gives them, each count padded to `align`: the 64-bit LCG of
    bench_util.h's routed_offsets, so both sides time the same row counts."""
    counts = [0] * experts
    state = 20261122
    mask = (1 << 64) - 1
    for _ in range(tokens * topk):
        state = (state * 6364136223846793005 + 1442695040888963407) & mask
        counts[(state >> 33) % experts] += 1
    offsets, total = [], 0
    for c in counts:
        total += (c + align - 1) // align * align
        offsets.append(total)
    return offsets


def bench_experts(quick):
    """The expert FFN as torchtitan runs it: torch._grouped_mm for both products, SwiGLU in eager
    ops, autograd for the backward."""
    results = []
    warmup, repeats = (2, 5) if quick else (5, 20)
    n = 8192
    for name, H, F, E, K in EXPERT_SHAPES:
        ends = routed_offsets(n, K, E, 16)
        rows = ends[-1]
        offs = torch.tensor(ends, device="cuda", dtype=torch.int32)
        x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w13 = (torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
        w2 = (torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) * F ** -0.5).requires_grad_()
        dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)

        def step():
            h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
            y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
            y.backward(dy)

        ms = median_ms(step, warmup, repeats, steady=True)
        tflops = 18.0 * rows * H * F / (ms * 1e-3) / 1e12
        results.append({"name": name, "total_us": ms * 1e3, "TFLOPs": tflops})
        print(f"{name:<16} {ms * 1e3:9.0f} us {tflops:6.0f} TFLOP/s (torch._grouped_mm)")
        del x, w13, w2, dy
        torch.cuda.empty_cache()
    return {"bench": "experts", "peer": f"PyTorch {torch.__version__} torch._grouped_mm", "tokens": n,
            "results": results}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=["router", "permute", "experts"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {"router": bench_router, "permute": bench_permute, "experts": bench_experts}[args.stage](args.quick)
    report["device"] = torch.cuda.get_device_name()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
