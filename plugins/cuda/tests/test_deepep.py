"""``deepep`` in one process: plan-time constraints and dtype validation, the buffer registry, the
async ``Pending``, and the emulated DeepEP ops that need no communication (each against a direct
computation from vendor-apis.md section 1). Multi-process tests: ``test_deepep_ep.py``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_core import MoEConfig
from moe_core.backends import Code
from moe_core.planner import PlanError, plan


def _cfg(**kw):
    base = dict(num_experts=16, top_k=4, hidden_size=2048, intermediate_size=256, ep_size=2, ep_rank=0,
                device="cuda", dispatcher="deepep", experts="reference")
    return MoEConfig(**{**base, **kw})


def _reasons(cfg, manager, **kw):
    with pytest.raises(PlanError) as exc:
        plan(cfg, manager=manager, **kw)
    return [r for rej in exc.value.rejected if "deepep" in rej.dispatcher for r in rej.reasons]


# --------------------------------------------------------------------------- planning


def test_probe_sees_the_emulation(deepep_manager):
    spec = deepep_manager.spec("deepep")
    assert deepep_manager.availability(spec).ok


def test_normal_mode_planned_and_not_graph_safe(deepep_manager):
    p = plan(_cfg(quant="fp8_block"), manager=deepep_manager)
    assert (p.dispatcher.name, str(p.format), str(p.dispatch_dtype), p.graph_safe) == ("deepep", "ep_normal", "fp8", False)
    p = plan(_cfg(max_tokens_per_rank=64, cuda_graph=True, experts="triton"), manager=deepep_manager, dry_run=True)
    assert (str(p.format), p.graph_safe) == ("ep_masked", True)  # cuda_graph: only low latency is graph-safe


def test_nvfp4_wire_rejected_with_reason(deepep_manager):
    reasons = _reasons(_cfg(quant="nvfp4", dispatch_dtype="nvfp4", max_tokens_per_rank=32), deepep_manager)
    assert any(r.code is Code.UNSUPPORTED_QUANT and "NVFP4" in r.message for r in reasons), reasons


def test_low_latency_constraints_forced_by_config(deepep_manager):
    # hidden 1000: no low-latency kernel; no capacity; QP count option != local experts
    cfg = _cfg(hidden_size=1000, dispatch_format="ep_masked", backend_options={"deepep": {"num_qps_per_rank": 3}})
    msgs = " | ".join(r.message for r in _reasons(cfg, deepep_manager))
    assert "low-latency kernel" in msgs and "max_tokens_per_rank" in msgs and "num_qps_per_rank=3" in msgs


def test_qp_depth_uses_the_rounded_num_max(deepep_manager):
    from moe_plugin_cuda.probes import deepep_num_max

    cfg = _cfg(max_tokens_per_rank=511, ep_size=2, dispatch_format="ep_masked")
    assert deepep_num_max(cfg) == 512  # 2 * 511 % 4 != 0
    msgs = " | ".join(r.message for r in _reasons(cfg, deepep_manager))
    assert "NVSHMEM_QP_DEPTH >= 1026" in msgs
    plan(cfg.replace(backend_options={"deepep": {"qp_depth": 2048}}), manager=deepep_manager)


def test_format_dependent_checks_run_in_the_dtype_wrapper(deepep_manager):
    """With auto format and dtype, only the wrapper knows the mode and the dtype: FP8 normal needs
    H % 128; experts that accept EP_MASKED only get the low-latency constraints."""
    reasons = _reasons(_cfg(hidden_size=1000, quant="fp8_block"), deepep_manager)
    assert any("multiple of 128" in r.message for r in reasons), reasons
    # cutedsl takes EP_MASKED only: the low-latency constraints come from the wrapper
    cutedsl = _cfg(quant="nvfp4", experts="cutedsl", max_tokens_per_rank=32)
    p = plan(cutedsl, manager=deepep_manager, dry_run=True)
    assert (str(p.format), str(p.dispatch_dtype)) == ("ep_masked", "bf16")  # NVFP4 experts quantize the slab
    with pytest.raises(PlanError, match="no DeepEP low-latency kernel"):
        plan(cutedsl.replace(hidden_size=1024), manager=deepep_manager, dry_run=True)
    fp8 = _cfg(hidden_size=2560, quant="fp8_block", max_tokens_per_rank=32)
    assert str(plan(fp8, manager=deepep_manager).format) == "ep_normal"  # 2560 % 128 == 0
    p = plan(fp8.replace(dispatch_format="ep_masked"), manager=deepep_manager)
    assert (str(p.format), str(p.dispatch_dtype)) == ("ep_masked", "fp8")


def test_build_needs_a_process_group(deepep_manager):
    p = plan(_cfg(), manager=deepep_manager)
    with pytest.raises(RuntimeError, match="process group"):
        p.build()


# --------------------------------------------------------------------------- registry, Pending, UE8M0


class SoloGroup:
    def rank(self):
        return 0

    def size(self):
        return 1


def test_buffer_registry_grows_to_the_largest_need(deep_ep_emu):
    from moe_plugin_cuda.deepep import BufferNeed, BufferRegistry

    reg, g = BufferRegistry(), SoloGroup()
    small = reg.declare(g, BufferNeed(1 << 20, 0))
    first = reg.get(small, deep_ep_emu)
    assert (first.num_nvl_bytes, first.low_latency_mode) == (1 << 20, False)
    reg.declare(g, BufferNeed(1 << 10, 0))  # smaller: the same buffer serves
    assert reg.get(small, deep_ep_emu) is first
    reg.declare(g, BufferNeed(0, 1 << 22, True, 4))  # a low-latency layer joins: one buffer for both
    second = reg.get(small, deep_ep_emu)
    assert second is not first
    assert (second.num_nvl_bytes, second.num_rdma_bytes, second.low_latency_mode, second.num_qps_per_rank) == \
        (1 << 20, 1 << 22, True, 4)
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        reg.declare(g, BufferNeed(0, 1 << 22, True, 8))


def test_runtime_called_only_behind_v121s_dispatch_wrapper(deep_ep_emu):
    # the low-latency hot path calls Buffer.runtime itself only where Buffer.low_latency_dispatch is v1.2.1's
    # wrapper of it, any other wrapper by its keywords (docs/decisions.md, entry 69); the emulation's is (deepep_fidelity.py checks the real one)
    from moe_plugin_cuda.deepep import BufferNeed, BufferRegistry, wraps_runtime_dispatch

    assert wraps_runtime_dispatch(deep_ep_emu.Buffer)

    class Counted(deep_ep_emu.Buffer):  # one statement more than v1.2.1's: the runtime is not for us to call
        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                                 use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                                 return_recv_hook=False):
            self.calls["wrapped"] += 1
            return super().low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                                use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)

    assert not wraps_runtime_dispatch(Counted)
    assert not wraps_runtime_dispatch(type("Buffer", (), {"low_latency_dispatch": print}))  # no Python source
    reg, need = BufferRegistry(), BufferNeed(0, 1 << 22, True, 4)
    entry = reg.declare(SoloGroup(), need)
    reg.get(entry, deep_ep_emu)
    assert entry.wraps_runtime
    entry = reg.declare(SoloGroup(), need)
    reg.get(entry, type("deep_ep", (), {"Buffer": Counted}))
    assert not entry.wraps_runtime  # so the hot path calls the wrapper (deep_ep_worker.part_hot_path)


def test_pending_waits_once():
    from moe_plugin_cuda.deepep import Pending

    calls = []

    class Event:
        def current_stream_wait(self):
            calls.append("event")

    p = Pending(lambda: calls.append("finish") or 42, Event(), lambda: calls.append("hook"))
    assert p.wait() == 42 and p.wait() == 42
    assert calls == ["hook", "event", "finish"]


def test_unpack_ue8m0_inverts_deepep_packing(deep_ep_emu):
    from deep_ep_emulation.buffer import pack_ue8m0
    from moe_plugin_cuda.deepep import unpack_ue8m0

    scales = torch.exp2(torch.randint(-20, 10, (3, 5, 16)).float())
    packed = pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 4)
    assert torch.equal(unpack_ue8m0(packed, 16), scales)
    # a column-major view, as DeepEP returns it
    cm = packed.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(unpack_ue8m0(cm, 16), scales)
    # every normal exponent, odd and empty shapes, both layouts; the column-major one in two kernels
    for shape in ((7, 16), (4, 11, 56), (2, 0, 8), (0, 3, 8)):
        scales = torch.exp2(torch.randint(-126, 128, shape).float())
        packed = pack_ue8m0(scales)
        for layout in (packed, packed.transpose(-1, -2).contiguous().transpose(-1, -2)):
            with _CountOps() as ops:
                out = unpack_ue8m0(layout, shape[-1])
            assert torch.equal(out, scales) and out.is_contiguous(), (shape, layout.stride())
            if not layout.is_contiguous():
                assert ops.kernels == 2, ops.kernels


class _CountOps(TorchDispatchMode):
    """Counts the ops that would launch a kernel on a GPU (views and allocations excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.__name__.startswith(("empty", "detach", "alias", "unflatten"))):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- emulated ops (no communication)


def test_emulated_fp8_quantization_follows_the_recipe():
    """DeepEP's in-kernel cast (``calculate_fp8_scales``), one group at a time in fp32 scalars:
    ``scale_inv = amax * fl(1/448)``, ``q = x * fl(448 / amax)`` (power-of-two scales with
    ``round_scale``); the real library agrees bit for bit (test_deepep_fidelity.py, gpu)."""
    from deep_ep_emulation.buffer import pack_ue8m0, quantize_fp8_ll

    f32 = torch.float32
    x = (torch.randn(7, 512) * torch.rand(7, 1) * 10).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero group: amax floor 1e-4
    for round_scale in (False, True):
        q, s = quantize_fp8_ll(x, round_scale)
        for t in range(7):
            for gi in range(4):
                v = x[t, gi * 128:(gi + 1) * 128].float()
                amax = torch.tensor(max(v.abs().max().item(), 1e-4), dtype=f32)
                sinv = amax * torch.tensor(1 / 448, dtype=f32)
                mult = torch.tensor(448.0, dtype=f32) / amax
                if round_scale:
                    sinv = torch.exp2(torch.ceil(torch.log2(sinv.double()))).to(f32)
                    mult = 1 / sinv
                assert s[t, gi].item() == sinv.item()
                want = (v * mult).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert torch.equal(q[t, gi * 128:(gi + 1) * 128].view(torch.uint8), want.view(torch.uint8))
        if round_scale:
            e = pack_ue8m0(s).view(torch.uint8).view(7, 4).long()
            assert torch.equal(e, torch.log2(s).long() + 127)


def test_emulated_config_tables_and_asserts():
    from deep_ep_emulation.buffer import Buffer, Config

    c = Buffer.get_dispatch_config(8)
    assert (c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256, 6, 128)
    c = Buffer.get_combine_config(8)
    assert (c.num_max_nvl_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (4, 128)
    with pytest.raises(AssertionError):
        Buffer.get_dispatch_config(3)
    with pytest.raises(AssertionError):
        Config(20, 256, 256, 6, 128)  # NVL send must be < recv
    with pytest.raises(AssertionError):
        Config(20, 6, 256, 65, 128)  # RDMA send must be <= recv / 2
    with pytest.raises(AssertionError):
        Buffer.set_num_sms(7)
    # hints grow with the hidden size; intranode needs no RDMA buffer
    assert c.get_nvl_buffer_size_hint(4096, 8) > c.get_nvl_buffer_size_hint(2048, 8) > 0
    assert c.get_rdma_buffer_size_hint(4096, 8) == 0
    h = Buffer.get_low_latency_rdma_size_hint
    assert h(128, 7168, 8, 256) > h(64, 7168, 8, 256) and h(128, 7168, 8, 256) % 128 == 0


# --------------------------------------------------------------------------- preference and DeepEP 2.x


def test_planner_prefers_deepep_over_torch_a2a_and_says_why(deepep_manager):
    p = plan(_cfg(dispatcher="auto", quant="fp8_block"), manager=deepep_manager)
    assert p.dispatcher.name == "deepep"
    assert any(r.dispatcher == "torch_a2a" for r in p.rejected) is False  # torch_a2a could serve: not rejected
    note = next(n for n in p.notes if n.startswith("dispatcher cuda.deepep (priority 20) preferred over"))
    assert "reference.torch_a2a (10)" in note and "faster than torch_a2a" in note, p.notes
    assert note in p.explain() and note in p.to_json()["plan"]["notes"]


def test_backends_reports_deepep_2x_usable_through_the_legacy_buffer(deep_ep_emu, capsys):
    """DeepEP 2.x exports ElasticBuffer beside the legacy V1 Buffer: usable, and the listing says
    which API moe-core drives."""
    from moe_core import cli

    deep_ep_emu.__version__ = "2.1.0"
    deep_ep_emu.ElasticBuffer = type("ElasticBuffer", (), {})
    import json

    from moe_core.plugins import get_plugin_manager

    get_plugin_manager.cache_clear()  # the default manager caches availability: let it see the emulated 2.x
    try:
        assert cli.main(["backends", "--json"]) == 0
    finally:
        get_plugin_manager.cache_clear()
    row = next(r for r in json.loads(capsys.readouterr().out) if r["backend"] == "deepep")
    assert row["available"] and "DeepEP 2.1.0" in row["message"], row
    assert "legacy V1 deep_ep.Buffer API" in row["message"], row


def test_probe_refuses_a_buffer_without_the_v1_methods(deep_ep_emu, monkeypatch):
    from moe_plugin_cuda.probes import probe_deepep

    monkeypatch.setattr(deep_ep_emu, "Buffer", type("Buffer", (), {"dispatch": None}))
    r = probe_deepep()
    assert r.code is Code.API_MISMATCH and "low_latency_dispatch" in r.message, r


def test_emulation_refuses_inputs_written_after_previous_event():
    """DeepEP's comm stream waits for ``previous_event`` instead of the compute stream: the emulation
    stamps tensors with host order and refuses an input newer than the event (the async FP8 bug)."""
    from deep_ep_emulation.buffer import EventOverlap, StreamOrder, _check_written_before

    with StreamOrder():
        before = torch.randn(4, 128)
        event = EventOverlap()
        same = before.contiguous()  # no write: keeps its stamp
        after = before.to(torch.float8_e4m3fn)  # a cast after the event
    _check_written_before(event, "dispatch", x=same)
    _check_written_before(None, "dispatch", x=after)
    with pytest.raises(RuntimeError, match="written after previous_event"):
        _check_written_before(event, "dispatch", x=after)
