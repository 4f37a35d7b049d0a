"""Vision benchmark: image requests against text-only requests on one server (issue 17;
docs/vision.md, numbers in docs/performance.md).

Cases, each sent ``--reps`` times as streamed greedy `/v1/chat/completions` (the card's API path);
the user text starts with the request's number, so only the chat preamble before the user message
is a prefix-cache hit:

* ``text``: the text alone;
* ``image_<W>x<H>``: one image per resolution in ``--sizes`` after the number, before the text;
  every rep uses a new random image;
* ``repeat_<W>x<H>``: the last resolution's first request again, same image and text (a prefix-cache
  hit through the image span: the tower does not run);
* ``images_<K>``, for each K of ``--images-per-request`` (e.g. 1,4,16): K new random images of the last
  resolution in one request (issue 17's TTFT at 1 / 4 / 16 images per request).

Per request: time to first token (first streamed chunk carrying text or reasoning text),
latency, prompt and cached tokens (``usage``). Per resolution, client-side preprocessing
(decode the PNG + plan the grid + resize/pad + normalise + patchify, `vision_preprocess`, the
same code the server's processor runs) is timed in this process. Requests/s is sequential (one in
flight). The server is `sglang-dsv41 serve` (``--model-path``; its process, port and bounded
readiness wait come from `serving_client.py`) or an existing one (``--url``).

``--dry-run`` starts no server: it writes only the per-resolution grids, span tokens and
preprocessing times (CI runs this on the tiny checkpoint).

``--vit`` adds the tower's own throughput, in this process on ``--device``: `runtime/vision.VisionTower`
with ``--vit-dims`` (``flash``: the card's 32-layer ViT, random BF16-valued weights; ``checkpoint``:
the checkpoint's dims) encodes ``--vit-images`` images per case (each ``--sizes`` resolution, and
``cap``: a square grid at the token cap, the planner's worst case), for each ``--vit-attention``
backend (`runtime/vision_attention.py`: ``auto`` is SGLang's Triton vision attention with BF16
operands on CUDA; ``sdpa`` the fp32 torch path; ``fa3`` SGLang's FA3 core): images/s after one
warm-up, packed as the server runs them (`encode_many`: varlen calls of ≤ one cap image of
patches) and, where that packs, one image per call. On CUDA it also records, per backend, the peak
allocated bytes above the weights (`torch.cuda.max_memory_allocated`) of one cap image and of the
first packed call of the first resolution, each next to the planner's figure for that call
(`deploy/vision_config.vit_activation_bytes` for the backend). A backend that raises fails the run
with its traceback (scripts/gpu/vision.sh runs ``fa3`` in a process of its own).

    python benchmarks/vision.py --model-path /tmp/tiny --device cpu --out benchmarks/results/vision_cpu.json
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import mean, median

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import Proc, free_port, wait_up  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TEXT = "What is in this image? Answer in one word."


def make_png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB image of `size` (W, H) as PNG bytes."""
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def preprocessing(model_path: str, sizes: list[tuple[int, int]], reps: int) -> dict[str, dict]:
    """Per resolution: the planned grid, the image's span tokens and the median preprocessing time."""
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.image_io import load_image
    from sglang_dsv41.vision_preprocess import preprocess_image

    vcfg = DeepseekV41Config.from_file(model_path).vision
    if vcfg is None:
        raise SystemExit(f"{model_path}: the checkpoint has no vision_config (no vision tower)")
    out = {}
    for w, h in sizes:
        times, pre = [], None
        for r in range(reps):
            png = make_png(10_000 + r, (w, h))
            t0 = time.perf_counter()
            pre = preprocess_image(load_image(png), vcfg)
            times.append(time.perf_counter() - t0)
        g = pre.grid
        out[f"{w}x{h}"] = {"grid_tokens": [g.n_h, g.n_w], "vit_patches": g.num_patches,
                           "span_tokens": g.n_h * (g.n_w + 1) + 2, "preprocess_ms_median": 1e3 * median(times),
                           "max_image_tokens": vcfg.max_image_tokens}
    return out


def start_server(args: argparse.Namespace) -> tuple[Proc, str]:
    """`sglang-dsv41 serve` on a free port in its own process group (log under ``--log-dir``)."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", args.device, "--model-path",
            args.model_path, "--port", str(port), "--enable-cache-report", *args.server_flags.split()]
    return Proc(argv, args.log_dir / f"{args.out.stem}.log"), f"http://127.0.0.1:{port}"


def chat(url: str, number: int, images: list[bytes], max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy chat request: TTFT, latency and the final usage."""
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in images]
    body = {"model": "default", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": f"Request {number}."}, *content,
                                                      {"type": "text", "text": TEXT}]}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("the stream carried no text or no usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": int(cached or 0), "completion_tokens": usage["completion_tokens"]}


def run_cases(url: str, args: argparse.Namespace, sizes: list[tuple[int, int]]) -> dict[str, dict]:
    number = iter(range(1, 1_000_000))
    cases: dict[str, list[tuple[int, list[bytes]]]] = {"text": [(next(number), []) for _ in range(args.reps)]}
    for i, (w, h) in enumerate(sizes):
        cases[f"image_{w}x{h}"] = [(next(number), [make_png(1000 * (i + 1) + r, (w, h))]) for r in range(args.reps)]
    w, h = sizes[-1]
    cases[f"repeat_{w}x{h}"] = [cases[f"image_{w}x{h}"][0]] * args.reps
    for k in args.images_per_request:
        cases[f"images_{k}"] = [(next(number), [make_png(100_000 * k + 100 * r + j, (w, h)) for j in range(k)])
                                for r in range(args.reps)]
    chat(url, 0, [make_png(7, (64, 64))], args.max_tokens, args.request_timeout)        # warm-up, not recorded
    out = {}
    for name, requests in cases.items():
        t0 = time.perf_counter()
        rows = [chat(url, n, images, args.max_tokens, args.request_timeout) for n, images in requests]
        wall = time.perf_counter() - t0
        out[name] = {"requests": rows, "ttft_ms_mean": 1e3 * mean(r["ttft_s"] for r in rows),
                     "ttft_ms_median": 1e3 * median(r["ttft_s"] for r in rows),
                     "latency_ms_mean": 1e3 * mean(r["latency_s"] for r in rows),
                     "requests_per_s": len(rows) / wall, "prompt_tokens": rows[0]["prompt_tokens"],
                     "cached_tokens_mean": mean(r["cached_tokens"] for r in rows)}
        print(name, {k: v for k, v in out[name].items() if k != "requests"})
    return out


def _cap_image(vcfg) -> "object":
    """Random patches on a square grid at the token cap (the planner's worst case)."""
    import math

    import torch

    from sglang_dsv41.vision_preprocess import ImageGrid, PreprocessedImage

    side, k, p = math.isqrt(vcfg.max_image_tokens), vcfg.downsample_ratio, vcfg.patch_size
    grid = ImageGrid(resized_width=side * k * p, resized_height=side * k * p, vit_h=side * k, vit_w=side * k,
                     n_h=side, n_w=side, resize_plain=False)
    patches = torch.randn(grid.num_patches, 3 * p * p, generator=torch.Generator().manual_seed(3))
    return PreprocessedImage(patches=patches.to(torch.bfloat16), grid=grid)


def planned_call_bytes(cfg, backend: str, pres: list) -> int:
    """The planner's formula for one ViT call of exactly these images."""
    from sglang_dsv41.deploy.vision_config import vit_activation_bytes

    return vit_activation_bytes(cfg.vision, cfg.text.hidden_size, backend,
                                patches=sum(p.grid.num_patches for p in pres),
                                longest=max(p.grid.num_patches for p in pres),
                                tokens=sum(p.grid.n_h * p.grid.n_w for p in pres),
                                span_tokens=sum(p.grid.num_tokens for p in pres), images=len(pres))


def _peak(tower, pres: list, device) -> int:
    """Bytes allocated above the ones already held while `encode_many(pres)` runs (CUDA)."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    tower.encode_many(pres)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def peak_rows(tower, cfg, cases: dict[str, list], backend: str, measure) -> dict[str, dict]:
    """Measured (`measure(tower, pres, device)`) against planned bytes of one cap image and of the
    first packed call of the first case: `planned_bytes` the formula for that call, `plan_bytes` the
    plan's figure (a full call at the budget; the same as the cap row's when the cap is a square)."""
    from sglang_dsv41.deploy.vision_config import vit_activation_bytes
    from sglang_dsv41.runtime.vision_calls import call_groups, call_patch_budget

    name, first = next(iter(cases.items()))
    group = [first[i] for i in call_groups([p.grid.num_patches for p in first], call_patch_budget(cfg.vision))[0]]
    rows = {}
    for label, pres in (("cap", cases["cap"][:1]), (f"packed_{len(group)}x{name}", group)):
        measured, planned = measure(tower, pres, tower.device), planned_call_bytes(cfg, backend, pres)
        rows[label] = {"measured_bytes": measured, "planned_bytes": planned, "images": len(pres),
                       "plan_bytes": vit_activation_bytes(cfg.vision, cfg.text.hidden_size, backend),
                       "patches": sum(p.grid.num_patches for p in pres),
                       "planned_over_measured": planned / measured if measured else None}
        print("vit", backend, label, "peak activation", rows[label], flush=True)
    return rows


def vit_throughput(args: argparse.Namespace, sizes: list[tuple[int, int]]) -> dict[str, object]:
    """Images/s of the tower alone per case and ``--vit-attention`` backend, and on CUDA the peak
    activation against the planner's (module doc). ``cases`` / ``cap_peak_activation`` are the first
    backend's; ``by_backend`` holds every backend's."""
    import torch

    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.presets import flash_config_dict
    from sglang_dsv41.runtime.forward import fp32_default_dtype
    from sglang_dsv41.runtime.image_io import load_image
    from sglang_dsv41.runtime.vision_calls import call_groups, call_patch_budget
    from sglang_dsv41.vision_preprocess import preprocess_image

    cfg = (DeepseekV41Config.from_dict(flash_config_dict()) if args.vit_dims == "flash"
           else DeepseekV41Config.from_file(args.model_path))
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cases = {f"{w}x{h}": [preprocess_image(load_image(make_png(500 + i, (w, h))), cfg.vision)
                          for i in range(args.vit_images)] for w, h in sizes}
    cases["cap"] = [_cap_image(cfg.vision)] * args.vit_images
    budget = call_patch_budget(cfg.vision)
    out: dict[str, object] = {"dims": args.vit_dims, "layers": cfg.vision.num_hidden_layers,
                              "hidden": cfg.vision.hidden_size, "images_per_case": args.vit_images,
                              "call_patch_budget": budget, "by_backend": {}}

    def timed(fn, *fn_args) -> float:
        sync()
        t0 = time.perf_counter()
        fn(*fn_args)
        sync()
        return time.perf_counter() - t0

    for requested in args.vit_attention.split(","):
        with fp32_default_dtype(), torch.device(device):
            tower = _random_tower(cfg, requested)
        if tower.attn.backend in out["by_backend"]:       # e.g. auto,sdpa on CPU
            continue
        backend = tower.attn.backend
        row: dict[str, object] = {"backend": backend, "describe": tower.attn.describe(), "cases": {}}
        for name, images in cases.items():
            calls = len(call_groups([p.grid.num_patches for p in images], budget))
            tower.encode_many(images)                   # warm-up (kernel selection, allocator)
            wall = timed(tower.encode_many, images)
            g = images[0].grid
            row["cases"][name] = {"images_per_s": len(images) / wall, "ms_per_image": 1e3 * wall / len(images),
                                  "vit_patches": g.num_patches, "tokens": g.num_tokens, "vit_calls": calls}
            if calls < len(images):                     # packing changed something: one image per call too
                tower.encode(images[0])
                one = timed(_one_per_call, tower, images)
                row["cases"][name]["images_per_s_one_per_call"] = len(images) / one
            print("vit", backend, name, row["cases"][name], flush=True)
        if device.type == "cuda":
            row["peak_activation"] = peak_rows(tower, cfg, cases, backend, _peak)
            row["cap_peak_activation"] = row["peak_activation"]["cap"]
        out["by_backend"][backend] = row
        if "cases" not in out:
            out["cases"] = row["cases"]
            if "cap_peak_activation" in row:
                out["cap_peak_activation"] = row["cap_peak_activation"]
        del tower
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _one_per_call(tower, pres: list) -> None:
    for pre in pres:
        tower.encode(pre)


def _random_tower(cfg, attention: str):
    """The tower on the current device with random BF16-valued weights (norms 1), seed 0."""
    import torch

    from sglang_dsv41.runtime.vision import VisionTower

    tower = VisionTower(cfg, attention=attention)
    gen = torch.Generator(device=tower.device).manual_seed(0)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
            p.copy_(torch.ones_like(p) if "norm" in name else (0.02 * noise).bfloat16().float())
    return tower


def plot(result: dict, path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib not installed"

    cases = result.get("cases", {})
    vit = (result.get("vit") or {}).get("cases", {})
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(cases)
    a.bar(names, [cases[n]["ttft_ms_median"] for n in names], color="tab:blue", label="TTFT (median)")
    a.plot(names, [cases[n]["latency_ms_mean"] for n in names], "o", color="tab:red", label="latency (mean)")
    a.set(ylabel="ms", title="time to first token / latency per request")
    a.tick_params(axis="x", rotation=20)
    a.legend()
    if vit:
        backends = (result["vit"].get("by_backend") or {"": {"cases": vit}})
        width = 0.8 / len(backends)
        for j, (backend, row) in enumerate(backends.items()):
            xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(vit))]
            b.bar(xs, [row["cases"][k]["images_per_s"] for k in vit], width=width, label=backend or None)
        for i, k in enumerate(vit):
            b.annotate(f"{vit[k]['vit_patches']} patches", (i, vit[k]["images_per_s"]), ha="center", va="bottom")
        b.set_xticks(range(len(vit)), list(vit))
        b.set_yscale("log")
        if len(backends) > 1:
            b.legend()
        b.set(ylabel="images/s", title=f"ViT alone ({result['vit']['dims']} dims, {result['vit']['layers']} layers)")
    else:
        pre = result["preprocessing"]
        b.bar(list(pre), [pre[k]["preprocess_ms_median"] for k in pre], color="tab:green")
        for i, k in enumerate(pre):
            b.annotate(f"{pre[k]['span_tokens']} tok", (i, pre[k]["preprocess_ms_median"]), ha="center", va="bottom")
        b.set(ylabel="ms (median)", title="client-side preprocessing per image")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(result["title"], fontsize=9)
    save_png(fig, path, dpi=110)
    return str(path)


def _machine() -> str:
    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.machine()} {model}, {os.cpu_count()} cores visible".replace("  ", " ")


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.partition("x")
    return int(w), int(h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="checkpoint (its vision_config plans the grids)")
    p.add_argument("--url", help="an already running server (default: start `sglang-dsv41 serve`)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-flags", default="--max-total-tokens 4096", help="extra flags of the started server")
    p.add_argument("--sizes", default="112x112,1024x768", help="image resolutions WxH, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--images-per-request", default="", help="also K images per request, for each K (e.g. 1,4,16)")
    p.add_argument("--vit", action="store_true", help="also the tower's own images/s in this process (module doc)")
    p.add_argument("--vit-dims", choices=("flash", "checkpoint"), default="checkpoint")
    p.add_argument("--vit-images", type=int, default=4, help="images per --vit case")
    p.add_argument("--vit-attention", default="auto", help="ViT attention backends for --vit, comma-separated "
                   "(auto, sdpa, fa3, triton: runtime/vision_attention.py)")
    p.add_argument("--no-server", action="store_true", help="no request cases (with --vit: the tower only)")
    p.add_argument("--dry-run", action="store_true", help="preprocessing only, no server")
    p.add_argument("--out", type=Path, default=RESULTS / "vision_cpu.json")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()), help="server log")
    args = p.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    args.images_per_request = [int(k) for k in args.images_per_request.split(",") if k.strip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    multi = (f", {'/'.join(map(str, args.images_per_request))} images per request at {sizes[-1][0]}x{sizes[-1][1]}"
             if args.images_per_request else "")
    title = (f"vision, {args.device}: the ViT alone, {args.vit_images} images per case" if args.no_server else
             f"vision, {args.device}: 1 image at {', '.join(f'{w}x{h}' for w, h in sizes)} vs text{multi}, "
             f"{args.reps} reps, {args.max_tokens} new tokens, sequential")
    result = {"title": title,
              "machine": _machine(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average_1_5_15_at_start": list(os.getloadavg()),
              "args": {k: str(v) for k, v in vars(args).items()},
              "preprocessing": preprocessing(args.model_path, sizes, args.reps)}
    if args.vit and not args.dry_run:
        result["vit"] = vit_throughput(args, sizes)
    if not args.dry_run and not args.no_server:
        server, url = (None, args.url) if args.url else start_server(args)
        try:
            t0 = time.monotonic()
            if server is not None:
                wait_up(url + "/health_generate", [server], args.startup_timeout)
            result["startup_s"] = time.monotonic() - t0
            result["cases"] = run_cases(url, args, sizes)
        finally:
            if server is not None:
                server.stop()
    if "cases" in result or "vit" in result:
        result["load_average_1_5_15_at_end"] = list(os.getloadavg())
        args.out.write_text(json.dumps(result, indent=1))     # the numbers first: a plot error loses nothing
        try:
            result["png"] = plot(result, args.out.with_suffix(".png"))
        except Exception as exc:                               # reported in the JSON and printed
            result["png"] = f"plot failed: {exc!r}"
            print(result["png"])
    args.out.write_text(json.dumps(result, indent=1))
    print("->", args.out)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # an outer `timeout` still stops the server
    sys.exit(main())
