"""Is a bench cell slower when the GPU runs it for seconds than in a short burst (clocks under power or heat)?

    python3 benchmarks/cuda/sustained.py --preset qwen3-235b-a22b --quant unquantized --tokens 16384 --seconds 20

Builds the layer as ``moe-core bench`` does (the planner's pick, the bench's weights and routing), warms
it up, then times per call with CUDA events: a burst of 5 calls after 3 s idle, back-to-back calls for
``--seconds``, another burst after 3 s idle. nvidia-smi samples the SM clock, power and the active clock
event (throttle) reasons every 100 ms meanwhile. Prints each phase's median per-call time with the clocks
and power seen in it, and the sustained phase in 2-second steps (``--profile``: then the kernel table of 5
calls after 3 s idle).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class Sampler:
    """nvidia-smi's samples, (host time, SM MHz, W, deg C, reasons bitmask), while it runs."""

    def __init__(self, period_ms: int = 100) -> None:
        fields = FIELDS
        if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True).returncode:
            fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")  # older drivers' name
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                      f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.samples: list[tuple[float, float, float, float, int]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                sm, w, temp, reasons = (v.strip() for v in line.split(","))
                self.samples.append((time.time(), float(sm), float(w), float(temp), int(reasons, 16)))
            except ValueError:
                continue

    def between(self, t0: float, t1: float) -> dict:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return {"samples": 0}
        reasons = 0
        for x in s:
            reasons |= x[4]
        return {"samples": len(s), "sm_mhz_median": statistics.median(x[1] for x in s),
                "sm_mhz_min": min(x[1] for x in s), "power_w_max": max(x[2] for x in s),
                "temp_c_max": max(x[3] for x in s), "reasons": hex(reasons)}

    def stop(self) -> None:
        self.proc.terminate()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-235b-a22b")
    p.add_argument("--quant", default="unquantized")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--backend-options", default=None, help="JSON, as moe-core bench's")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="also the kernel table of 5 calls after 3 s idle")
    args = p.parse_args()

    from moe_core.bench import _fill_weights
    from moe_core.config import preset
    from moe_core.contracts import TopK
    from moe_core.layer import MoELayer
    from moe_core.planner import plan
    from moe_core.router import route

    opts = json.loads(args.backend_options) if args.backend_options else {}
    cfg = preset(args.preset, quant=args.quant, device="cuda", backend_options=opts)
    the_plan = plan(cfg)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = MoELayer(cfg, plan=the_plan, check_ids=False, device=dev)
    _fill_weights(layer, cfg, seed=0)
    T = args.tokens
    g = torch.Generator(device=dev).manual_seed(1000 + T)  # the bench's inputs for this T
    x = torch.randn((T, cfg.hidden_size), generator=g, device=dev).to(cfg.params_dtype)
    topk = route(torch.randn((T, cfg.num_experts), generator=g, device=dev), cfg.top_k, cfg.router,
                 layer.correction_bias)
    topk = TopK(topk.weights.contiguous(), topk.ids.contiguous())

    def call() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        layer(x, topk)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3  # us

    with torch.no_grad():
        for _ in range(3):
            call()
        sampler = Sampler()
        phases = {}
        steps = []

        def burst(name):
            time.sleep(3.0)
            t0 = time.time()
            times = [call() for _ in range(5)]
            phases[name] = {"median_us": statistics.median(times), "calls": len(times),
                            **sampler.between(t0 - 0.05, time.time() + 0.05)}

        burst("burst_before")
        t0 = time.time()
        times: list[tuple[float, float]] = []
        while time.time() - t0 < args.seconds:
            times.append((time.time(), call()))
        phases["sustained"] = {"median_us": statistics.median(t for _, t in times), "calls": len(times),
                               **sampler.between(t0, time.time())}
        step = t0
        while step < times[-1][0]:
            part = [t for h, t in times if step <= h < step + 2.0]
            if part:
                steps.append({"from_s": round(step - t0, 1), "median_us": statistics.median(part), "calls": len(part),
                              **sampler.between(step, step + 2.0)})
            step += 2.0
        burst("burst_after")
        sampler.stop()
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            time.sleep(3.0)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    layer(x, topk)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12), flush=True)

    print(f"{args.preset} {args.quant} T={T} on {the_plan.experts.name} ({torch.cuda.get_device_name()}):")
    for name, ph in phases.items():
        print(f"  {name:13s} {ph['median_us']:9.1f} us/call over {ph['calls']:4d} calls; "
              f"SM clock median {ph.get('sm_mhz_median')} MHz (min {ph.get('sm_mhz_min')}), "
              f"power max {ph.get('power_w_max')} W, temp max {ph.get('temp_c_max')} C, reasons {ph.get('reasons')}")
    print("  sustained, per 2 s:")
    for s in steps:
        print(f"    t={s['from_s']:5.1f}s {s['median_us']:9.1f} us/call  SM {s.get('sm_mhz_median')} MHz  "
              f"{s.get('power_w_max')} W  {s.get('temp_c_max')} C  reasons {s.get('reasons')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "quant": args.quant, "T": T, "experts": the_plan.experts.name,
                       "device": torch.cuda.get_device_name(), "phases": phases, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
