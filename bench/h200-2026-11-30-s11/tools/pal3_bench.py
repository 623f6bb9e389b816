# As run in session 11 (device calls 5, 6, 8, 9, against kernels/gemv.cu of d9b7e1e; bench/RESULTS.md, session 11):
# python3 pal3_bench.py (pal4 vs pal3), FLOORV=1 (fixed-cost variants), PROFILE=1 under ncu.
"""Microbenchmark: gemv_pal4 (registers) against gemv_pal4_tma (TMA ring), cold, same data."""
import ctypes, glob, os, site, sys, time
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
K = os.path.join(ROOT, "crates/cuda/kernels")
PAIRED = os.environ.get("PAIRED") == "1"
GEMV = open(f"{K}/gemv.cu").read()
if PAIRED:  # tiles of a pair interleaved block by block: block kb of tile 2p, then of 2p + 1
    for a, b in [("const uint4* p0 = ok ? p + u * S * 32 : safe;", "const uint4* p0 = ok ? p + u * S * 64 : safe;"),
                 ("p + tile_words + u * S * 32 : safe;", "p + 32 + u * S * 64 : safe;"),
                 ("const uint4* p_pair = idx + 2 * (size_t)pair * tile_words + wi * 32 + lane;",
                  "const uint4* p_pair = idx + 2 * (size_t)pair * tile_words + wi * 64 + lane;"),
                 ("p += S * GEMV_UNROLL * 32;", "p += S * GEMV_UNROLL * 64;")]:
        assert GEMV.count(a) == 1, a
        GEMV = GEMV.replace(a, b)
if os.environ.get("SKIP_TABLE"):
    GEMV = GEMV.replace("__device__ __forceinline__ void pal4_fill_table(uint4 pal) {", "__device__ __forceinline__ void pal4_fill_table(uint4 pal) { return;")
if os.environ.get("SKIP_X"):
    GEMV = GEMV.replace("    for (int p = threadIdx.x; p < k / 4; p += blockDim.x) {\n        float4 v = __ldcg", "    for (int p = threadIdx.x; p < 0; p += blockDim.x) {\n        float4 v = __ldcg")
SRC = (open(f"{K}/common.cuh").read() + "\n#line 1 \"gemv.cu\"\n" + GEMV + "\n#line 1 \"pal3.cu\"\n"
       + open(f"{HERE}/pal3.cu").read()).encode()


def find_nvrtc():
    cands = []
    for d in ["/usr/local/cuda/lib64"] + site.getsitepackages() + [os.environ.get("NVRTC_DIR", "")]:
        cands += glob.glob(os.path.join(d, "**", "libnvrtc.so*"), recursive=True)
    return [c for c in cands if "builtins" not in c and "alt" not in c][0]


nvrtc = ctypes.CDLL(find_nvrtc())
vp = ctypes.c_void_p


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: error {r}")


def compile_(defines, arch="sm_90", src=None):
    prog = vp()
    ck(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src or SRC, b"tma.cu", 0, None, None), "create")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--ptxas-options=-v"]
    opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if r != 0:
        raise RuntimeError(log.value.decode()[-3000:])
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    lines = log.value.decode().splitlines()
    info = {}
    cur = None
    for l in lines:
        if "Compiling entry function" in l:
            cur = l.split("'")[1]
        elif cur and ("registers" in l or "spill" in l):
            info[cur] = info.get(cur, "") + " " + l.split(":")[-1].strip()
    return cubin.raw, info


BF16 = os.environ.get("MODE") == "bf16"


def cfg_defines(W, G, U, NST):
    return dict(GEMV_WARPS=W, GEMV_ROWS=G, GEMV_UNROLL=U, PAL3_ESC_LANES=NST)


def smem(kind, W, G, U, NST, k):
    sums = ((2 * (W + G) * 32 + W) * 4 + 15) // 16 * 16
    if kind in ("gemv_pal4", "gemv_pal4_bf16"):
        return 65536 + sums + 4 * k
    if kind == "gemv_pal3":
        return 8192 + sums + 4 * k
    x_lo = 1024 + 65536 + sums + 2 * k
    ring = (x_lo + 2 * k + 127) // 128 * 128
    bars = ring + G * NST * 2 * (W // G) * U * 512 * (3 if BF16 else 1)
    return bars + 16 * G * NST - 1024


if __name__ == "__main__" and sys.argv[1:2] == ["compile"]:
    for c in [(14, 7, 2, 4), (16, 1, 2, 3), (16, 2, 4, 3)]:
        _, info = compile_(cfg_defines(*c))
        print(c, {k: v for k, v in info.items() if "pal4" in k and "bf16" not in k and "norm" not in k})
    sys.exit(0)

cuda = ctypes.CDLL("libcuda.so.1")
torch.zeros(1, device="cuda")
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count


class U4(ctypes.Structure):
    _fields_ = [("v", ctypes.c_uint32 * 4)]


class Kern:
    def __init__(self, mod, name, W, G, U, NST):
        self.f = vp()
        ck(cuda.cuModuleGetFunction(ctypes.byref(self.f), mod, name.encode()), "getfn " + name)
        self.name, self.W, self.G, self.U, self.NST = name, W, G, U, NST

    def prepare(self, n, k):
        self.sm = smem(self.name, self.W, self.G, self.U, self.NST, k)
        if self.sm > 227 * 1024:
            return False
        ck(cuda.cuFuncSetAttribute(self.f, 8, self.sm), "setattr")
        per = ctypes.c_int()
        ck(cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per), self.f, self.W * 32, ctypes.c_size_t(self.sm)), "occ")
        pairs = (n + 31) // 32
        self.grid = min((pairs + self.G - 1) // self.G, max(per.value, 1) * SMS)
        self.per = per.value
        return per.value > 0

    def launch(self, stream, d, idx, y, n, k):
        pal = U4()
        for i in range(4):
            pal.v[i] = d["pal"][i]
        third = d["rs"]
        args = [vp(idx.data_ptr()), pal, vp(d["esc_ptr"].data_ptr()), vp(d["esc"].data_ptr()), vp(third.data_ptr()),
                vp(d["x"].data_ptr()), vp(y.data_ptr()), ctypes.c_int(n), ctypes.c_int(k)]
        params = (vp * len(args))(*[ctypes.cast(ctypes.pointer(a), vp) for a in args])
        ck(cuda.cuLaunchKernel(self.f, self.grid, 1, 1, self.W * 32, 1, 1, self.sm, vp(stream), params, None), "launch")


E4M3 = torch.arange(256, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn).to(torch.float64)


def codes_for(n, k, mult, g):
    z = torch.randn(n, k, device=dev, generator=g)
    tau = torch.where(torch.rand(n, k, device=dev, generator=g) < 0.03, 2.5, 1.0)
    outl = torch.where(torch.randint(0, 256, (k,), device=dev, generator=g) == 0, 4.0, 1.0)
    rowsc = torch.exp(0.25 * torch.randn(n, 1, device=dev, generator=g))
    w = z * tau * outl * rowsc
    del z, tau
    amax = w.abs().amax(1, keepdim=True)
    scale = mult * amax / 448.0
    return (w / scale).to(torch.float8_e4m3fn).view(torch.uint8), scale


def entropy(codes):
    h = torch.bincount(codes.flatten().long(), minlength=256).double()
    p = h[h > 0] / h.sum()
    return -(p * p.log2()).sum().item()


def make(n, k, bits=2.1, seed=1):
    global SLOTS
    d16 = make_slots(n, k, bits, seed, 16)
    d8 = make_slots(n, k, bits, seed, 8)
    return d16, d8


def make_slots(n, k, bits, seed, slots):
    global SLOTS
    SLOTS = slots
    lo, hi = 0.0, 24.0
    for _ in range(30):
        mid = (lo + hi) / 2
        c, _ = codes_for(256, k, 2 ** mid, torch.Generator(device=dev).manual_seed(99))
        if entropy(c) > bits:
            lo = mid
        else:
            hi = mid
    g = torch.Generator(device=dev).manual_seed(seed)
    codes, scale = codes_for(n, k, 2 ** mid, g)
    hist = torch.bincount(codes.flatten().long(), minlength=256)
    top = torch.argsort(hist, descending=True)[:SLOTS].tolist()
    if 0 not in top:
        top[-1] = 0
    zero_slot = top.index(0)
    slot = torch.full((256,), 255, dtype=torch.uint8, device=dev)
    for i, c in enumerate(top):
        slot[c] = i
    idx = slot[codes.long()]
    escm = idx == 255
    idx[escm] = zero_slot
    rows, cols = escm.nonzero(as_tuple=True)
    esc = (cols.to(torch.int64) | (codes[rows, cols].to(torch.int64) << 24)).to(torch.int32)
    esc_ptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    esc_ptr[1:] = torch.bincount(rows, minlength=n).cumsum(0)
    ntiles, nkb = (n + 15) // 16, k // 64
    pad = torch.full((ntiles * 16 - n, k), zero_slot, dtype=torch.uint8, device=dev)
    if PAIRED:
        ix = torch.cat([idx, pad]).view(ntiles // 2, 2, 2, 8, nkb, 4, 2, 4, 2).permute(0, 4, 1, 3, 7, 5, 6, 2, 8).contiguous().view(-1, 2)
    else:
        ix = torch.cat([idx, pad]).view(ntiles, 2, 8, nkb, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 5, 1, 7).contiguous().view(-1, 2)
    packed = (ix[:, 0] | (ix[:, 1] << 4)).contiguous()
    if slots == 8:
        pr = (ix[:, 0].to(torch.int64) | (ix[:, 1].to(torch.int64) << 3)).view(ntiles, nkb, 32, 4, 4)
        V = pr[..., 0] | (pr[..., 1] << 6) | (pr[..., 2] << 12) | (pr[..., 3] << 18)  # [t, b, lane, s]
        words = torch.stack([V[..., s] | (((V[..., 3] >> (8 * s)) & 255) << 24) for s in range(3)], dim=2)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        packed = words.contiguous().view(-1)  # [t, b, word, lane]
    pal = bytes(top) + bytes(16 - len(top))
    rs = (scale.flatten() * (1 + 0.1 * torch.rand(n, device=dev, generator=g))).float()
    x = torch.randn(k, device=dev, generator=g)
    y_ref = torch.empty(n, dtype=torch.float64, device=dev)
    for r in range(0, n, 4096):
        y_ref[r:r + 4096] = (E4M3[codes[r:r + 4096].long()] @ x.double()) * rs[r:r + 4096].double()
    return dict(packed=packed, pal=[int.from_bytes(pal[4 * i:4 * i + 4], "little") for i in range(4)],
                esc_ptr=esc_ptr.to(torch.int32), esc=esc, rs=rs, x=x, y_ref=y_ref, ent=entropy(codes),
                frac=escm.double().mean().item())


def make_bf16(n, k, seed=1):
    g = torch.Generator(device=dev).manual_seed(seed)
    z = torch.randn(n, k, device=dev, generator=g)
    tau = torch.where(torch.rand(n, k, device=dev, generator=g) < 0.03, 2.5, 1.0)
    outl = torch.where(torch.randint(0, 256, (k,), device=dev, generator=g) == 0, 4.0, 1.0)
    rowsc = 0.02 * torch.exp(0.25 * torch.randn(n, 1, device=dev, generator=g))
    wb = (z * tau * outl * rowsc).to(torch.bfloat16)
    del z, tau
    bits = wb.view(torch.int16).to(torch.int32) & 0xffff
    hi = (bits >> 8).to(torch.uint8)
    lo = (bits & 0xff).to(torch.uint8)
    hist = torch.bincount(hi.flatten().long(), minlength=256)
    hist[0] = -1
    top = [0] + torch.argsort(hist, descending=True)[:15].tolist()
    slot = torch.full((256,), 255, dtype=torch.uint8, device=dev)
    for i, c in enumerate(top):
        slot[c] = i
    idx = slot[hi.long()]
    escm = idx == 255
    idx[escm] = 0
    lo[escm] = 0
    rows, cols = escm.nonzero(as_tuple=True)
    esc = (cols.to(torch.int64) | (bits[rows, cols].to(torch.int64) << 16)).to(torch.int64)
    esc = torch.where(esc >= 2**31, esc - 2**32, esc).to(torch.int32)
    esc_ptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    esc_ptr[1:] = torch.bincount(rows, minlength=n).cumsum(0)
    ntiles, nkb = (n + 15) // 16, k // 64
    pad = torch.zeros((ntiles * 16 - n, k), dtype=torch.uint8, device=dev)
    perm = (0, 3, 2, 6, 4, 5, 1, 7)
    if PAIRED:
        pp = (0, 4, 1, 3, 7, 5, 6, 2, 8)
        ix = torch.cat([idx, pad]).view(ntiles // 2, 2, 2, 8, nkb, 4, 2, 4, 2).permute(*pp).contiguous().view(-1, 2)
        lop = torch.cat([lo, pad]).view(ntiles // 2, 2, 2, 8, nkb, 4, 2, 4, 2).permute(*pp).contiguous().view(-1)
    else:
        ix = torch.cat([idx, pad]).view(ntiles, 2, 8, nkb, 4, 2, 4, 2).permute(*perm).contiguous().view(-1, 2)
        lop = torch.cat([lo, pad]).view(ntiles, 2, 8, nkb, 4, 2, 4, 2).permute(*perm).contiguous().view(-1)
    packed = (ix[:, 0] | (ix[:, 1] << 4)).contiguous()
    if slots == 8:
        pr = (ix[:, 0].to(torch.int64) | (ix[:, 1].to(torch.int64) << 3)).view(ntiles, nkb, 32, 4, 4)
        V = pr[..., 0] | (pr[..., 1] << 6) | (pr[..., 2] << 12) | (pr[..., 3] << 18)  # [t, b, lane, s]
        words = torch.stack([V[..., s] | (((V[..., 3] >> (8 * s)) & 255) << 24) for s in range(3)], dim=2)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        packed = words.contiguous().view(-1)  # [t, b, word, lane]
    pal = bytes(top) + bytes(16 - len(top))
    x = torch.randn(k, device=dev, generator=g)
    y_ref = torch.empty(n, dtype=torch.float64, device=dev)
    for r in range(0, n, 4096):
        y_ref[r:r + 4096] = wb[r:r + 4096].double() @ x.double()
    d = dict(packed=packed, lo=lop, pal=[int.from_bytes(pal[4 * i:4 * i + 4], "little") for i in range(4)],
             esc_ptr=esc_ptr.to(torch.int32), esc=esc, rs=None, x=x, y_ref=y_ref, ent=0.0,
             frac=escm.double().mean().item())
    d["lo_copies"] = {id(packed): lop}
    return d


def time_cold(kern, d, n, k, reps=25):
    nbytes = d["packed"].numel() * (3 if BF16 else 1)
    nbytes = d["packed"].numel() * d["packed"].element_size()
    copies = max(2, (2 * 60 * 2**20) // nbytes + 1)
    bufs = [d["packed"]] + [d["packed"].clone() for _ in range(copies - 1)]
    if BF16:
        for b in bufs[1:]:
            d["lo_copies"][id(b)] = d["lo"].clone()
    y = torch.empty(n, device=dev)
    launches = max(copies, (int(4e-3 / (nbytes / 3e12)) // copies + 1) * copies)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        h = torch.cuda.current_stream().cuda_stream
        for i in range(launches):
            kern.launch(h, d, bufs[i % copies], y, n, k)
    g.replay(); g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / launches)
    ts.sort()
    return ts[len(ts) // 2]


def check(kern, d, n, k):
    y = torch.full((n,), float("nan"), device=dev)
    kern.launch(torch.cuda.current_stream().cuda_stream, d, d["packed"], y, n, k)
    torch.cuda.synchronize()
    return ((y.double() - d["y_ref"]).norm() / d["y_ref"].norm()).item()


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "o_k64": (4096, 64), "o_k1024": (4096, 1024)}
PLAN = {
    "qkv": [(16, 2, 2, 0), (16, 2, 1, 0), (16, 2, 2, 1), (16, 2, 3, 0)],
    "o": [(16, 1, 2, 0), (16, 1, 1, 0), (16, 1, 2, 1), (16, 1, 3, 0)],
    "gate_up": [(14, 7, 2, 0), (14, 7, 1, 0), (14, 7, 2, 1), (14, 7, 3, 0)],
    "down": [(16, 1, 2, 0), (16, 1, 1, 0), (16, 1, 2, 1), (16, 1, 3, 0)],
}
if os.environ.get("FLOORV"):
    base = GEMV
    patches = {
        "table": ("__device__ __forceinline__ void pal4_fill_table(uint4 pal) {", "__device__ __forceinline__ void pal4_fill_table(uint4 pal) { return;"),
        "x": ("    for (int p = threadIdx.x; p < k / 4; p += blockDim.x) {\n        float4 v = __ldcg", "    for (int p = threadIdx.x; p < 0; p += blockDim.x) {\n        float4 v = __ldcg"),
        "esc": ("        for (int r = wi; r < R; r += S) {", "        for (int r = wi; r < 0; r += S) {"),
        "empty": ("    if (smem_addr(pal4_smem) != PAL4_BASE ||", "    if (n >= 0) return;\n    if (smem_addr(pal4_smem) != PAL4_BASE ||"),
    }
    VARS = [((16, 1, 2), ()), ((16, 1, 2), ("esc",)), ((16, 1, 2), ("table", "x", "esc")), ((16, 1, 2), ("empty",)),
            ((4, 1, 2), ("empty",)), ((4, 1, 2), ()), ((8, 1, 2), ()), ((16, 1, 1), ())]
    data = {nm: make_slots(*SHAPES[nm], 2.1, 1, 16) for nm in ["o_k64", "o"]}
    for (W, G, U), ps in VARS:
        g = base
        for pn in ps:
            a, b = patches[pn]
            assert g.count(a) == 1, pn
            g = g.replace(a, b)
        src = (open(f"{K}/common.cuh").read() + "\n#line 1 \"gemv.cu\"\n" + g).encode()
        cubin, info = compile_(cfg_defines(W, G, U, 0), src=src)
        m = vp()
        ck(cuda.cuModuleLoadData(ctypes.byref(m), cubin), "load")
        for nm, d in data.items():
            n, k = SHAPES[nm]
            kern = Kern(m, "gemv_pal4", W, G, U, 0)
            kern.prepare(n, k)
            err = check(kern, d, n, k)
            us = time_cold(kern, d, n, k)
            print(f"{nm:8s} w{W}r{G}u{U} skip={'+'.join(ps) or '-':16s} {us:7.2f} us rel_l2 {err:.1e} regs [{info.get('gemv_pal4', '')[-40:]}]", flush=True)
    sys.exit(0)
if os.environ.get("FLOOR"):
    PLAN = {"o": [(16, 1, 2, 0)], "o_k64": [(16, 1, 2, 0)], "o_k1024": [(16, 1, 2, 0)], "gate_up": [(14, 7, 2, 0)]}
if os.environ.get("PROFILE"):
    PLAN = {"gate_up": [(14, 7, 2, 0)], "o": [(16, 1, 2, 0)], "qkv": [], "down": []}
mods = {}
for name, (n, k) in SHAPES.items():
    if os.environ.get("SHAPES") and name not in os.environ["SHAPES"].split(","):
        continue
    t0 = time.time()
    d16, d8 = make(n, k)
    print(f"== {name} {n}x{k}: entropy {d16['ent']:.3f} bits, escapes 16 slots {100*d16['frac']:.4f} %, 8 slots {100*d8['frac']:.4f} %, made in {time.time()-t0:.1f} s", flush=True)
    for (W, G, U, NST) in PLAN[name]:
        kinds = ["gemv_pal4", "gemv_pal3"] if NST == 0 else ["gemv_pal3"]
        key = (W, G, U, NST)
        if key not in mods:
            try:
                cubin, info = compile_(cfg_defines(*key))
                m = vp()
                ck(cuda.cuModuleLoadData(ctypes.byref(m), cubin), "load")
                mods[key] = (m, info)
            except Exception as e:
                print("compile failed", key, str(e)[-600:], flush=True)
                continue
        m, info = mods[key]
        for kind in kinds:
            kern = Kern(m, kind, W, G, U, NST)
            if not kern.prepare(n, k):
                print(f"{name:8s} {kind} w{W}r{G}u{U}s{NST}: does not fit ({kern.sm} B)")
                continue
            d = d16 if kind == "gemv_pal4" else d8
            try:
                err = check(kern, d, n, k)
                us = 1.0 if os.environ.get("PROFILE") else time_cold(kern, d, n, k)
            except Exception as e:
                print("failed", kind, key, e, flush=True)
                continue
            print(f"{name:8s} {kind:14s} w{W}r{G}u{U}e{NST}  {us:8.2f} us {d['packed'].numel()*d['packed'].element_size()/us/1e6:6.3f} TB/s rel_l2 {err:.2e} "
                  f"grid {kern.grid} per_sm {kern.per} smem {kern.sm} [{info.get(kind, '').strip()}]", flush=True)
    del d16, d8
    torch.cuda.empty_cache()
