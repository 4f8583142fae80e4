#!/usr/bin/env python3
"""The whole MoE layer in PyTorch as users write it today (torchtitan style), forward + backward,
timed the way moe_bench times ours: same config, tokens per GPU, FLOP count and memory question.

    python3 bench/peer_layer.py --config configs/X.yaml [--tokens T] [--iters I] [--compile]
                                [--json FILE]
    mpirun -np 2 python3 bench/peer_layer.py --config ...      # expert parallel over all ranks

The layer: gate nn.Linear in bf16, the router as Megatron-Core's unfused path computes it
(bench/peers.py), tokens sorted by expert with a stable argsort and gathered; under EP the counts
go first (all_to_all_single, then .tolist(): one host sync) and the rows by the autograd
all_to_all_single; each local expert's rows padded to align_size by a gather index built on the
device (torchtitan's generate_permute_indices, with a static upper bound on the padded rows);
torch._grouped_mm for both expert products with SwiGLU in eager ops; the weighted combine by
scatter_add; a config's shared expert (a dense SwiGLU FFN over every token, with its sigmoid gate
where the config has one) in eager ops on the same stream, added to the routed output, as
torchtitan's MoE adds its shared experts; autograd for the backward. Weights and their gradients
are bf16.

--compile runs the layer's forward through torch.compile, as torchtitan compiles its models: the
router, the permutation, SwiGLU and the combine fused by Inductor (forward and backward), the
grouped products as they are, and on one GPU no host synchronisation. Under EP the count
exchange's host sync and the collectives break the graph; the pieces between stay compiled. This
is the stronger of the two peers wherever it runs faster.
"""
import argparse
import json
import os
import sys

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except ImportError:
    raise SystemExit("peer_layer.py: needs PyTorch, which the peer layer runs on")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import median_ms, router  # noqa: E402  (the same router code as the stage peer)


def load_config(path):
    import yaml  # PyYAML: the configs are flat `key: value` maps

    with open(path) as f:
        return yaml.safe_load(f)


def init_distributed():
    """Rank and world from Open MPI's environment when launched by mpirun; NCCL underneath."""
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    return rank, world


class TorchtitanStyleMoE:
    def __init__(self, cfg, ep, rank):
        self.H, self.F, self.E, self.K = cfg["hidden"], cfg["ffn_hidden"], cfg["num_experts"], cfg["topk"]
        self.ep, self.rank = ep, rank
        self.E_loc = self.E // ep
        self.score = cfg.get("score_function", "softmax")
        self.groups, self.group_topk = cfg.get("num_groups", 0), cfg.get("group_topk", 0)
        if cfg.get("max_nodes_per_token", 0):  # node-limited routing: one group per node
            self.groups = ep // cfg["ep_ranks_per_node"]
            self.group_topk = cfg["max_nodes_per_token"]
        self.scale = cfg.get("scaling_factor", 1.0)
        self.aux_coeff, self.z_coeff = cfg.get("aux_loss_coeff", 0.0), cfg.get("z_loss_coeff", 0.0)
        self.align = max(1, cfg.get("align_size", 0))
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        self.wg = (torch.randn(self.E, self.H, **bf16) * self.H ** -0.5).requires_grad_()
        self.w13 = (torch.randn(self.E_loc, 2 * self.F, self.H, **bf16) * self.H ** -0.5).requires_grad_()
        self.w2 = (torch.randn(self.E_loc, self.H, self.F, **bf16) * self.F ** -0.5).requires_grad_()
        self.bias = torch.zeros(self.E, device="cuda") if cfg.get("expert_bias", False) else None
        self.Fs = cfg.get("shared_ffn_hidden", 0)
        self.shared = []  # w13 [2Fs, H], w2 [H, Fs], and the gate's [1, H] where the config has one
        if self.Fs:
            self.shared = [(torch.randn(2 * self.Fs, self.H, **bf16) * self.H ** -0.5).requires_grad_(),
                           (torch.randn(self.H, self.Fs, **bf16) * self.Fs ** -0.5).requires_grad_()]
            if cfg.get("shared_gate", False):
                self.shared.append((torch.randn(1, self.H, **bf16) * self.H ** -0.5).requires_grad_())

    def parameters(self):
        return [self.wg, self.w13, self.w2] + self.shared

    def shared_expert(self, x):
        h = F.linear(x, self.shared[0])
        out = F.linear(F.silu(h[:, : self.Fs]) * h[:, self.Fs:], self.shared[1])
        if len(self.shared) == 3:
            out = out * torch.sigmoid(F.linear(x, self.shared[2]))
        return out

    def padded_gather_index(self, counts, rows):
        """counts [ep, E_loc] (device): rows from source s for local expert e, source-major in the
        received buffer of `rows` rows. Returns (index into the buffer plus one zero row, for each
        padded expert-major row; group end offsets; each received row's padded position)."""
        A = self.align
        per_expert = counts.sum(0)
        padded = (per_expert + A - 1) // A * A
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        flat = counts.reshape(-1)
        src_starts = torch.cumsum(flat, 0) - flat
        dst_starts = (starts.unsqueeze(0) + torch.cumsum(counts, 0) - counts).reshape(-1)
        chunk = torch.repeat_interleave(torch.arange(flat.numel(), device="cuda"), flat, output_size=rows)
        position = dst_starts[chunk] + torch.arange(rows, device="cuda") - src_starts[chunk]
        bound = rows + self.E_loc * A  # static: no host sync for the padded size
        index = torch.full((bound,), rows, device="cuda", dtype=torch.long)  # padding -> zero row
        index[position] = torch.arange(rows, device="cuda")
        return index, ends.to(torch.int32), position

    def forward(self, x):
        T, K = x.shape[0], self.K
        logits = F.linear(x, self.wg).float()
        probs, idx, loss = router(logits, self.bias, self.E, K, self.score, self.groups, self.group_topk,
                                  self.scale, self.aux_coeff, self.z_coeff)
        order = torch.argsort(idx.reshape(-1), stable=True)
        token_of_row = order // K
        routed = x.index_select(0, token_of_row)  # expert-major over the global experts
        counts = torch.bincount(idx.reshape(-1), minlength=self.E)
        if self.ep > 1:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts)
            send_splits = counts.view(self.ep, self.E_loc).sum(1).tolist()
            recv_splits = received.view(self.ep, self.E_loc).sum(1).tolist()
            routed = all_to_all_single_autograd(routed, recv_splits, send_splits, dist.group.WORLD)
            local_counts = received.view(self.ep, self.E_loc)
            rows = sum(recv_splits)
        else:
            local_counts = counts.view(1, self.E)
            rows = T * K
        index, offs, position = self.padded_gather_index(local_counts, rows)
        padded = torch.vstack((routed, routed.new_zeros(1, self.H)))[index]
        h = torch._grouped_mm(padded, self.w13.transpose(-2, -1), offs=offs)
        a = F.silu(h[:, : self.F]) * h[:, self.F:]
        y = torch._grouped_mm(a, self.w2.transpose(-2, -1), offs=offs)
        y = y.index_select(0, position)  # back to the received order
        if self.ep > 1:
            y = all_to_all_single_autograd(y, send_splits, recv_splits, dist.group.WORLD)
        weighted = (y.float() * probs.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        out = torch.zeros_like(x).scatter_add(0, token_of_row.unsqueeze(-1).expand(-1, self.H), weighted)
        if self.Fs:
            out = out + self.shared_expert(x)
        return out, loss


def all_to_all_single_autograd(tensor, output_splits, input_splits, group):
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    return a2a(tensor, output_splits, input_splits, group)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokens", type=int, default=0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--compile", action="store_true",
                        help="the forward through torch.compile (Inductor), as torchtitan runs it")
    args = parser.parse_args()
    rank, world = init_distributed()
    cfg = load_config(args.config)
    T = args.tokens or cfg["tokens"]
    torch.manual_seed(1234 + rank)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # 0: nothing allocated yet, so reserved starts at 0 too
    torch.cuda.reset_peak_memory_stats()
    layer = TorchtitanStyleMoE(cfg, world, rank)
    x = torch.randn(T, layer.H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, layer.H, device="cuda", dtype=torch.bfloat16) * 1e-2
    # Compiled on the first call, which the warm-up holds (with its recompilations under EP, where
    # the received rows change from step to step).
    forward = torch.compile(layer.forward) if args.compile else layer.forward

    def step():
        for p in layer.parameters() + [x]:
            p.grad = None
        out, loss = forward(x)
        tensors, grads = [out], [dy]
        if torch.is_tensor(loss):
            tensors.append(loss)
            grads.append(torch.ones_like(loss))
        torch.autograd.backward(tensors, grads)

    def world_max(n):  # every rank runs the same number of steps: they hold collectives
        if world == 1:
            return n
        t = torch.tensor([n], device="cuda", dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    # Timed at the clock the GPU holds under sustained load, as moe_bench times our layer.
    ms = median_ms(step, args.warmup, args.iters, steady=True, world_max=world_max)
    if world > 1:  # the slowest rank, as moe_bench reports
        t = torch.tensor([ms], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = t.item()
    peak = torch.cuda.max_memory_allocated() - base
    reserved = torch.cuda.max_memory_reserved() - base  # what the caching allocator took
    # The step above frees the gradients before each step (zero_grad(set_to_none=True), as
    # torchtitan does), so its peak counts only the gradients backward has made so far. A trainer
    # that keeps gradients (Megatron-Core's grad buffers, gradient accumulation), as MoEBlock's
    # bound gradients are kept, holds all of them through the step: measured here by one more step
    # that accumulates into the gradients of the last.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out, loss = forward(x)
    torch.autograd.backward([out] + ([loss] if torch.is_tensor(loss) else []),
                            [dy] + ([torch.ones_like(loss)] if torch.is_tensor(loss) else []))
    del out, loss
    torch.cuda.synchronize()
    peak_kept = torch.cuda.max_memory_allocated() - base
    H, Fh, E, K = layer.H, layer.F, layer.E, layer.K
    flops = 6.0 * T * E * H + 18.0 * T * K * H * Fh
    style = "torchtitan-style layer" + (", torch.compile" if args.compile else "")
    report = {"peer": f"PyTorch {torch.__version__} {style}", "compiled": args.compile,
              "device": torch.cuda.get_device_name(),
              "config": os.path.basename(args.config), "ranks": world, "ep": world, "tokens_per_gpu": T,
              "total_ms": ms, "TFLOPs_per_gpu": flops / (ms * 1e-3) / 1e12, "memory_bytes": peak,
              "memory_reserved_bytes": reserved, "memory_grads_kept_bytes": peak_kept}
    if rank == 0:
        print(f"PyTorch layer{' (compiled)' if args.compile else ''} {report['config']} EP={world}: {ms:.3f} ms, {report['TFLOPs_per_gpu']:.0f} TFLOP/s "
              f"per GPU, peak memory {peak / 2**30:.2f} GiB ({peak / 1024 / T:.1f} KiB per token), "
              f"{peak_kept / 2**30:.2f} GiB with gradients kept")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
