"""Whole Hugging Face models with experts_implementation="moe_core" against "eager" (tiny random
configs built here, no downloads). Skipped when transformers is not installed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
moe_hf = pytest.importorskip("moe_core.integrations.transformers")

from moe_core.reference.oracle import relative_error  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs(**over) -> dict:
    """``over`` replaces entries of COMMON (e.g. the layer count)."""
    t = transformers
    COMMON = {**globals()["COMMON"], **over}
    return {
        "mixtral": lambda: t.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=24,
                                              num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, num_experts=6,
                                              num_experts_per_tok=2, shared_expert_intermediate_size=40),
        "olmoe": lambda: t.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=6, num_experts_per_tok=2),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
        "deepseek_v2": lambda: t.DeepseekV2Config(
            **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8),
        "glm4_moe": lambda: t.Glm4MoeConfig(
            **COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=1.8),
        "ernie4_5_moe": lambda: t.Ernie4_5_MoeConfig(
            **COMMON, intermediate_size=48, moe_intermediate_size=16, moe_num_experts=6, moe_k=2,
            moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=1),
        "minimax_m2": lambda: t.MiniMaxM2Config(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=6,
                                                num_experts_per_tok=2),
        "llama4": lambda: t.Llama4TextConfig(**COMMON, head_dim=8, intermediate_size=24, intermediate_size_mlp=48,
                                             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1),
        "gpt_oss": lambda: t.GptOssConfig(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=16),
    }


FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "ernie4_5_moe",
            "minimax_m2", "llama4", "gpt_oss"]


@pytest.fixture(autouse=True, scope="module")
def registered():
    moe_hf.register()


def _randomize(model: torch.nn.Module) -> None:
    """O(1) activations everywhere: HF's init (std 0.02, zero biases) would make the experts' share
    of the logits too small to test. Norm weights stay 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                continue
            if p.dim() >= 2:
                fan_in = p.shape[-1] if "proj" not in name or p.shape[-1] > 1 else p.shape[-2]
                p.normal_(0.0, 1.5 / max(min(p.shape[-2:]), 1) ** 0.5 if p.dim() == 3 else 1.0 / fan_in ** 0.5)
            else:
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.normal_(0.0, 0.1)


def _model(family: str, dtype: torch.dtype, implementation: str = "eager", **over):
    torch.manual_seed(torch.seed() % 2**31)  # fresh weights each run
    config = _configs(**over)[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=implementation)
    _randomize(model)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_bf16_logits_generate_and_reload(family, tmp_path):
    model = _model(family, torch.float32)
    ids = torch.randint(3, 97, (2, 9))
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_core")
    ours = _logits(model, ids)
    plans = moe_hf.plans(model)
    assert plans and all(p.experts.name == "reference" for p in plans.values()), plans
    assert relative_error(ours, eager) <= 1e-5
    # the reference keeps loaded weights as they are: the layers use HF's own storage (gpt-oss: one
    # de-interleaved copy)
    for name, layer in moe_hf.layers(model).items():
        shared = layer.w13.data_ptr() == model.get_submodule(name).gate_up_proj.data_ptr()
        assert shared == (family != "gpt_oss"), name
    # the experts matter: without the routed experts' output the logits move far beyond the tolerance
    layer_name = next(iter(plans))
    experts = model.get_submodule(layer_name)
    with torch.no_grad():
        experts.down_proj.mul_(0.0)  # in place: the layer must notice (_version)
    assert relative_error(_logits(model, ids), eager) > 1e-3
    model.set_experts_implementation("eager")
    zeroed = _logits(model, ids)
    model.set_experts_implementation("moe_core")
    assert relative_error(_logits(model, ids), zeroed) <= 1e-5

    # save, reload from disk with moe_core, compare with a fresh eager load (fp32 and bf16)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                  experts_implementation="moe_core").eval()
    assert relative_error(_logits(reloaded, ids), zeroed) <= 1e-5
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours_ids = reloaded.generate(ids[:1], **gen)
        model.set_experts_implementation("eager")
        eager_ids = model.generate(ids[:1], **gen)
    assert torch.equal(ours_ids, eager_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits(family):
    # one MoE layer: with a second one, eager's and moe_core's different bf16 roundings (eager rounds
    # each GEMM, the reference once) can flip a near-tie in the next router, and one token's logits
    # then differ by far more than the experts' arithmetic (seen once in ~40 runs at 2 layers)
    dense_first = family in ("deepseek_v3", "deepseek_v2", "glm4_moe")
    model = _model(family, torch.bfloat16, num_hidden_layers=2 if dense_first else 1)
    ids = torch.randint(3, 97, (2, 7))
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_core")
    assert relative_error(_logits(model, ids), eager) <= 2e-2
    assert moe_hf.plans(model)


def test_importing_moe_core_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, moe_core, moe_core.layer, moe_core.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_refused_activation_names_the_class_and_the_reason():
    config = _configs()["mixtral"]()
    config.hidden_act = "relu"
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="moe_core")
    with pytest.raises(NotImplementedError, match="MixtralExperts's activation ReLU"):
        model(input_ids=torch.randint(3, 97, (1, 4)))


@pytest.mark.parametrize("t", [1, 13])
def test_fp8_block_experts_run_as_the_core_scheme(t):
    """transformers' FP8Experts (128x128 blocks, as FineGrainedFP8Config loads them) through moe_core,
    against float64 with the dequantized weights (transformers' own FP8 path needs CUDA kernels)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    from moe_core import quant
    from moe_core.reference.oracle import fp8_round_trip, moe_float64

    config = transformers.Qwen3MoeConfig(**{**COMMON, "hidden_size": 136}, head_dim=8, moe_intermediate_size=128,
                                         num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "moe_core"
    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    module = cls(config, block_size=(128, 128), activation_scheme="dynamic")
    w13, w2 = torch.randn(4, 256, 136) / 136 ** 0.5, torch.randn(4, 136, 128) / 128 ** 0.5
    ckpt = quant.quantize_weights(w13, w2, "fp8_block")
    with torch.no_grad():
        for ours, theirs in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            getattr(module, theirs).data = ckpt[ours]
            getattr(module, theirs + "_scale_inv").data = ckpt[ours + "_scale"]
    x = torch.randn(t, 136, dtype=torch.bfloat16)
    ids = torch.rand(t, 4).argsort(-1)[:, :2]
    weights = torch.rand(t, 2, dtype=torch.bfloat16)
    out = module(x, ids, weights)
    assert [p.experts.name for p in moe_hf.plans(torch.nn.ModuleDict({"experts": module})).values()] == ["reference"]
    dq13, dq2 = quant.dequantize_weights(ckpt, "fp8_block")
    # the scheme's activation rounding too (per token, 128-channel groups), written independently
    expected = moe_float64(x.float(), weights.float(), ids, dq13, dq2,
                           quantize_activation=lambda v, which, e: fp8_round_trip(v, 128))
    assert relative_error(out, expected) <= 1e-2


def test_hf_bench_decode_steps_stay_at_one_position():
    """benchmarks/hf/bench_hf_models.py times a decode step many times (and replays it in a graph on the
    GPU): each step must write the same cache slot. transformers' static layers advance their own fill
    level on every update, so without the bench's rewind the steps run past the cache (a device-side
    assert on the GPU, an IndexError here) after 8 calls."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hf" / "bench_hf_models.py"
    spec = importlib.util.spec_from_file_location("bench_hf_models", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    moe_hf.register()
    config = bench.model_configs(smoke=True)["qwen3-30b-a3b"]
    config.num_hidden_layers = 1
    model = bench.build("qwen3-30b-a3b", config, "bf16", torch.device("cpu"), smoke=True)
    first = bench.FirstExperts(model)
    recorded = {}
    for impl in ("eager", "moe_core"):  # 2 warm-ups + 12 timed steps: past the cache's 8 free slots
        cell = bench.run_cell(model, impl, "decode", 2, 1, torch.device("cpu"), iters=12, graphs=False, first=first)
        assert cell["logits"].shape == (2, 1, config.vocab_size) and torch.isfinite(cell["logits"]).all()
        recorded[impl] = (first.inputs, first.output, first.float64_reference(fp8=False))
    # the decode step's first MoE layer (2 tokens), recorded once per cell: the same inputs under both
    # implementations, each output within bf16 rounding of the float64 experts
    (x, ids, w), eager_out, expected = recorded["eager"]
    assert x.shape == (2, config.hidden_size) and ids.shape == w.shape == (2, config.num_experts_per_tok)
    assert all(torch.equal(a, b) for a, b in zip(recorded["moe_core"][0], (x, ids, w), strict=True))
    assert torch.equal(recorded["moe_core"][2], expected)
    for out in (eager_out, recorded["moe_core"][1]):
        assert relative_error(out, expected) <= 1e-2
