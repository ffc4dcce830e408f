"""The PyTorch GPT has exactly labsim's parameter count and Korthikanti's activations."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from labsim import Transformer
from labsim.lab.datasets import random_batch
from labsim.lab.memory import LiveBytes, MemoryMeter
from labsim.lab.models import GPT, Block
from labsim.memory import activation_per_layer, step_memory
from labsim.plan import Plan


@pytest.mark.parametrize("name", ["gpt2-124m", "llama2-7b", "llama2-70b", "gpt2-350m"])
def test_param_count_equals_formula(name: str) -> None:
    cfg = Transformer.preset(name)
    with torch.device("meta"):  # shapes only: no memory
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.params


@pytest.mark.parametrize(
    "cfg",
    [
        Transformer(2, 64, 4, 32, 100),
        Transformer(3, 48, 6, 16, 77, ffn_hidden=100, tied_embeddings=True),
        Transformer(2, 64, 8, 32, 100, kv_heads=2, swiglu=True, positions="rotary",
                    norm="rmsnorm", bias=False),
        Transformer(1, 32, 2, 8, 50, kv_heads=1, swiglu=True, bias=True),
    ],
)
def test_small_models_run_and_count(cfg: Transformer) -> None:
    torch.manual_seed(0)
    model = GPT(cfg, dropout=0.1)
    assert sum(p.numel() for p in model.parameters()) == cfg.params
    idx, tgt = random_batch(cfg, 2)
    logits, loss = model(idx, tgt)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_flash_equals_written_out_attention() -> None:
    torch.manual_seed(0)
    cfg = Transformer(2, 64, 4, 32, 100, kv_heads=2, positions="rotary", norm="rmsnorm")
    a, b = GPT(cfg).eval(), GPT(cfg, flash=True).eval()
    b.load_state_dict(a.state_dict())
    idx, _ = random_batch(cfg, 2)
    torch.testing.assert_close(a(idx)[0], b(idx)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("flash", [False, True], ids=["scores", "flash"])
def test_block_activations_match_the_formula(swiglu: bool, dropout: float, flash: bool) -> None:
    # fp32 on the CPU: values d = 4 bytes, and the CPU dropout keeps float masks (m = 4).
    # The only extra tensors are LayerNorm's mean and 1/std (2 x fp32 per token per norm).
    if flash and dropout:
        pytest.skip("PyTorch's CPU flash kernel has no dropout (sdp_utils_cpp.cpp, "
                    "check_for_dropout): SDPA falls back to the math path")
    mlp = {"swiglu": True, "ffn_hidden": 344, "bias": False} if swiglu else {}
    cfg = Transformer(1, 128, 4, 64, 100, dropout=dropout > 0, **mlp)
    block = Block(cfg, dropout=dropout, flash=flash).train()
    s, b = cfg.seq_len, 3
    with MemoryMeter(block) as meter:
        block(torch.randn(b, s, cfg.hidden))
    formula = activation_per_layer(cfg, micro_batch=b, dtype_bytes=4,
                                   mask_bytes=4 if dropout else 0,
                                   attention="flash" if flash else "standard")
    assert meter.saved_bytes == formula + 2 * 2 * 4 * s * b


class _FusedSwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping its inputs only, as Megatron-Core's ``SwiGLUFunction``
    (``megatron/core/fusions/fused_bias_swiglu.py``): the SiLU is recomputed in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        return grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig


def test_a_fused_swiglu_keeps_three_f_wide_tensors_as_the_formula_says(monkeypatch) -> None:
    # The same block as above with the SwiGLU as one function that keeps gate and up: the
    # measured saved bytes drop by one f-wide tensor, what swiglu_fused=True counts.
    cfg = Transformer(1, 128, 4, 64, 100, dropout=False, swiglu=True, ffn_hidden=344, bias=False)
    s, b = cfg.seq_len, 3

    def fused_mlp(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(_FusedSwiGLU.apply(gate, up))

    torch.manual_seed(0)
    x = torch.randn(b, s, cfg.hidden)
    plain = Block(cfg).train()
    fused = Block(cfg).train()
    fused.load_state_dict(plain.state_dict())
    monkeypatch.setattr(fused, "mlp", fused_mlp.__get__(fused))
    saved = []
    for block in (plain, fused):
        with MemoryMeter(block) as meter:
            y = block(x)
        saved.append(meter.saved_bytes)
        y.sum().backward()
    torch.testing.assert_close(fused.up.weight.grad, plain.up.weight.grad)
    norms = 2 * 2 * 4 * s * b
    assert saved[0] == activation_per_layer(cfg, micro_batch=b, dtype_bytes=4) + norms
    assert saved[1] == activation_per_layer(cfg, micro_batch=b, dtype_bytes=4,
                                            swiglu_fused=True) + norms
    assert saved[0] - saved[1] == 4 * s * b * cfg.ffn_hidden


def test_a_checkpointed_stack_peaks_at_its_checkpoints_plus_one_layer_whole() -> None:
    """Measured: six GPT layers, each checkpointed (weights frozen, so no weight gradients
    accumulate), hold their six inputs after the forward, and during the backward the peak of
    live storages is those plus one layer recomputed whole (``labsim.memory.step_memory``'s
    count, the segment model's), far above the inputs alone (Korthikanti et al.'s per-layer
    count); what is left over is the backward's own activation gradients."""
    torch.manual_seed(0)
    layers, b = 6, 2
    cfg = Transformer(layers, 256, 4, 128, 100, dropout=False)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(layers)).train()
    blocks.requires_grad_(False)
    x = torch.randn(b, cfg.seq_len, cfg.hidden, requires_grad=True)
    with LiveBytes() as live:
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        after_forward = live.live
        h.sum().backward()
    s = cfg.seq_len
    kept = 4 * s * b * cfg.hidden  # each layer's input, fp32
    whole = activation_per_layer(cfg, micro_batch=b, dtype_bytes=4) + 2 * 2 * 4 * s * b
    assert after_forward == layers * kept
    model = (layers - 1) * kept + whole
    assert model <= live.peak <= 1.15 * model
    assert live.peak > 3 * layers * kept
    plan = Plan(micro_batch=b, global_batch=b, recompute="full", precision="fp32",
                attention="standard")
    norms = 2 * 2 * 4 * s * b  # LayerNorm's mean and 1/std, which the formula leaves out
    assert step_memory(cfg, plan, 1).activations == pytest.approx(model - norms)


def test_long_sequence_rejected() -> None:
    cfg = Transformer(1, 32, 2, 8, 50)
    with pytest.raises(ValueError, match="seq_len"):
        GPT(cfg)(torch.zeros(1, 9, dtype=torch.long))


def test_recompute_gives_the_same_gradients_and_keeps_less() -> None:
    cfg = Transformer(2, 32, 2, 16, 64, tied_embeddings=True)
    idx, targets = random_batch(cfg, batch=2, seed=0)
    grads, saved = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg, recompute=recompute)
        with MemoryMeter(model) as meter:
            loss = model(idx, targets)[1]
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        saved.append(meter.saved_bytes)
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
    assert saved[1] < saved[0] / 2  # only each block's input is kept
    with torch.no_grad():
        model(idx)  # no checkpoint without gradients
