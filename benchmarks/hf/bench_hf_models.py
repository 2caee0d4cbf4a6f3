"""Whole Hugging Face models (real MoE layer sizes, random weights) per experts implementation.

For each model x weight format x shape, times one forward with ``experts_implementation`` in
eager, grouped_mm, batched_mm and moe_core, and checks moe_core's logits against eager's (or
against grouped_mm's where eager cannot run). Writes ``results.json`` and ``results.md`` to
``--out``. See benchmarks/hf/README.md.

    python benchmarks/hf/bench_hf_models.py --out benchmarks/hf/h100_YYYY-MM-DD     # one H100, < 6 min
    python benchmarks/hf/bench_hf_models.py --out /tmp/hf_smoke --smoke            # tiny sizes on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig, StaticCache
from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
from transformers.integrations.moe import use_experts_implementation

import moe_core
import moe_core.integrations.transformers as moe_hf
from moe_core import quant
from moe_core.reference.oracle import fp8_round_trip, relative_error

IMPLS = ("eager", "grouped_mm", "batched_mm", "moe_core")
VOCAB = 32000  # the MoE layers are what is measured; a real vocabulary would only add lm_head time


def model_configs(smoke: bool) -> dict[str, object]:
    if smoke:
        return {
            "qwen3-30b-a3b": Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, norm_topk_prob=True),
            "deepseek-v3": DeepseekV3Config(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                            n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                            n_shared_experts=1, first_k_dense_replace=0, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                                            q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
        }
    return {
        # Qwen/Qwen3-30B-A3B config.json, 4 layers
        "qwen3-30b-a3b": Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, norm_topk_prob=True, max_position_embeddings=8192),
        # deepseek-ai/DeepSeek-V3 config.json, 2 layers, both MoE
        "deepseek-v3": DeepseekV3Config(vocab_size=VOCAB, hidden_size=7168, intermediate_size=18432,
                                        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                                        n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
                                        first_k_dense_replace=0, num_hidden_layers=2, num_attention_heads=128,
                                        num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                        max_position_embeddings=8192),
    }


def shapes(smoke: bool) -> list[tuple[str, int, int]]:
    """(kind, batch, tokens per sequence); decode runs one token on a cache of ``CONTEXT`` tokens."""
    if smoke:
        return [("prefill", 1, 64), ("prefill", 4, 16), ("decode", 1, 1), ("decode", 4, 1)]
    return [("prefill", 1, 4096), ("prefill", 16, 1024), ("decode", 1, 1), ("decode", 32, 1)]


def to_fp8_block(model: torch.nn.Module) -> None:
    """Swap every experts module for transformers' own FP8Experts (128x128 blocks, dynamic
    activations: what FineGrainedFP8Config(weight_block_size=(128, 128)) loads), quantized from
    the bf16 weights with moe_core.quant (the same block format: dequant = q * scale_inv)."""
    fp8_cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    names = [n for n, m in model.named_modules() if n.endswith(".experts") and getattr(m, "has_gate", False)]
    for name in names:  # one layer at a time, in chunks of experts: no float32 copy of a whole layer
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        old = parent.experts
        with torch.device(old.gate_up_proj.device):
            new = fp8_cls(old.config, block_size=(128, 128), activation_scheme="dynamic")
        with torch.no_grad():
            for e in range(0, old.gate_up_proj.shape[0], 16):
                ck = quant.quantize_weights(old.gate_up_proj[e:e + 16], old.down_proj[e:e + 16], "fp8_block")
                new.gate_up_proj[e:e + 16] = ck["w13"]
                new.gate_up_proj_scale_inv[e:e + 16] = ck["w13_scale"]
                new.down_proj[e:e + 16] = ck["w2"]
                new.down_proj_scale_inv[e:e + 16] = ck["w2_scale"]
        parent.experts = new
        del old
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build(name: str, config, fmt: str, device: torch.device, smoke: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="eager")
    if smoke:  # HF's init (std 0.02) leaves tiny experts outputs; O(1) weights make the check meaningful
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() >= 2 and "norm" not in pname:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    if fmt == "fp8_block":
        to_fp8_block(model)
    return model.eval()


def inputs(kind: str, batch: int, tokens: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 7919 + tokens)
    return torch.randint(3, vocab, (batch, tokens), generator=g).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``iters`` calls after two warm-ups."""
    fn(), fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def batched_mm_bytes(model, batch: int, tokens: int) -> int:
    """batched_mm gathers one weight matrix per (token, expert) pair: the bytes it would allocate."""
    experts = next(m for n, m in model.named_modules() if n.endswith(".experts"))
    per_pair = experts.gate_up_proj[0].numel() * experts.gate_up_proj.element_size()
    return batch * tokens * model.config.num_experts_per_tok * per_pair


CONTEXT = 256


def rewind(cache: StaticCache, length: int) -> None:
    """Set every layer's fill level back to ``length``. transformers 5.x's static layers write at
    their own running length (a device tensor, advanced by each update) and ignore cache_position,
    so repeated decode steps, and CUDA-graph replays of one, would run past the cache's end
    (a device-side index_copy_ assert) unless rewound. An in-place fill_ is captured in the graph."""
    for layer in cache.layers:
        if torch.is_tensor(getattr(layer, "cumulative_length", None)):
            layer.cumulative_length.fill_(length)


class FirstExperts:
    """Records the first MoE layer's experts inputs and output of the next forward: the experts
    math checked alone, on identical inputs (the whole-model logits also carry every later
    router's response to rounding: a near-tie flips an expert, which is not an error)."""

    def __init__(self, model) -> None:
        self.module = next(m for n, m in model.named_modules() if n.endswith(".experts") and hasattr(m, "has_gate"))
        self.reset()
        self.module.register_forward_pre_hook(self._pre, with_kwargs=True)
        self.module.register_forward_hook(self._post, with_kwargs=True)

    def reset(self, armed: bool = False) -> None:
        self.armed, self.inputs, self.output = armed, None, None

    def arm(self) -> None:
        self.reset(armed=True)

    def _pre(self, module, args, kwargs) -> None:
        if self.armed:  # (hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])
            values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            self.inputs = tuple(v.detach().clone() for v in values[:3])

    def _post(self, module, args, kwargs, output) -> None:
        if self.armed:
            self.output, self.armed = output.detach().float().cpu(), False

    @torch.no_grad()
    def float64_reference(self, fp8: bool) -> torch.Tensor:
        """The experts' output on the recorded inputs, in float64, from the module's own weights
        (FP8: dequantized, activations rounded to FP8 per 128 channels as the fp8_block scheme does)."""
        m, (x, ids, weights) = self.module, self.inputs
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        inter = m.down_proj.shape[-1]
        for e in ids.unique().tolist():
            if e < 0:
                continue
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if fp8:
                w13, w2 = quant.dequantize_weights(
                    {"w13": m.gate_up_proj[e:e + 1], "w13_scale": m.gate_up_proj_scale_inv[e:e + 1],
                     "w2": m.down_proj[e:e + 1], "w2_scale": m.down_proj_scale_inv[e:e + 1]}, "fp8_block")
                w13, w2 = w13[0].double(), w2[0].double()
            else:
                w13, w2 = m.gate_up_proj[e].double(), m.down_proj[e].double()
            xe = x[rows].double()
            xe = fp8_round_trip(xe, 128) if fp8 else xe
            gate_up = xe @ w13.T
            h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            h = fp8_round_trip(h, 128) if fp8 else h
            out.index_add_(0, rows, (h @ w2.T) * weights[rows, slots, None].double())
        return out.cpu()


def run_cell(model, impl: str, kind: str, batch: int, tokens: int, device: torch.device, iters: int,
             graphs: bool, first: FirstExperts) -> dict:
    model.set_experts_implementation(impl)
    if impl == "moe_core":
        moe_hf.prepare(model)
    vocab = model.config.vocab_size
    with torch.no_grad():
        if kind == "prefill":
            ids = inputs(kind, batch, tokens, vocab, device)

            def step():
                return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits
            first.arm()
            seconds = timed(step, device, iters)
            return {"ms": seconds * 1e3, "logits": step().float().cpu(), "graph": False}
        cache = StaticCache(config=model.config, max_cache_len=CONTEXT + 8)
        ctx = inputs("ctx", batch, CONTEXT, vocab, device)
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
        ids = inputs(kind, batch, 1, vocab, device)
        pos = torch.tensor([CONTEXT], device=device)

        def step():
            rewind(cache, CONTEXT)  # every timed (or replayed) step decodes at the same position
            return model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits
        first.arm()
        out = step()
        if cache.get_seq_length() != CONTEXT + 1:
            raise RuntimeError(f"the static cache holds {cache.get_seq_length()} tokens after one decode step, "
                               f"expected {CONTEXT + 1}: rewind() does not match this transformers' StaticCache")
        graph_note = False
        if graphs and device.type == "cuda":
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step(), step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = step()
                seconds = timed(graph.replay, device, iters)
                return {"ms": seconds * 1e3, "logits": static_out.float().cpu(), "graph": True}
            except Exception as exc:  # not capturable (host syncs in the experts): time it eagerly
                graph_note = f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                torch.cuda.synchronize()
        seconds = timed(step, device, iters)
        return {"ms": seconds * 1e3, "logits": out.float().cpu(), "graph": graph_note}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for results.json and results.md")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (checks the script, times nothing real)")
    p.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--formats", default="bf16,fp8_block")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--iters", type=int, default=None, help="timed calls per cell (median); default 10 (smoke: 2)")
    p.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--moe-core-experts", default="auto", help="force moe_core's experts backend (MoEConfig.experts)")
    p.add_argument("--in-process", action="store_true",
                   help="run every model and format in this process (default on a GPU: one child process per "
                        "model and format, so that a device-side assert, which poisons the CUDA context, costs only "
                        "that child's cells, and each starts with an unfragmented allocator)")
    p.add_argument("--reference-logits", type=Path, default=None,
                   help="bf16 eager logits saved by an earlier run (its eager-logits.pt): the FP8 cells' reference")
    args = p.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    models, formats = args.models.split(","), args.formats.split(",")
    if torch.cuda.is_available() and not args.smoke and not args.in_process and len(models) * len(formats) > 1:
        return run_isolated(argv, models, formats, args.out, args.impls.split(","))
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    iters = args.iters or (2 if args.smoke else 10)
    graphs = not args.no_graphs
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    meta = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "moe_core": getattr(moe_core, "__version__", "0.1.0"), "context_for_decode": CONTEXT, "iters": iters}
    rows = []
    # the FP8 cells' fallback reference (quantization error included), by (model, kind, batch, tokens)
    bf16_eager: dict[tuple, torch.Tensor] = torch.load(args.reference_logits) if args.reference_logits else {}
    configs = model_configs(args.smoke)
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 8 << 30
    for name in args.models.split(","):
        for fmt in args.formats.split(","):
            print(f"== {name} {fmt}", flush=True)
            try:
                model = build(name, configs[name], fmt, device, args.smoke)
            except Exception as exc:
                rows.append({"model": name, "format": fmt, "error": f"build: {type(exc).__name__}: {exc}"})
                continue
            # decode cells are captured in CUDA graphs: plan graph-safe backends for them. bf16 shares
            # the experts with HF (DeepSeek-V3's two layers are ~45 GB: two copies do not fit) and the
            # backend may rewrite them in place; FP8 (half the size) keeps HF's intact for the check
            shared = fmt == "bf16"
            moe_hf.register(share_weights=shared, experts=args.moe_core_experts,
                            cuda_graph=graphs and device.type == "cuda")
            first = FirstExperts(model)
            layer_refs: dict[tuple, tuple] = {}  # shape -> (first MoE layer's inputs, float64 experts output)
            # every HF implementation over every shape first, moe_core last: moe_core shares the HF
            # expert weights (register(share_weights=True)) and its backend may rewrite them in place
            impls = [i for i in args.impls.split(",") if i != "moe_core"] + \
                (["moe_core"] if "moe_core" in args.impls.split(",") else [])
            cells = {shape: {"model": name, "format": fmt, "kind": shape[0], "batch": shape[1], "tokens": shape[2],
                             "impls": {}} for shape in shapes(args.smoke)}
            logits: dict[tuple, dict[str, torch.Tensor]] = {shape: {} for shape in cells}
            for impl in impls:
                if impl == "moe_core" and device.type == "cuda":
                    torch.cuda.empty_cache()  # what the HF implementations left cached, back for moe_core's workspaces
                for (kind, batch, tokens), cell in cells.items():
                    if impl == "batched_mm" and batched_mm_bytes(model, batch, tokens) > free // 2:
                        cell["impls"][impl] = {"skipped": f"gathers {batched_mm_bytes(model, batch, tokens) / 2**30:.0f} "
                                                          "GiB of weights (one matrix per token-expert pair)"}
                        continue
                    shape = (kind, batch, tokens)
                    first.reset()
                    try:
                        r = run_cell(model, impl, kind, batch, tokens, device, iters, graphs, first)
                        logits[shape][impl] = r.pop("logits")
                        cell["impls"][impl] = r
                    except Exception as exc:
                        cell["impls"][impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                        traceback.print_exc()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    # the float64 reference from HF's weights, before moe_core may rewrite shared ones
                    if first.inputs is not None and shape not in layer_refs and (impl != "moe_core" or not shared):
                        layer_refs[shape] = (first.inputs, first.float64_reference(fmt == "fp8_block"))
                    if impl == "moe_core" and shape in layer_refs and "ms" in cell["impls"][impl]:
                        # moe_core's experts on the reference run's very inputs: a decode step's attention is
                        # not bitwise reproducible from one run to the next (DeepSeek-V3, 32 sequences)
                        recorded, expected = layer_refs[shape]
                        with torch.no_grad():
                            cell["layer1_rel_err"] = relative_error(first.module(*recorded).float().cpu(), expected)
                    print(f"  {kind} {batch}x{tokens} {impl}: {cell['impls'][impl]}", flush=True)
            for shape, cell in cells.items():
                got = logits[shape]
                key = (name,) + shape
                if fmt == "bf16" and "eager" in got:
                    bf16_eager[key] = got["eager"]
                base = "eager" if "eager" in got else ("grouped_mm" if "grouped_mm" in got else None)
                reference = got.get(base) if base else bf16_eager.get(key)
                # the noise floor of the logits check: HF's other implementations against eager
                cell["hf_rel_err_vs_eager"] = {i: relative_error(v, got["eager"]) for i, v in got.items()
                                               if i not in ("eager", "moe_core") and "eager" in got}
                if "moe_core" in got and reference is not None:
                    cell["moe_core_vs"] = base or "bf16 eager"
                    cell["moe_core_rel_err"] = relative_error(got["moe_core"], reference)
                    cell["moe_core_top1_agree"] = float((got["moe_core"].argmax(-1) == reference.argmax(-1))
                                                        .float().mean())
                if "ms" in cell["impls"].get("moe_core", {}):
                    cell["moe_core_plans"] = sorted({f"{pl.dispatcher_name} x {pl.experts.name} [{pl.dispatch_dtype}]"
                                                     for pl in moe_hf.plans(model).values()})
                rows.append(cell)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta["total_seconds"] = round(time.time() - started, 1)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "results.md").write_text(markdown(meta, rows, args.impls.split(",")))
    if bf16_eager and not args.reference_logits:
        torch.save(bf16_eager, args.out / "eager-logits.pt")
    print((args.out / "results.md").read_text())
    return 0


def run_isolated(argv: list[str], models: list[str], formats: list[str], out: Path, impls: list[str]) -> int:
    """One child process per model and format (bf16 first: its eager logits are the FP8 cells'
    reference); their rows merged into one results.json / results.md."""
    meta, rows, started = None, [], time.time()
    formats = sorted(formats, key=lambda f: f != "bf16")
    for name in models:
        for fmt in formats:
            part = out / f"part-{name}-{fmt}"
            reference = out / f"part-{name}-bf16" / "eager-logits.pt"
            child = [sys.executable, str(Path(__file__).resolve()), *argv, "--in-process", "--models", name,
                     "--formats", fmt, "--out", str(part)]  # argparse keeps the last --models / --formats / --out
            if fmt != "bf16" and reference.exists():
                child += ["--reference-logits", str(reference)]
            proc = subprocess.run(child, capture_output=True, text=True)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"part-{name}-{fmt}.log").write_text(proc.stdout + proc.stderr)
            print(proc.stdout[-4000:], flush=True)
            result = part / "results.json"
            if proc.returncode == 0 and result.exists():
                doc = json.loads(result.read_text())
                meta = meta or doc["meta"]
                rows += doc["rows"]
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                rows.append({"model": name, "format": fmt, "error": f"child exited {proc.returncode}: {tail[0][:300]}"})
    meta = dict(meta or {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "device": "cuda",
                         "torch": torch.__version__, "transformers": transformers.__version__, "iters": None,
                         "context_for_decode": CONTEXT})
    meta["command"] = " ".join([Path(sys.argv[0]).name] + argv)
    meta["total_seconds"] = round(time.time() - started, 1)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "results.md").write_text(markdown(meta, rows, impls))
    print((out / "results.md").read_text())
    return 0


def markdown(meta: dict, rows: list[dict], impls: list[str]) -> str:
    lines = [f"# HF models per experts implementation ({meta['date_utc']} UTC)", "",
             f"`{meta['command']}` on {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}; "
             f"median of {meta['iters']} calls; decode = one token per sequence on a {meta['context_for_decode']}-token "
             f"static cache (CUDA graph where marked g); total {meta.get('total_seconds')} s.", "",
             "| model | format | shape | " + " | ".join(f"{i} ms" for i in impls)
             + " | moe_core vs fastest HF | moe_core logits rel err (vs) [HF's others vs eager] | layer-1 experts rel err vs float64 | moe_core plan |",
             "|---|---|---|" + "---|" * len(impls) + "---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['format']} | build failed: {r['error']} |")
            continue
        cells = []
        for i in impls:
            v = r["impls"].get(i, {})
            cells.append(f"{v['ms']:.3f}{' g' if v.get('graph') is True else ''}" if "ms" in v
                         else ("skip" if "skipped" in v else ("error" if "error" in v else "-")))
        hf = [r["impls"][i]["ms"] for i in impls if i != "moe_core" and "ms" in r["impls"].get(i, {})]
        ours = r["impls"].get("moe_core", {}).get("ms")
        speed = f"{min(hf) / ours:.2f}x" if hf and ours else "-"
        err = f"{r['moe_core_rel_err']:.2e} ({r['moe_core_vs']})" if "moe_core_rel_err" in r else "-"
        noise = r.get("hf_rel_err_vs_eager") or {}
        if noise and "moe_core_rel_err" in r:
            err += " [" + ", ".join(f"{i} {v:.1e}" for i, v in noise.items()) + "]"
        layer1 = f"{r['layer1_rel_err']:.2e}" if "layer1_rel_err" in r else "-"
        lines.append(f"| {r['model']} | {r['format']} | {r['kind']} {r['batch']}x{r['tokens']} | " + " | ".join(cells)
                     + f" | {speed} | {err} | {layer1} | {'; '.join(r.get('moe_core_plans', []))} |")
    notes: dict[str, list[str]] = {}  # one line per distinct message
    for r in rows:
        for i, v in r.get("impls", {}).items():
            if "error" in v or "skipped" in v or isinstance(v.get("graph"), str):
                message = v.get("error") or v.get("skipped") or v.get("graph")
                notes.setdefault(message, []).append(f"{r['model']} {r['format']} {r['kind']} {r['batch']}x{r['tokens']} {i}")
    notes = [f"- {m}: {', '.join(where)}" for m, where in notes.items()]
    return "\n".join(lines + ([""] + ["Notes:"] + notes if notes else [])) + "\n"


if __name__ == "__main__":
    sys.exit(main())
