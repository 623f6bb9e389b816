// Rotary position embedding, in place on q [n_tokens, n_q_heads, HD] and k [n_tokens, n_kv_heads, HD].
// inv_freq [HD / 2] (radians per position, frequency scaling already applied by the host) and the
// angle are f64: at position 1e5 an f32 angle would be off by ~1e-2 rad.
// interleaved = 0: HF/NEOX pairs (i, i + HD/2); interleaved = 1: GGUF pairs (2i, 2i + 1).
extern "C" __global__ void rope(float* __restrict__ q, float* __restrict__ k,
                                const int* __restrict__ positions, const double* __restrict__ inv_freq,
                                int n_q_heads, int n_kv_heads, int head_dim, int interleaved) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const double pos = (double)positions[t];
    const int pairs = (n_q_heads + n_kv_heads) * half;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
        const int head = j / half, i = j - head * half;
        float* base = head < n_q_heads
            ? q + ((size_t)t * n_q_heads + head) * head_dim
            : k + ((size_t)t * n_kv_heads + (head - n_q_heads)) * head_dim;
        const int a = interleaved ? 2 * i : i;
        const int b = interleaved ? 2 * i + 1 : i + half;
        double s, c;
        sincos(pos * inv_freq[i], &s, &c);
        const float x0 = base[a], x1 = base[b];
        base[a] = (float)(x0 * c - x1 * s);
        base[b] = (float)(x1 * c + x0 * s);
    }
}
