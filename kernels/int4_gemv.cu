// One-row int4 GEMV in CUDA C++: out [N] = x [K] . dequantize(w) [N, K]^T, for batch-1 decode (kernels/int4_cuda.py
// compiles it with nvcc and launches it; that file's docstring says why it exists beside the Triton GEMV).
//
// Buffers (the int4 "dequant" packing of workbench/engine/quant/linears.py, unchanged):
//   w  uint8 [N, K/2]: byte j of row n holds k = 2j (high nibble) and k = 2j + 1 (low nibble), read here as 16-byte
//      chunks of 32 weights ([N, K/32] uint4; K % 32 == 0)
//   s, z  [N, K/g] in x's type: the weight is (q - 8) s + z for q in 0..15, g = 2^G_SHIFT >= 32
//   x  [K] (GLU: [2K] = [gate | up]), nw [K] (NORM's RMSNorm weight), res [N] (RESIDUAL), out [N]
//
// Layout of the work: each warp owns ROWS consecutive output rows; lane l takes the chunks c = l, l + 32, ... of each
// of them, UNROLL chunks per row per step, all ROWS x UNROLL 16-byte loads issued before any is used (a warp reads 512
// contiguous bytes of a row per load instruction); PIPE: two steps held in registers, the next one's loads issued
// before this one's math (otherwise other warps and blocks on the SM hide the latency); PIPE 2: as PIPE, with the
// second step's loads issued before x is staged too (with PDL, before the wait); MINB: blocks per SM the
// compiler must fit in registers (__launch_bounds__; 0: none given), which sets how many warps share an SM.
// A block of WARPS warps first stages x in shared memory, once per block: per chunk of 32 x's a power-of-two scale
// 2^-e (e from the chunk's max, so |x 2^-e| < 1), the scaled x's as fp16 pairs in the order the nibbles come out of
// a word, the chunk's sum of x (fp32) and 2^e.
//
// Per 32-bit word (8 weights) the math is two weights per instruction: lop3 ors a nibble pair into the mantissas of
// two fp16 lanes under 1024's exponent (1024 + q, or 1024 + 16 q for the high nibble of a byte), one packed
// subtraction or multiply-add makes them q - 8 exactly, and one packed multiply-add per pair adds (q - 8) x into a
// half2 sum. A chunk's 16 pair products (WORDS_PER_SUM words per fp16 sum) become fp32 and take the group's scale:
//   acc += s 2^e sum (q - 8) x~ + z sum x         (exact algebra: sum ((q - 8) s + z) x)
//
// PDL (Hopper): the first step's weights, scales and zeros are loaded before griddepcontrol.wait (nothing the previous
// kernel writes), x after it; griddepcontrol.launch_dependents once every weight load of this block is issued.
// With a grid smaller than the row groups (int4_cuda.py's PERSIST) each block loops over groups, staging x once.
// F_GLU_OUT (a SwiGLU MLP's gate/up projection, [gate | up] rows): each warp takes ROWS / 2 gate rows and the same up
// rows, and writes silu(gate) * up [N / 2], so the down projection reads h with no SwiGLU prologue.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef ROWS
#define ROWS 4
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef WORDS_PER_SUM
#define WORDS_PER_SUM 4
#endif
#ifndef X_BF16
#define X_BF16 1
#endif
#ifndef PIPE
#define PIPE 0
#endif
#ifndef MINB
#define MINB 0
#endif
#ifndef PERSIST
#define PERSIST 0
#endif
#if MINB > 0
#define BOUNDS __launch_bounds__(WARPS * 32, MINB)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)  // a second argument of 1 is not neutral: ptxas then takes up to 255
#endif

#if X_BF16
typedef __nv_bfloat16 xt;
__device__ __forceinline__ float bits_f32(uint32_t b) { return __uint_as_float(b << 16); }  // 16 bits of a bf16
__device__ __forceinline__ float to_f32(xt v) { return __bfloat162float(v); }
__device__ __forceinline__ xt from_f32(float v) { return __float2bfloat16_rn(v); }
#else
typedef __half xt;
__device__ __forceinline__ float bits_f32(uint32_t b) { return __half2float(__ushort_as_half((unsigned short)b)); }
__device__ __forceinline__ float to_f32(xt v) { return __half2float(v); }
__device__ __forceinline__ xt from_f32(float v) { return __float2half_rn(v); }
#endif

// flags
#define F_GLU 1
#define F_NORM 2
#define F_RESIDUAL 4
#define F_GLU_OUT 8  // SwiGLU in the epilogue: out [N/2] = silu(gate) * up, rows [0, N/2) gate, [N/2, N) up (ROWS even)
#define F_NORM_UNIT 16  // with F_NORM: the norm's weight is all ones (folded into this weight), so nw is never read

// element i (0..7) of 8 16-bit values in a uint4, as fp32 (no address taken: the uint4 stays in registers)
__device__ __forceinline__ float elem(uint4 v, int i) {
    const uint32_t word = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
    return bits_f32(i & 1 ? word >> 16 : word & 0xFFFFu);
}

__device__ __forceinline__ uint32_t lop3_or_mask(uint32_t a, uint32_t mask, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));  // (a & mask) | magic
    return r;
}

__device__ __forceinline__ __half2 as_h2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {  // weights are read once per call: keep them out of L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// sum over the word's 8 weights of (q - 8) x~ into the half2 `h`; xp: the word's 4 x pairs (k1, k5), (k0, k4),
// (k3, k7), (k2, k6), low lane first
__device__ __forceinline__ __half2 word_dot(uint32_t wd, uint4 xp, __half2 h) {
    const uint32_t lo = 0x000F000F, hi = 0x00F000F0, magic = 0x64006400;
    const __half2 c1032 = as_h2(0x64086408u);  // 1024 + 8
    const __half2 c16th = as_h2(0x2C002C00u);  // 1 / 16
    const __half2 cm72 = as_h2(0xD480D480u);   // -(64 + 8)
    uint32_t sh = wd >> 8;
    __half2 a = __hsub2(as_h2(lop3_or_mask(wd, lo, magic)), c1032);         // k1, k5
    __half2 b = __hfma2(as_h2(lop3_or_mask(wd, hi, magic)), c16th, cm72);   // k0, k4
    __half2 c = __hsub2(as_h2(lop3_or_mask(sh, lo, magic)), c1032);         // k3, k7
    __half2 d = __hfma2(as_h2(lop3_or_mask(sh, hi, magic)), c16th, cm72);   // k2, k6
    h = __hfma2(a, as_h2(xp.x), h);
    h = __hfma2(b, as_h2(xp.y), h);
    h = __hfma2(c, as_h2(xp.z), h);
    h = __hfma2(d, as_h2(xp.w), h);
    return h;
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

struct Step {  // one step's loads: UNROLL 16-byte chunks of each of ROWS rows, with their groups' scale and zero
    uint4 w[ROWS][UNROLL];
    xt s[ROWS][UNROLL], z[ROWS][UNROLL];
};

// rows: row0 + r, or with F_GLU_OUT the upper half of a warp's rows shifted by hi_off (their up rows) and each row
// checked against its own limit (lo_lim: N, or N / 2 for the gate rows)
__device__ __forceinline__ void load_step(Step& st, const uint4* __restrict__ w, const xt* __restrict__ s,
                                          const xt* __restrict__ z, int base, int nch, int row0, int N, int groups,
                                          int cshift, int lane, int hi_off, int lo_lim) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = base + u * 32 + lane, n = row0 + r + (r >= ROWS / 2 ? hi_off : 0);
            if (c < nch && n < (r >= ROWS / 2 ? N : lo_lim)) {
                st.w[r][u] = ldg_stream(w + (size_t)n * nch + c);
                st.s[r][u] = s[(size_t)n * groups + (c >> cshift)];
                st.z[r][u] = z[(size_t)n * groups + (c >> cshift)];
            }
        }
    }
}

__device__ __forceinline__ void compute_step(const Step& st, float (&acc)[ROWS], const uint4* xp, const float2* xsum,
                                             int base, int nch, int lane, bool last_group) {
    if (last_group && base + 32 * UNROLL >= nch) grid_launch_dependents();  // every weight load of the block issued
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int c = base + u * 32 + lane;
        if (c < nch) {
            const uint4 x0 = xp[c], x1 = xp[nch + c], x2 = xp[2 * nch + c], x3 = xp[3 * nch + c];
            const float2 xs = xsum[c];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const uint4 wq = st.w[r][u];
                const __half2 zero2 = __float2half2_rn(0.f);
                float dot;
#if WORDS_PER_SUM == 4
                __half2 h = word_dot(wq.x, x0, zero2);
                h = word_dot(wq.y, x1, h);
                h = word_dot(wq.z, x2, h);
                h = word_dot(wq.w, x3, h);
                dot = __low2float(h) + __high2float(h);
#elif WORDS_PER_SUM == 2
                __half2 h = word_dot(wq.y, x1, word_dot(wq.x, x0, zero2));
                __half2 k = word_dot(wq.w, x3, word_dot(wq.z, x2, zero2));
                dot = (__low2float(h) + __high2float(h)) + (__low2float(k) + __high2float(k));
#else
                __half2 h0 = word_dot(wq.x, x0, zero2), h1 = word_dot(wq.y, x1, zero2);
                __half2 h2 = word_dot(wq.z, x2, zero2), h3 = word_dot(wq.w, x3, zero2);
                dot = ((__low2float(h0) + __high2float(h0)) + (__low2float(h1) + __high2float(h1))) +
                      ((__low2float(h2) + __high2float(h2)) + (__low2float(h3) + __high2float(h3)));
#endif
                acc[r] = fmaf(to_f32(st.s[r][u]) * xs.y, dot, fmaf(to_f32(st.z[r][u]), xs.x, acc[r]));
            }
        }
    }
}

extern "C" __global__ void BOUNDS
int4_gemv(const uint4* __restrict__ w, const xt* __restrict__ x, const xt* __restrict__ s,
          const xt* __restrict__ z, const xt* __restrict__ nw, const xt* __restrict__ res, xt* __restrict__ out,
          int N, int K, int G_SHIFT, int flags, float eps) {
    extern __shared__ uint4 smem[];
    const int nch = K >> 5;                       // chunks of 32 weights per row
    uint4* xp = smem;                             // [4][nch]: word j of chunk c at j * nch + c (conflict-free)
    float2* xsum = reinterpret_cast<float2*>(smem + 4 * nch);  // [nch]: (sum x, 2^e)
    __shared__ float red[WARPS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // F_GLU_OUT: a warp's ROWS / 2 gate rows and the same up rows (N / 2 further on); output row = gate row
    const bool glu_out = flags & F_GLU_OUT;
    const int rpw = glu_out ? ROWS / 2 : ROWS;   // output rows per warp
    const int half = N >> 1;
    const int hi_off = glu_out ? half - ROWS / 2 : 0, lo_lim = glu_out ? half : N;
    int row0 = (blockIdx.x * WARPS + warp) * rpw;
#if PERSIST
    const int ngroups = ((glu_out ? half : N) + WARPS * rpw - 1) / (WARPS * rpw);  // row groups of WARPS x rpw rows
#endif
    const int groups = K >> G_SHIFT;
    const int cshift = G_SHIFT - 5;               // chunk -> group

    Step cur, nxt;
    // before the wait: weights never depend on the previous kernel
    load_step(cur, w, s, z, 0, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
#if PIPE == 2
    // both steps the pipeline holds are in flight while x is staged (a K of two steps: the block's every weight)
    if (32 * UNROLL < nch)
        load_step(nxt, w, s, z, 32 * UNROLL, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
#endif
    grid_wait();

    // stage x: one chunk of 32 per thread per pass, every global load of a chunk issued before any is used
    float sq = 0.f;
    for (int c = threadIdx.x; c < nch; c += WARPS * 32) {
        float v[32];
        uint4 xr[4], yr[4];
        const uint4* xc = reinterpret_cast<const uint4*>(x) + c * 4;
        const uint4* yc = reinterpret_cast<const uint4*>(flags & F_GLU ? x + K : nw) + c * 4;  // up, or norm weight
#pragma unroll
        for (int q = 0; q < 4; ++q) xr[q] = xc[q];
        if ((flags & F_GLU) || (flags & (F_NORM | F_NORM_UNIT)) == F_NORM) {
#pragma unroll
            for (int q = 0; q < 4; ++q) yr[q] = yc[q];
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[q * 8 + i] = elem(xr[q], i);
        }
        if (flags & F_GLU) {  // x = silu(gate) * up, rounded once to x's type
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float g = v[q * 8 + i];
                    v[q * 8 + i] = to_f32(from_f32(__fdividef(g, 1.f + __expf(-g)) * elem(yr[q], i)));
                }
            }
        }
        if (flags & F_NORM_UNIT) {  // x * 1 is x: only the sum of squares
#pragma unroll
            for (int i = 0; i < 32; ++i) sq += v[i] * v[i];
        } else if (flags & F_NORM) {  // x * norm weight, rounded to x's type; 1 / rms applied to the sum at the end
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float a = v[q * 8 + i];
                    sq += a * a;
                    v[q * 8 + i] = to_f32(from_f32(a * elem(yr[q], i)));
                }
            }
        }
        float amax = 0.f, sum = 0.f;
#pragma unroll
        for (int i = 0; i < 32; ++i) { amax = fmaxf(amax, fabsf(v[i])); sum += v[i]; }
        // amax = m 2^e with m in [0.5, 1) (frexp's e, from the bits; 0 for amax 0): |x 2^-e| < 1
        const int e = amax > 0.f ? min(((__float_as_int(amax) >> 23) & 255) - 126, 126) : 0;
        const float inv = __int_as_float((127 - e) << 23);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float* f = v + 8 * j;
            xp[j * nch + c] = make_uint4(pack_h2(f[1] * inv, f[5] * inv), pack_h2(f[0] * inv, f[4] * inv),
                                         pack_h2(f[3] * inv, f[7] * inv), pack_h2(f[2] * inv, f[6] * inv));
        }
        xsum[c] = make_float2(sum, __int_as_float((127 + e) << 23));
    }
    float rstd = 1.f;
    if (flags & F_NORM) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        if (lane == 0) red[warp] = sq;
    }
    __syncthreads();
    if (flags & F_NORM) {
        float t = 0.f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) t += red[i];
        rstd = rsqrtf(t / K + eps);
    }

    // PERSIST: row groups blockIdx.x, + gridDim.x, ... (the host launches PERSIST blocks per SM, each staging x once
    // for all its groups); otherwise one group per block, as many blocks as groups
#if PERSIST
    for (int rg = blockIdx.x; rg < ngroups; rg += gridDim.x) {
    const bool last_group = rg + gridDim.x >= ngroups;
    if (rg != (int)blockIdx.x) {
        row0 = (rg * WARPS + warp) * rpw;
        load_step(cur, w, s, z, 0, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
#if PIPE == 2
        if (32 * UNROLL < nch)
            load_step(nxt, w, s, z, 32 * UNROLL, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
#endif
    }
#else
    {  // one row group per block
    const bool last_group = true;
#endif
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    const int step = 32 * UNROLL;
#if PIPE
    // two steps in registers: the next step's loads are in flight while this one computes
    for (int base = 0; base < nch; base += 2 * step) {
        if (base + step < nch && (PIPE != 2 || base > 0))  // PIPE 2: the first nxt was loaded before the wait
            load_step(nxt, w, s, z, base + step, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
        compute_step(cur, acc, xp, xsum, base, nch, lane, last_group);
        if (base + step >= nch) break;
        if (base + 2 * step < nch)
            load_step(cur, w, s, z, base + 2 * step, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
        compute_step(nxt, acc, xp, xsum, base + step, nch, lane, last_group);
    }
#else
    for (int base = 0; base < nch; base += step) {
        if (base > 0)
            load_step(cur, w, s, z, base, nch, row0, N, groups, cshift, lane, hi_off, lo_lim);
        compute_step(cur, acc, xp, xsum, base, nch, lane, last_group);
    }
#endif
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
    if (glu_out) {  // gate and up rounded to x's type as the unfused outputs would be, then the SwiGLU prologue's math
#pragma unroll
        for (int r = 0; r < ROWS / 2; ++r) {
            const int n = row0 + r;
            if (lane == 0 && n < half) {
                const float g = to_f32(from_f32(acc[r] * rstd)), u = to_f32(from_f32(acc[r + ROWS / 2] * rstd));
                out[n] = from_f32(__fdividef(g, 1.f + __expf(-g)) * u);
            }
        }
    } else {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int n = row0 + r;
            if (lane == 0 && n < N) {
                float a = acc[r] * rstd;
                if (flags & F_RESIDUAL) a += to_f32(res[n]);
                out[n] = from_f32(a);
            }
        }
    }
    }
}
