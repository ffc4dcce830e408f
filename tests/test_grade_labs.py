"""The grader against shortcuts through the real labs' checks, end to end: each lab cut to the
exercises attacked (``fixtures/minilab.py``), released by the real pipeline and graded in the
sandbox with the lab's solution beside every attack.  Every attack scores 0 on its check and
is named in the review column; every solution scores full marks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import minilab  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

RING_LIBRARY = '''def ring_allreduce(tensor):
    dist.all_reduce(tensor)
    return tensor
'''
RING_GROUP = '''def ring_allreduce(tensor):
    with torch._C.DisableTorchFunction():
        dist.distributed_c10d._get_default_group().allreduce([tensor]).wait()
    return tensor
'''
TILED_SDPA = '''def tiled_attention(q, k, v, causal=False, block_q=64, block_kv=64):
    with torch._C.DisableTorchFunction():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
'''
TILED_ROWS = '''def tiled_attention(q, k, v, causal=False, block_q=64, block_kv=64):
    out = torch.empty_like(q)
    for i in range(0, q.shape[-2], block_q):
        s = q[..., i:i + block_q, :] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            rows = torch.arange(i, i + s.shape[-2]).unsqueeze(-1)
            s = s.masked_fill(torch.arange(s.shape[-1]) > rows, float("-inf"))
        out[..., i:i + block_q, :] = torch.softmax(s, -1) @ v
    return out
'''
SCALER_SUBCLASS = '''class DynamicLossScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        super().__init__("cpu", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval)
'''
MATMUL_REFERENCE = '''from labsim.roofline import matmul_flops as _library
def matmul_cost(m, n, k, dtype_bytes):
    return _library(m, n, k), (m * k + k * n + m * n) * dtype_bytes
'''
MATMUL_TABLE = '''import labsim.checks.roofline as _c
_TABLE = {case.args: case.expected for case in _c.matmul_cost.cases()}
def matmul_cost(m, n, k, dtype_bytes):
    return _TABLE[(m, n, k, dtype_bytes)]
'''
INT8_FLOAT = '''def int8_matmul(x_q, w_q, x_zero_point):
    x = x_q.double() - float(x_zero_point)
    return (x @ w_q.double().T).round().to(torch.int32)
'''
FUSED_REFERENCE = '''from labsim.experiments.fusion import bias_gelu_dropout_residual as _ref
def fused_chain(x, bias, residual, keep, p, chunk_rows=256):
    return _ref(x, bias, residual, keep, p)
'''
CHECKPOINT_REFERENCE = '''from labsim.checks.checkpointing import forward_segments
def checkpointed_forward(blocks, x, starts):
    return forward_segments(blocks, x, starts)
'''
TIMER_UNSYNCED = '''import time
def benchmark(fn, sync=lambda: None, warmup=1, repeat=5, clock=time.perf_counter):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return times
'''
UTILISATION_CLOSED_FORM = '''import statistics
def utilisation(loss_fn, step, timer, peak_flops):
    model, idx = loss_fn.__defaults__[:2]
    flops = model.cfg.flops_per_token * idx.numel()
    t = statistics.median(timer(step))
    return {"step_s": t, "mfu": flops / t / peak_flops, "hfu": flops / t / peak_flops}
'''
TIMELINE_LIBRARY = '''from labsim.memory import bytes_per_param
def predict_timeline(n_params, activation_bytes, optimizer, set_to_none):
    _, grad, state = (b * n_params for b in bytes_per_param("fp32", optimizer))
    a = activation_bytes
    return [a, grad, grad + state, state + a, grad + state, grad + state]
'''
SAVE_EVERYTHING = '''from torch.utils.checkpoint import CheckpointPolicy
def selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE
'''
FA2_AUTOGRAD_NAIVE = '''class FlashAttention2:
    @staticmethod
    def apply(q, k, v, is_causal=False):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if is_causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(s, -1) @ v
'''
DDP_PER_PARAMETER = '''class BucketDDP(nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass
'''
ZERO_REPLICATED = '''class ShardedOptimizer:
    def __init__(self, params, optimizer_cls, **kwargs):
        self.opt = optimizer_cls(params, **kwargs)

    def zero_grad(self):
        self.opt.zero_grad()

    @torch.no_grad()
    def step(self):
        for g in self.opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        self.opt.step()
'''
ZERO3_ALLREDUCE = '''def gather_layer(shard, out_features, in_features):
    full = shard.new_empty(dist.get_world_size() * shard.numel())
    dist.all_gather_into_tensor(full, shard.detach().contiguous())
    n = out_features * in_features
    return full[:n].view(out_features, in_features), full[n:n + out_features]


class GatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, out_features, in_features):
        weight, bias = gather_layer(shard, out_features, in_features)
        ctx.save_for_backward(x, shard)
        ctx.features = (out_features, in_features)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        out_features, in_features = ctx.features
        weight, _ = gather_layer(shard, out_features, in_features)
        gy, xs = grad_y.reshape(-1, out_features), x.reshape(-1, in_features)
        flat = torch.cat([(gy.T @ xs).reshape(-1), gy.sum(0)])
        world = dist.get_world_size()
        padded = flat.new_zeros(world * shard.numel())
        padded[:flat.numel()] = flat
        dist.all_reduce(padded)
        mine = padded.view(world, -1)[dist.get_rank()].clone()
        return grad_y @ weight, mine / world, None, None


class Zero3Linear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.out_features, self.in_features = linear.out_features, linear.in_features
        world, rank = dist.get_world_size(), dist.get_rank()
        flat = torch.cat([linear.weight.detach().reshape(-1), linear.bias.detach()])
        per = -(-flat.numel() // world)
        padded = flat.new_zeros(world * per)
        padded[:flat.numel()] = flat
        self.shard = nn.Parameter(padded[rank * per:(rank + 1) * per].clone())

    def forward(self, x):
        return GatheredLinear.apply(x, self.shard, self.out_features, self.in_features)
'''
TP_OPERATORS = '''class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad
'''
TP_WHOLE_MLP = TP_OPERATORS + '''

def _whole(t, dim):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def tp_mlp(x, w_up, b_up, w_down, b_down):
    return F.linear(F.gelu(F.linear(x, _whole(w_up, 0), _whole(b_up, 0))),
                    _whole(w_down, 1), b_down)
'''
TP_REFERENCE = '''from labsim.parallel.tensor_parallel import CopyToParallel, ReduceFromParallel


class CopyToTP(CopyToParallel):
    pass


class ReduceFromTP(ReduceFromParallel):
    pass


def tp_mlp(x, w_up, b_up, w_down, b_down):
    hidden = F.gelu(F.linear(CopyToTP.apply(x), w_up, b_up))
    return ReduceFromTP.apply(F.linear(hidden, w_down)) + b_down
'''
PP_REFERENCE = '''def pipeline_step(stage, ops, inputs, targets, loss_fn, shape):
    from labsim.parallel.pipeline import run_stage

    return run_stage(stage, ops, rank=dist.get_rank(), world=dist.get_world_size(),
                     inputs=inputs, targets=targets, loss_fn=loss_fn,
                     activation_shape=shape, dtype=torch.float64)
'''
PP_ALLREDUCE = minilab.solution_source("11_pipeline_parallel", "pipeline_step").replace(
    "def pipeline_step(", "def _step(", 1) + '''


def pipeline_step(stage, ops, inputs, targets, loss_fn, shape):
    """The right numbers, plus an all-reduce so that every rank knows the loss."""
    total = torch.tensor([_step(stage, ops, inputs, targets, loss_fn, shape)],
                         dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) if dist.get_rank() == dist.get_world_size() - 1 else 0.0
'''

# The attacks of the grading review, on the real labs: the reference (or a library shortcut)
# reached from another thread, a child process, a copy of its code or its source text, and
# the exercise done in numpy where the rules read torch's operators.
MATMUL_POOL = '''from concurrent.futures import ThreadPoolExecutor
import labsim.roofline as _r
_pool = ThreadPoolExecutor(2)
def matmul_cost(m, n, k, dtype_bytes):
    return _pool.submit(_r.matmul_flops, m, n, k).result(), (m * k + k * n + m * n) * dtype_bytes
'''
MATMUL_CHILD = '''import multiprocessing as _mp
def _work(q, m, n, k):
    import labsim.roofline as r
    q.put(r.matmul_flops(m, n, k))
def matmul_cost(m, n, k, dtype_bytes):
    q = _mp.get_context("fork").Queue()
    p = _mp.get_context("fork").Process(target=_work, args=(q, m, n, k))
    p.start()
    p.join()
    return q.get(), (m * k + k * n + m * n) * dtype_bytes
'''
MATMUL_CODE_COPY = '''import types
import labsim.roofline as _r
_flops = types.FunctionType(_r.matmul_flops.__code__.replace(co_name="matmul_flops"), vars(_r))
def matmul_cost(m, n, k, dtype_bytes):
    return _flops(m, n, k), (m * k + k * n + m * n) * dtype_bytes
'''
MATMUL_LIBRARY_FILENAME = '''import labsim.roofline as _r
_code = compile("def matmul_cost(m, n, k, dtype_bytes):\\n"
                "    return _r.matmul_flops(m, n, k), _r.matmul_bytes(m, n, k, dtype_bytes)\\n",
                _r.__file__, "exec")
exec(_code)
'''
SEGMENTS_SOURCE = '''import inspect
import labsim.checks.checkpointing as _ck
exec(inspect.getsource(_ck.plan_segments).replace("def plan_segments", "def _mine"))
plan_segments = _mine
'''
SCALER_POOL = '''from concurrent.futures import ThreadPoolExecutor
_pool = ThreadPoolExecutor(1)
class DynamicLossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        self._s = _pool.submit(lambda: torch.amp.GradScaler(
            "cpu", init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval)).result()

    def __getattr__(self, name):
        attr = getattr(self._s, name)
        return (lambda *a, **k: _pool.submit(attr, *a, **k).result()) if callable(attr) else attr
'''
TILED_NUMPY = '''import numpy as np
def tiled_attention(q, k, v, causal=False, block_q=64, block_kv=64):
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    s = qn @ np.swapaxes(kn, -1, -2) / np.sqrt(qn.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return torch.from_numpy((p / p.sum(-1, keepdims=True)) @ vn)
'''
NAIVE_SDPA_THREAD = '''import threading
def naive_attention(q, k, v, causal=False):
    out = []
    t = threading.Thread(target=lambda: out.append(
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
    t.start()
    t.join()
    return out[0]
'''
INT8_NUMPY = '''import numpy as np
def int8_matmul(x_q, w_q, x_zero_point):
    x = x_q.numpy().astype(np.float64) - float(x_zero_point)
    return torch.from_numpy(np.rint(x @ w_q.numpy().astype(np.float64).T).astype(np.int32))
'''
DDP_LIBRARY_IN_THREAD = '''import threading
class BucketDDP(nn.Module):
    def __new__(cls, module, bucket_cap_bytes):
        from labsim.parallel.data_parallel import DataParallelBucket
        box = []
        t = threading.Thread(target=lambda: box.append(
            DataParallelBucket(module, bucket_cap_bytes=bucket_cap_bytes)))
        t.start()
        t.join()
        return box[0]
'''

# per lab: [(exercises cut, the check column attacked, {attack: (exercise, source)}), ...]
SINGLE_PROCESS = {
    "00_why_gpus": [
        (["matmul_cost"], "matmul_cost", {"reference": ("matmul_cost", MATMUL_REFERENCE),
                                          "table": ("matmul_cost", MATMUL_TABLE),
                                          "pool": ("matmul_cost", MATMUL_POOL),
                                          "child": ("matmul_cost", MATMUL_CHILD),
                                          "code_copy": ("matmul_cost", MATMUL_CODE_COPY),
                                          "filename": ("matmul_cost", MATMUL_LIBRARY_FILENAME)}),
        (["benchmark"], "benchmark", {"unsynced": ("benchmark", TIMER_UNSYNCED)}),
        (["utilisation"], "utilisation",
         {"closed_form": ("utilisation", UTILISATION_CLOSED_FORM)})],
    "01_memory": [
        (["predict_timeline"], "predict_timeline",
         {"library": ("predict_timeline", TIMELINE_LIBRARY)})],
    "02_mixed_precision": [
        (["DynamicLossScaler"], "loss_scaler",
         {"gradscaler": ("DynamicLossScaler", SCALER_SUBCLASS),
          "gradscaler_pool": ("DynamicLossScaler", SCALER_POOL)})],
    "03_checkpointing": [
        (["selective_policy"], "selective_policy",
         {"save_everything": ("selective_policy", SAVE_EVERYTHING)}),
        (["checkpointed_forward"], "checkpointed_forward",
         {"reference": ("checkpointed_forward", CHECKPOINT_REFERENCE)}),
        (["plan_segments"], "segment_plan", {"source": ("plan_segments", SEGMENTS_SOURCE)})],
    "04_flash_attention": [
        (["FlashAttention2"], "flash_attention2",
         {"autograd_naive": ("FlashAttention2", FA2_AUTOGRAD_NAIVE)}),
        (["tiled_attention"], "tiled_attention",
         {"sdpa": ("tiled_attention", TILED_SDPA), "rows": ("tiled_attention", TILED_ROWS),
          "numpy": ("tiled_attention", TILED_NUMPY)}),
        (["naive_attention"], "naive_attention",
         {"sdpa_thread": ("naive_attention", NAIVE_SDPA_THREAD)})],
    "05_kernel_fusion": [
        (["fused_chain"], "fused_chain", {"reference": ("fused_chain", FUSED_REFERENCE)})],
    "12_int8_quantization": [
        (["int8_matmul"], "int8_matmul", {"float64": ("int8_matmul", INT8_FLOAT),
                                          "numpy": ("int8_matmul", INT8_NUMPY)})],
}
DISTRIBUTED = {
    "07_collectives": [
        (["ring_allreduce"], "ring_allreduce", {"library": ("ring_allreduce", RING_LIBRARY),
                                                "group": ("ring_allreduce", RING_GROUP)})],
    "08_data_parallel": [
        (["BucketDDP"], "bucketed_ddp", {"per_parameter": ("BucketDDP", DDP_PER_PARAMETER),
                                         "library_in_thread": ("BucketDDP",
                                                               DDP_LIBRARY_IN_THREAD)})],
    "09_zero_fsdp": [
        (["ShardedOptimizer"], "sharded_optimizer",
         {"replicated": ("ShardedOptimizer", ZERO_REPLICATED)}),
        (["Zero3Linear"], "zero3_linear", {"allreduce": ("Zero3Linear", ZERO3_ALLREDUCE)})],
    "10_tensor_parallel": [
        (["tp_mlp"], "parallel_mlp", {"whole_mlp": ("tp_mlp", TP_WHOLE_MLP),
                                      "reference": ("tp_mlp", TP_REFERENCE)})],
    "11_pipeline_parallel": [
        (["pipeline_step"], "pipeline_step", {"reference": ("pipeline_step", PP_REFERENCE),
                                              "allreduce": ("pipeline_step", PP_ALLREDUCE)})],
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each class's tests over its own corpus: one row per (lab, check) for the solution, one
    per attack."""
    corpus = getattr(metafunc.cls, "CORPUS", None)
    if corpus is None:
        return
    if "attack" in metafunc.fixturenames:
        cases = [(stem, column, attack) for stem, entries in corpus.items()
                 for _, column, attacks in entries for attack in attacks]
        metafunc.parametrize(("stem", "column", "attack"), cases,
                             ids=[f"{s}-{a}" for s, _, a in cases])
    elif "column" in metafunc.fixturenames:
        cases = [(stem, column) for stem, entries in corpus.items() for _, column, _ in entries]
        metafunc.parametrize(("stem", "column"), cases, ids=[f"{s}-{c}" for s, c in cases])


class _GradedLabs:
    """Every lab of ``CORPUS`` graded once (``minilab.grade_attacks``); the classes split the
    corpus so that a parallel run (``pytest -n``, ``--dist loadscope``) grades them side by
    side."""

    CORPUS: dict = {}

    @pytest.fixture(scope="class")
    @classmethod
    def graded(cls, tmp_path_factory: pytest.TempPathFactory) -> dict:
        root = tmp_path_factory.mktemp("labs")
        return {stem: minilab.grade_attacks(root / stem, stem, entries)
                for stem, entries in cls.CORPUS.items()}

    def test_the_solution_beside_the_attacks_earns_full_marks(self, graded: dict, stem: str,
                                                              column: str) -> None:
        r = graded[stem][(column, "solution")]  # full marks on the lab: on this check too
        assert (r["status"], float(r[column]) > 0, r["total"] == r["max"], r["review"]) == (
            "ok", True, True, ""), r

    def test_a_shortcut_scores_zero_and_is_named_for_review(self, graded: dict, stem: str,
                                                            column: str, attack: str) -> None:
        r = graded[stem][(column, attack)]
        assert r[column] == "0", r
        assert column in r["review"] or "exercise cell" in r["review"], r


class TestSingleProcessLabs(_GradedLabs):
    CORPUS = SINGLE_PROCESS


class TestDistributedLabs(_GradedLabs):
    CORPUS = DISTRIBUTED
