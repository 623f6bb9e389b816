// Shared helpers, prepended to every kernel source by the Rust side (jit.rs).
// No toolkit headers: bf16 values travel as u16 bit patterns so the bare libnvrtc from PyPI compiles
// every kernel.
typedef unsigned short bf16_t;
typedef unsigned int u32;

#define F32_INF __int_as_float(0x7f800000)
#define F32_NAN __int_as_float(0x7fffffff)
#define LOG2E_F 1.4426950408889634f

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((u32)h) << 16); }
// Low / high bf16 of a packed pair (element 2i sits in the low half: little-endian).
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Round to nearest even; NaN stays a (quiet) NaN. Matches `half::bf16::from_f32`.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; `scratch` holds 32 floats. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// 16-byte load of data read once (weights): bypass L1 so it does not evict reused data.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Programmatic dependent launch (sm_90+). The decode graph's kernel-to-kernel edges are
// programmatic (engine.rs), so a kernel may start while its predecessor still runs: it must call
// pdl_wait() before touching anything an earlier kernel of the step writes or reads (read before
// it: the weights, and what only earlier steps wrote — a step's graph launch starts after the
// previous one has ended: the cached K/V rows but the newest, the position and length, which only
// finish_step advances), and calls pdl_trigger() after it so its own successor can start
// (after the wait, so at most one kernel ahead is resident and waiting; short kernels followed by
// a long prologue — RoPE before the attention, the attention's combine — trigger first). Data an earlier kernel
// wrote is never read with ld.global.nc (__ldg, or what the compiler makes of a const __restrict__
// load): nc loads assume the data read-only for the kernel's lifetime, which PDL breaks (the
// writer may still run when this kernel starts). Such reads use __ldcg (L2; also where a line may
// sit in this SM's L1 from a kernel still running when this one launched: the residual after an
// accumulating GEMV) or __ldca (the GEMVs' input vectors, reused from L1). Both are no-ops when the launch has no programmatic dependency
// (prefill, selftests) and below sm_90.
#ifdef ENTROLLM_TRACE
// Diagnostic builds (ENTROLLM_TRACE set: device.rs): thread 0 of every block records when it
// reached pdl_wait and when the wait returned (%globaltimer, ns), with its SM and launch shape, so
// that a decode step's timeline — which kernel waits on which, and for how long — can be read off
// one replay of the graph. trace_buf[0] counts the records; record i is trace_buf[4 + 4i ..].
__device__ unsigned long long* trace_buf;
__device__ unsigned long long trace_cap;
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#endif
__device__ __forceinline__ void pdl_wait() {
#ifdef ENTROLLM_TRACE
    const unsigned long long t0 = global_ns();
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef ENTROLLM_TRACE
    if (threadIdx.x == 0 && threadIdx.y == 0 && trace_buf) {
        const unsigned long long t1 = global_ns();
        const unsigned long long i = atomicAdd(trace_buf, 1ull);
        if (i < trace_cap) {
            u32 smid;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
            unsigned long long* r = trace_buf + 4 + 4 * i;
            r[0] = t0;
            r[1] = t1;
            r[2] = (unsigned long long)smid | (unsigned long long)blockIdx.x << 16 | (unsigned long long)blockIdx.y << 40;
            r[3] = (unsigned long long)gridDim.x | (unsigned long long)gridDim.y << 24 | (unsigned long long)blockDim.x << 48;
        }
    }
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
