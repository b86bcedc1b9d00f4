"""GPU check + benchmark for native_topk (torch + numpy only; no qsa_aiter import).

    python benchmarks/native_topk/check.py correct   # compile every variant, exactness vs torch oracle,
                                          # determinism, CUDA-graph replay after visible rewrite
    python benchmarks/native_topk/check.py bench     # work points, CUDA-graph timing vs torch.topk+sort
    python benchmarks/native_topk/check.py diag      # stage-cut / histogram-variant timings of the row kernel
    python benchmarks/native_topk/check.py all

Logs go to $OUT (or /tmp/native_topk_out): check_<phase>.txt and results_<phase>.json.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import launch as L  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/native_topk_out")
os.makedirs(OUT, exist_ok=True)
_LOG = None


def p(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    if _LOG:
        _LOG.write(s + "\n")
        _LOG.flush()


# ----------------------------------------------------------------------------- oracle
def to_keys(x: torch.Tensor) -> torch.Tensor:
    b = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = torch.where(b == 0x80000000, torch.zeros_like(b), b)
    return torch.where((b & 0x80000000) != 0, (~b) & 0xFFFFFFFF, b | 0x80000000)


def oracle(logits: torch.Tensor, visible: torch.Tensor, K: int, chunk: int = 1024) -> torch.Tensor:
    """Stable descending sort of keys (masked columns get key -1, i.e. after every visible
    column including -inf ones), first K, drop masked, sort ascending, pad -1."""
    rows, cols = logits.shape
    dev = logits.device
    out = torch.full((rows, K), -1, dtype=torch.int32, device=dev)
    if cols == 0:
        return out
    n = visible.long().clamp(0, cols)
    col = torch.arange(cols, device=dev)
    big = 1 << 40
    kk = min(K, cols)
    for r0 in range(0, rows, chunk):
        keys = to_keys(logits[r0:r0 + chunk])
        valid = col[None, :] < n[r0:r0 + chunk, None]
        keys = torch.where(valid, keys, torch.full_like(keys, -1))
        idx = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :kk]
        sv = torch.gather(valid, 1, idx)
        idx = torch.where(sv, idx, torch.full_like(idx, big))
        idx = torch.sort(idx, dim=1).values
        idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
        out[r0:r0 + chunk, :kk] = idx.to(torch.int32)
    return out


# ----------------------------------------------------------------------------- inputs
def gen_scores(kind: str, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    d = "cuda"
    rn = lambda: torch.randn(rows, cols, device=d, generator=g)  # noqa: E731
    if kind == "randn":
        return rn()
    if kind == "relu":
        return torch.relu(rn())
    if kind == "relu_sparse":  # ~3.6% positive: threshold is exact 0.0 with a partial tie count
        return torch.relu(rn() - 1.8)
    if kind == "const":
        return torch.full((rows, cols), 0.5, device=d)
    if kind == "zeros_pm":  # +0.0 / -0.0 mixture with a few positives and negatives
        x = torch.zeros(rows, cols, device=d)
        sgn = torch.rand(rows, cols, device=d, generator=g) < 0.5
        x = torch.where(sgn, -x, x)
        r = torch.rand(rows, cols, device=d, generator=g)
        x = torch.where(r < 0.01, torch.rand(rows, cols, device=d, generator=g) + 0.1, x)
        x = torch.where(r > 0.99, -torch.rand(rows, cols, device=d, generator=g) - 0.1, x)
        return x
    if kind == "neginf":  # 80% -inf
        x = rn()
        return torch.where(torch.rand(rows, cols, device=d, generator=g) < 0.8, float("-inf"), x)
    if kind == "allneginf":
        return torch.full((rows, cols), float("-inf"), device=d)
    if kind == "ints":  # few distinct values: heavy ties at every level
        return torch.randint(-3, 3, (rows, cols), device=d, generator=g).float()
    if kind == "wide":  # huge dynamic range, denormals, +-inf, signed zeros
        e = torch.randint(-45, 38, (rows, cols), device=d, generator=g).float()
        x = rn() * torch.pow(10.0, e)
        r = torch.rand(rows, cols, device=d, generator=g)
        x = torch.where(r < 0.02, float("-inf"), x)
        x = torch.where((r > 0.02) & (r < 0.025), float("inf"), x)
        x = torch.where((r > 0.5) & (r < 0.52), -0.0, x)
        x = torch.where((r > 0.6) & (r < 0.62), 0.0, x)
        return x
    if kind == "bf16":
        return rn().bfloat16().float()
    if kind == "runs":  # long runs of exact 0.0 with islands of values
        x = torch.relu(rn())
        blk = (torch.arange(cols, device=d) // 1000) % 3 == 0
        return torch.where(blk[None, :], 0.0, x)
    raise ValueError(kind)


def gen_visible(mode: str, rows: int, cols: int, K: int, g: torch.Generator) -> torch.Tensor:
    d = "cuda"
    if mode == "full":
        v = torch.full((rows,), cols, device=d)
    elif mode == "random":
        v = torch.randint(-2, cols + 4, (rows,), device=d, generator=g)
    elif mode == "mixed":
        sp = torch.tensor([0, 1, K - 1, K, K + 1, cols - 1, cols, cols + 5, -1, K + 2, 2 * K + 1, cols // 2],
                          device=d)
        v = torch.randint(0, cols + 1, (rows,), device=d, generator=g)
        m = min(rows, sp.numel())
        v[:m] = sp[:m]
    elif mode == "decode":
        v = cols - torch.arange(rows, device=d) % 7
    elif mode == "prefill":
        v = (torch.arange(rows, device=d) * cols) // max(rows - 1, 1)
    else:
        raise ValueError(mode)
    return v.to(torch.int32).contiguous()


def make_case(kind, rows, cols, K, vis_mode, seed, pad=0, misalign=False):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    x = gen_scores(kind, rows, cols, g)
    vis = gen_visible(vis_mode, rows, cols, K, g)
    ld = cols + pad
    off = 1 if misalign else 0
    store = torch.full((rows * ld + off + 4,), float("nan"), device="cuda")
    view = store[off:off + rows * ld].view(rows, ld)[:, :cols]
    n = vis.long().clamp(0, cols)
    colidx = torch.arange(cols, device="cuda")
    view.copy_(torch.where(colidx[None, :] < n[:, None], x, float("nan")))  # NaN past visible
    return view, vis


def applicable_plans(rows, cols, K):
    _, optin, major = L._device_info(0)
    plans = []
    cap = L._round4(cols)
    for b in (256, 512):
        pl = L.rows_plan(b, cols, 1)
        if L.plan_smem(pl) <= optin:
            plans.append(pl)
    pl = L.rows_plan(512, cols, 1)
    pl["cand_cap"] = 8  # tiny candidate list: exercises the full-scan fallback of the cached path
    if L.plan_smem(pl) <= optin:
        plans.append(pl)
    plans.append(L.rows_plan(512, cols, 0))
    plans.append(L.rows_plan(256, cols, 0, buf_cap=8))  # forces global re-scan
    if major >= 9:
        for cl in (2, 4, 8):
            pl = L.cluster_plan(cl, cols)
            if L.plan_smem(pl) <= optin:
                plans.append(pl)
        pl = L.cluster_plan(4, cols)
        pl["cand_cap"] = 8
        if L.plan_smem(pl) <= optin:
            plans.append(pl)
    return plans


def first_diff(a, b, vis, K):
    bad = (a != b).any(dim=1).nonzero().flatten()
    r = int(bad[0])
    cols = (a[r] != b[r]).nonzero().flatten()
    c0 = int(cols[0])
    return (f"{bad.numel()} bad rows; row {r} n={int(vis[r])} K={K} first diff at {c0}: "
            f"ours {a[r, max(0, c0 - 3):c0 + 5].tolist()} oracle {b[r, max(0, c0 - 3):c0 + 5].tolist()}")


# ----------------------------------------------------------------------------- correctness
def run_correct(res):
    p("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
    sms, optin, major = L._device_info(0)
    p(f"SMs {sms}, smem opt-in {optin} B, cc major {major}")
    if hasattr(torch.cuda, "_compile_kernel"):
        p("torch.cuda._compile_kernel signature:", str(inspect.signature(torch.cuda._compile_kernel)))
    names = ["topk_rows_256", "topk_rows_512"] + (
        ["topk_cluster2_512", "topk_cluster4_512", "topk_cluster8_512"] if major >= 9 else [])
    for nm in names:
        L.get_kernel(nm)
    for line in L.COMPILE_LOG:
        p("compile:", line)

    shapes = [  # rows, cols, K
        (7, 1, 1), (5, 3, 7), (9, 100, 7), (33, 1000, 64), (17, 4097, 512), (64, 8192, 512),
        (3, 8193, 2048), (40, 25088, 512), (16, 65536, 512), (2, 70001, 512), (1, 65536, 1),
        (1, 131072, 2048), (36, 32768, 512), (300, 3000, 64), (4, 50001, 7), (8, 12289, 2048),
        (11, 20000, 1), (5, 9000, 2048), (3, 16, 7),
    ]
    kinds = ["randn", "relu", "relu_sparse", "const", "zeros_pm", "neginf", "allneginf", "ints", "wide",
             "bf16", "runs"]
    vmodes = ["full", "random", "mixed", "decode", "prefill"]
    cases = []
    i = 0
    for (r, c, k) in shapes:
        ks = ["randn", "relu_sparse", kinds[i % len(kinds)], kinds[(i * 5 + 3) % len(kinds)]]
        for j, kind in enumerate(dict.fromkeys(ks)):
            vm = vmodes[(i + j) % len(vmodes)]
            pad = [0, 0, 5, 3][(i + j) % 4]
            mis = (i + j) % 5 == 4
            cases.append((kind, r, c, k, vm, 1000 + i * 10 + j, pad, mis))
        i += 1
    # many rows / K sweep on one width
    for k in (1, 7, 64, 512, 2048):
        cases.append(("relu", 2000, 4096, k, "random", 77 + k, 0, False))
    cases.append(("randn", 16384, 1000, 64, "random", 5, 0, False))
    cases.append(("ints", 16384, 640, 7, "full", 6, 0, False))

    nfail = 0
    ntest = 0
    t0 = time.time()
    # every third case with the full-scan build first (the fallback), then every case with the default
    runs = [(cs, ("TOPK_FAST=0",)) for cs in cases[::3]] + [(cs, ()) for cs in cases]
    for ((kind, r, c, k, vm, seed, pad, mis), defs) in runs:
        logits, vis = make_case(kind, r, c, k, vm, seed, pad, mis)
        ref = oracle(logits, vis, k)
        auto = L.choose_plan(r, c, k)
        plans = [None] + applicable_plans(r, c, k)
        for pl in plans:
            name = "auto:" + L.plan_name(auto) if pl is None else L.plan_name(pl)
            if pl is not None and pl.get("cand_cap") == 8:
                name += "-cand8"
            tag = f"{kind:11s} {r:5d}x{c:<6d} K={k:<4d} vis={vm:7s} pad={pad} mis={int(mis)} {name} {' '.join(defs)}"
            ntest += 1
            try:
                o1 = L.block_topk(logits, vis, k, plan=pl, defines=defs)
                o2 = L.block_topk(logits, vis, k, plan=pl, defines=defs)
                torch.cuda.synchronize()
                ok = torch.equal(o1, ref)
                det = torch.equal(o1, o2)
                if not ok or not det:
                    nfail += 1
                    msg = first_diff(o1, ref, vis, k) if not ok else "nondeterministic"
                    if nfail <= 60:
                        p("FAIL", tag, msg)
                    res["fail"].append(tag + " " + msg)
            except Exception as ex:  # noqa: BLE001
                nfail += 1
                p("ERROR", tag, repr(ex))
                res["fail"].append(tag + " " + repr(ex))
                if "illegal" in repr(ex).lower() or "launch failure" in repr(ex).lower():
                    p("sticky CUDA error: abort correctness phase")
                    res["aborted"] = True
                    return
        del logits, vis, ref
    p(f"exactness+determinism: {ntest - nfail}/{ntest} passed ({len(runs)} case runs, {time.time() - t0:.1f}s)")
    nfast = sum(1 for f in res["fail"] if "TOPK_FAST=0" not in f)
    p(f"  failures with default build: {nfast}, with TOPK_FAST=0: {len(res['fail']) - nfast}")
    res["exact_pass"], res["exact_total"] = ntest - nfail, ntest

    # CUDA graph: capture once, rewrite visible in place, replay
    gfail = 0
    gcases = [(64, 8192, 512, None), (16, 65536, 512, None), (1, 65536, 512, None), (300, 25088, 2048, None),
              (36, 32768, 512, L.rows_plan(512, 32768, 0))]
    for (r, c, k, pl) in gcases:
        logits, vis = make_case("relu", r, c, k, "full", 99, 0, False)
        logits = logits.clone()
        out = torch.empty(r, k, dtype=torch.int32, device="cuda")
        L.block_topk(logits, vis, k, out, plan=pl)  # compile + configure outside capture
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            L.block_topk(logits, vis, k, out, plan=pl)
        gg = torch.Generator(device="cuda")
        gg.manual_seed(r + c)
        for t in range(4):
            vis.copy_(gen_visible(["random", "mixed", "decode", "full"][t], r, c, k, gg))
            logits.copy_(torch.randn(r, c, device="cuda", generator=gg).relu())
            out.fill_(-7)
            gr.replay()
            torch.cuda.synchronize()
            ref = oracle(logits, vis, k)
            name = L.plan_name(pl or L.choose_plan(r, c, k))
            if not torch.equal(out, ref):
                gfail += 1
                p("GRAPH FAIL", r, c, k, name, t, first_diff(out, ref, vis, k))
                res["fail"].append(f"graph {r}x{c} K={k} {name} t={t}")
        p(f"graph replay after visible rewrite: {r}x{c} K={k} {L.plan_name(pl or L.choose_plan(r, c, k))}: "
          f"{'ok' if gfail == 0 else 'FAIL'}")
    res["graph_fail"] = gfail

    # optional non-portable cluster 16
    try:
        k16 = L.get_kernel("topk_cluster16_512")
        ok16 = True
        for (kind, r, c, k) in [("randn", 1, 65536, 512), ("relu_sparse", 16, 65536, 512),
                                ("ints", 3, 131072, 2048), ("randn", 5, 20000, 7)]:
            logits, vis = make_case(kind, r, c, k, "mixed" if r > 3 else "full", 3, 0, False)
            pl = L.cluster_plan(16, c)
            o = L.block_topk(logits, vis, k, plan=pl)
            torch.cuda.synchronize()
            ref = oracle(logits, vis, k)
            if not torch.equal(o, ref):
                ok16 = False
                p("cluster16 FAIL", kind, r, c, k, first_diff(o, ref, vis, k))
        p("cluster16:", "ok" if ok16 else "FAIL", k16.backend)
        res["cluster16"] = ok16
    except Exception as ex:  # noqa: BLE001
        p("cluster16 unavailable:", repr(ex))
        res["cluster16"] = repr(ex)

    # alternative backend (ctypes: NVRTC -> CUBIN -> cuLaunchKernel)
    try:
        logits, vis = make_case("relu", 36, 32768, 512, "decode", 11, 0, False)
        ref = oracle(logits, vis, 512)
        okc = True
        for pl in [L.choose_plan(36, 32768, 512), L.rows_plan(512, 32768, 1)]:
            o = L.block_topk(logits, vis, 512, plan=pl, backend="ctypes")
            torch.cuda.synchronize()
            okc &= torch.equal(o, ref)
        p("ctypes backend:", "ok" if okc else "FAIL")
        for line in L.COMPILE_LOG:
            if "ctypes" in line:
                p("compile:", line)
        res["ctypes_backend"] = okc
    except Exception as ex:  # noqa: BLE001
        p("ctypes backend unavailable:", repr(ex))
        res["ctypes_backend"] = repr(ex)


# ----------------------------------------------------------------------------- bench
def work_points():
    g = torch.Generator(device="cpu")
    g.manual_seed(0)
    ri = lambda lo, hi, n: torch.randint(lo, hi, (n,), generator=g)  # noqa: E731

    def verify_rows(bases, cols):
        v = (bases[:, None] - 3 + torch.arange(4)[None, :]).flatten()
        return v.clamp(0, cols)

    pts = []
    ctx = ri(65536, 131072, 9)
    pts.append(("decode 9x4 @64-128K", 36, 32768, verify_rows(ctx // 4, 32768), 8.0))
    pts.append(("decode 4x4 @262K", 16, 65536, verify_rows(65536 - ri(0, 64, 4), 65536), 8.0))
    pts.append(("decode 1 row @262K", 1, 65536, torch.tensor([65536]), 6.0))
    pts.append(("decode 64x4 @98K", 256, 25088, verify_rows(25088 - ri(0, 512, 64), 25088), 15.0))
    pts.append(("decode 128x1 @98K", 128, 25088, 25088 - ri(0, 512, 128), 15.0))
    pos = 32768 - 4096 + torch.arange(4096)
    pts.append(("prefill 4096 @32K", 4096, 8192, (pos + 1) // 4, 70.0))
    pos = 98304 - 16384 + torch.arange(16384)
    pts.append(("prefill 16K @96K", 16384, 24576, (pos + 1) // 4, 700.0))
    return pts


def time_graph(fns, nrep=30):
    """fns: list of callables (one per buffer); one graph holds all; returns median us/launch."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for f in fns:
            f()
    for _ in range(3):
        gr.replay()
    torch.cuda.synchronize()
    ts = []
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    for _ in range(nrep):
        e0.record()
        gr.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000.0 / len(fns))
    del gr
    return statistics.median(ts), min(ts)


def run_bench(res):
    p("device", torch.cuda.get_device_name(0), "torch", torch.__version__)
    sms, optin, major = L._device_info(0)
    K = 512
    rows_out = []
    extra = {  # alternative plans timed next to the automatic one
        "decode 9x4 @64-128K": [L.cluster_plan(8, 32768), L.rows_plan(512, 32768, 1)],
        "decode 4x4 @262K": [L.cluster_plan(16, 65536), L.cluster_plan(4, 65536)],
        "decode 1 row @262K": [L.cluster_plan(16, 65536), L.cluster_plan(4, 65536)],
        "decode 128x1 @98K": [L.cluster_plan(2, 25088)],
        "decode 64x4 @98K": [L.rows_plan(256, 25088, 1)],
        "prefill 4096 @32K": [L.rows_plan(512, 8192, 1)],
    }
    for (name, rows, cols, vis_cpu, target) in work_points():
        for flavour in (["randn", "relu_sparse"] if name.startswith("decode 9x4") else ["randn"]):
            nbytes = rows * cols * 4
            nbuf = int(min(256, max(2, math.ceil(256e6 / nbytes))))
            g = torch.Generator(device="cuda")
            g.manual_seed(1)
            bufs = []
            for _ in range(nbuf):
                bufs.append(gen_scores(flavour, rows, cols, g))
            vis = vis_cpu.to(torch.int32).cuda()
            out = torch.empty(rows, K, dtype=torch.int32, device="cuda")
            auto = L.choose_plan(rows, cols, K)
            # exactness at the work point (first buffer)
            ref = oracle(bufs[0], vis, K)
            plans = [auto] + extra.get(name, [])
            for pl in plans:
                tag = f"{name} [{flavour}] {rows}x{cols} {L.plan_name(pl)}"
                try:
                    o = L.block_topk(bufs[0], vis, K, plan=pl)
                    torch.cuda.synchronize()
                    exact = torch.equal(o, ref)
                    med, mn = time_graph([lambda b=b, pl=pl: L.block_topk(b, vis, K, out, plan=pl) for b in bufs])
                except Exception as ex:  # noqa: BLE001
                    p("ERROR", tag, repr(ex))
                    res["fail"].append(tag + " " + repr(ex))
                    if "illegal" in repr(ex).lower():
                        return
                    continue
                rows_out.append({"point": name, "flavour": flavour, "shape": f"{rows}x{cols}", "plan": L.plan_name(pl),
                                 "auto": pl is auto, "us": med, "us_min": mn, "target_us": target, "exact": exact,
                                 "nbuf": nbuf})
                p(f"{tag}: {med:8.2f} us (min {mn:.2f}) target {target} exact={exact} nbuf={nbuf}")
            # torch baseline (ignores visible): topk + sort of indices
            try:
                tmed, tmn = time_graph([lambda b=b: torch.topk(b, K, dim=1, sorted=False).indices.sort(dim=1)
                                        for b in bufs[:max(2, min(nbuf, 32))]])
            except Exception as ex:  # noqa: BLE001
                tmed = float("nan")
                p("torch baseline error", repr(ex))
            rows_out.append({"point": name, "flavour": flavour, "shape": f"{rows}x{cols}", "plan": "torch.topk+sort",
                             "auto": False, "us": tmed, "target_us": target, "exact": None})
            p(f"{name} [{flavour}] torch.topk+sort: {tmed:8.2f} us")
            del bufs, ref
            torch.cuda.empty_cache()
    res["bench"] = rows_out
    p("")
    p(f"{'point':24s} {'flavour':11s} {'shape':12s} {'plan':22s} {'ours us':>9s} {'torch us':>9s} {'target':>7s} met exact")
    tb = {(r["point"], r["flavour"]): r["us"] for r in rows_out if r["plan"] == "torch.topk+sort"}
    for r in rows_out:
        if r["plan"] == "torch.topk+sort":
            continue
        met = "yes" if r["us"] <= r["target_us"] else "no"
        p(f"{r['point']:24s} {r['flavour']:11s} {r['shape']:12s} {r['plan'] + ('*' if r['auto'] else ''):22s} "
          f"{r['us']:9.2f} {tb.get((r['point'], r['flavour']), float('nan')):9.2f} {r['target_us']:7.1f} {met:3s} "
          f"{r['exact']}")
    p("(* = plan chosen automatically; torch = torch.topk(k, sorted=False).indices.sort(), no visible masking)")


# ----------------------------------------------------------------------------- diagnostics
def run_diag(res):
    """Time stage cuts (TOPK_STAGE) and histogram variants (TOPK_HIST) of the row kernel."""
    K = 512
    out_rows = []
    shapes = [("36x32768 rows512", 36, 32768, L.rows_plan(512, 32768, 1)),
              ("4096x8192 rows256", 4096, 8192, L.rows_plan(256, 8192, 1)),
              ("2048x24576 rows512", 2048, 24576, L.rows_plan(512, 24576, 1))]
    variants = [("load only", ("TOPK_HIST=9", "TOPK_STAGE=1")),
                ("hist3 stage1", ("TOPK_STAGE=1",)),
                ("default (fast,hist3)", ()),
                ("fast hist1", ("TOPK_HIST=1",)),
                ("fast hist0", ("TOPK_HIST=0",)),
                ("full-scan hist3", ("TOPK_FAST=0",))]
    for (sname, rows, cols, pl) in shapes:
        nbuf = int(min(64, max(2, math.ceil(256e6 / (rows * cols * 4)))))
        g = torch.Generator(device="cuda")
        g.manual_seed(2)
        bufs = [torch.randn(rows, cols, device="cuda", generator=g) for _ in range(nbuf)]
        vis = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, K, dtype=torch.int32, device="cuda")
        for (vname, defs) in variants:
            try:
                med, mn = time_graph([lambda b=b, d=defs: L.block_topk(b, vis, K, out, plan=pl, defines=d)
                                      for b in bufs], nrep=20)
            except Exception as ex:  # noqa: BLE001
                p("diag error", sname, vname, repr(ex))
                continue
            gbs = rows * cols * 4 / (med * 1e-6) / 1e9
            p(f"diag {sname:20s} {vname:20s} {med:9.2f} us  ({gbs:7.1f} GB/s of logits)")
            out_rows.append({"shape": sname, "variant": vname, "us": med})
        del bufs
        torch.cuda.empty_cache()
    res["diag"] = out_rows


def main():
    global _LOG
    phase = sys.argv[1] if len(sys.argv) > 1 else "all"
    phases = ["correct", "bench", "diag"] if phase == "all" else [phase]
    for ph in phases:
        _LOG = open(os.path.join(OUT, f"check_{ph}.txt"), "w")
        res = {"fail": []}
        try:
            {"correct": run_correct, "bench": run_bench, "diag": run_diag}[ph](res)
        except Exception:  # noqa: BLE001
            p(traceback.format_exc())
            res["fail"].append("exception: " + traceback.format_exc().splitlines()[-1])
        json.dump(res, open(os.path.join(OUT, f"results_{ph}.json"), "w"), indent=1, default=str)
        p(f"[{ph}] failures: {len(res['fail'])}")
        _LOG.close()
        _LOG = None


if __name__ == "__main__":
    main()
