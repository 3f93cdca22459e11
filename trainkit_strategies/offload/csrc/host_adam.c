/* ZeRO-Offload's host step: Adam/AdamW over a run of flat fp32 master weights and moments, reading gradients in
 * their own dtype (fp32, bf16 or fp16) and writing the updated weights in the compute dtype, in one pass.
 *
 * Per element it reads the gradient, the master weight and both moments and writes the master, the moments and
 * the compute-dtype copy: 2 + 12 bytes in and 12 + 2 out under bf16, what torch's fused fp32 AdamW moves with its
 * gradient already in fp32. The run is cut into one contiguous tile per thread (as DeepSpeed's CPU Adam does), so
 * each core streams its own part of every array. The gradient may be the output (the compute-dtype copy written
 * over the gradient it came from, element by element): nothing here assumes the two do not alias.
 *
 * Arithmetic follows torch's fused CPU Adam (aten/src/ATen/native/cpu/FusedAdamKernel.cpp): the same update,
 * in fp32, with bias corrections computed in double; multiplications by a reciprocal replace two divisions by
 * a scalar and multiply-adds are fused, so results agree with torch's to rounding, not bit for bit. Every path
 * here computes the same expression, so a run gives the same bits however it is cut into calls and tiles.
 * Conversions round to nearest even, as torch's do, so the compute-dtype copy equals master.to(dtype).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { TK_F32 = 0, TK_BF16 = 1, TK_F16 = 2, TK_NONE = -1 };
enum { TK_DECOUPLED = 1, TK_AMSGRAD = 2, TK_MAXIMIZE = 4 };

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN, as c10::BFloat16 writes it */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half <-> float without hardware support (F. Giesen's branch-light conversions), rounding to nearest even. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == 0x0f800000u) {
        o += (uint32_t)(128 - 16) << 23;                      /* inf, NaN */
    } else if (exp == 0) {
        o = f32_bits(bits_f32(o + (1u << 23)) - bits_f32(113u << 23));  /* zero, subnormal */
    }
    return bits_f32(o | ((uint32_t)(h & 0x8000u) << 16));
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint32_t o;
    if (u >= (uint32_t)(127 + 16) << 23) {
        o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;               /* NaN, or inf and overflow */
    } else if (u < (uint32_t)113 << 23) {
        o = f32_bits(bits_f32(u) + 0.5f) - f32_bits(0.5f);    /* subnormal or zero: the FPU rounds */
    } else {
        o = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
    }
    return (uint16_t)(o | sign);
}

static inline float load(const void* p, int64_t i, int dtype) {
    if (dtype == TK_BF16) return bf16_to_f32(((const uint16_t*)p)[i]);
    if (dtype == TK_F16) return f16_to_f32(((const uint16_t*)p)[i]);
    return ((const float*)p)[i];
}

static inline void store(void* p, int64_t i, float v, int dtype) {
    if (dtype == TK_BF16) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else if (dtype == TK_F16) ((uint16_t*)p)[i] = f32_to_f16(v);
    else if (dtype == TK_F32) ((float*)p)[i] = v;
}

typedef struct {
    float lr_decay, l2, omb1, b2, omb2, inv_bc2_sqrt, eps, step_size, mult;
} hyper_t;

/* Multiply-adds are written out (the build turns off the compiler's own contraction), so that every path computes
 * the same expression and gives the same bits: with FMA hardware as fused operations, without it as two. */
#ifdef __FMA__
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

static inline __attribute__((always_inline)) void tile(
    float* param, const void* grad, float* avg, float* avg_sq, float* max_sq, void* out,
    int64_t lo, int64_t hi, const hyper_t* h, int grad_dtype, int out_dtype, int amsgrad) {
    const hyper_t k = *h;
#pragma GCC ivdep
    for (int64_t i = lo; i < hi; i++) {
        float g = load(grad, i, grad_dtype) * k.mult;  /* mult < 0 under maximize */
        float p = param[i];
        if (k.l2 != 0.0f) g = FMA(k.l2, p, g);          /* Adam's L2 term (none under AdamW, or without decay) */
        p *= k.lr_decay;                                /* AdamW's decoupled decay; one under Adam */
        float m = FMA(g - avg[i], k.omb1, avg[i]);      /* lerp(m, g, 1 - beta1) */
        float v = FMA(g * g, k.omb2, avg_sq[i] * k.b2);
        avg[i] = m;
        avg_sq[i] = v;
        if (amsgrad) {  /* a constant in each copy of the loop: no masked access to an absent array */
            v = v > max_sq[i] ? v : max_sq[i];
            max_sq[i] = v;
        }
        p = FMA(-k.step_size, m / FMA(sqrtf(v), k.inv_bc2_sqrt, k.eps), p);
        param[i] = p;
        store(out, i, p, out_dtype);
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* bf16 of 16 floats, rounding to nearest even (NaN to 0x7fc0, as the scalar conversion) */
static inline __m256i bf16x16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
}

/* The loop above for a bf16 or fp32 gradient and a separate, 32-byte aligned bf16 output (the working parameters of
 * a CPU device), with the output written by streaming stores: they skip reading the output's lines before writing
 * them, which a pass bound by memory pays for (30 bytes an element instead of 28). Returns where it stopped. */
static int64_t tile_stream_bf16(float* param, const void* grad, int grad_dtype, float* avg, float* avg_sq,
                                uint16_t* out, int64_t lo, int64_t hi, const hyper_t* k) {
    const __m512 mult = _mm512_set1_ps(k->mult), l2 = _mm512_set1_ps(k->l2), decay = _mm512_set1_ps(k->lr_decay),
                 omb1 = _mm512_set1_ps(k->omb1), b2 = _mm512_set1_ps(k->b2), omb2 = _mm512_set1_ps(k->omb2),
                 inv = _mm512_set1_ps(k->inv_bc2_sqrt), eps = _mm512_set1_ps(k->eps),
                 step = _mm512_set1_ps(-k->step_size);
    const int with_l2 = k->l2 != 0.0f;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 g = grad_dtype == TK_BF16
            ? _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)grad + i))), 16))
            : _mm512_loadu_ps((const float*)grad + i);
        g = _mm512_mul_ps(g, mult);
        __m512 p = _mm512_loadu_ps(param + i);
        if (with_l2) g = _mm512_fmadd_ps(l2, p, g);
        p = _mm512_mul_ps(p, decay);
        __m512 m = _mm512_loadu_ps(avg + i);
        m = _mm512_fmadd_ps(_mm512_sub_ps(g, m), omb1, m);
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(g, g), omb2, _mm512_mul_ps(_mm512_loadu_ps(avg_sq + i), b2));
        _mm512_storeu_ps(avg + i, m);
        _mm512_storeu_ps(avg_sq + i, v);
        p = _mm512_fmadd_ps(step, _mm512_div_ps(m, _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv, eps)), p);
        _mm512_storeu_ps(param + i, p);
        _mm256_stream_si256((__m256i*)(out + i), bf16x16(p));
    }
    _mm_sfence();  /* streaming stores are weakly ordered: done before the call returns */
    return i;
}
#endif

#define TK_TILE(G, O)                                                               \
    if (amsgrad) tile(param, grad, avg, avg_sq, max_sq, out, lo, hi, h, G, O, 1);   \
    else tile(param, grad, avg, avg_sq, max_sq, out, lo, hi, h, G, O, 0)
#define TK_OUTS(G)                      \
    switch (out_dtype) {                \
        case TK_F32: TK_TILE(G, TK_F32); break;  \
        case TK_BF16: TK_TILE(G, TK_BF16); break; \
        case TK_F16: TK_TILE(G, TK_F16); break;  \
        default: TK_TILE(G, TK_NONE); break;     \
    }

static void run_tile(float* param, const void* grad, float* avg, float* avg_sq, float* max_sq, void* out,
                     int64_t lo, int64_t hi, const hyper_t* h, int grad_dtype, int out_dtype, int amsgrad) {
#ifdef __AVX512F__
    if (out_dtype == TK_BF16 && grad_dtype != TK_F16 && !amsgrad && out != grad &&
        ((uintptr_t)((uint16_t*)out + lo) & 31) == 0)
        lo = tile_stream_bf16(param, grad, grad_dtype, avg, avg_sq, (uint16_t*)out, lo, hi, h);
    if (lo >= hi) return;
#endif
    switch (grad_dtype) {
        case TK_BF16: TK_OUTS(TK_BF16); break;
        case TK_F16: TK_OUTS(TK_F16); break;
        default: TK_OUTS(TK_F32); break;
    }
}

/* One Adam(W) step of n elements. hyper: lr, beta1, beta2, eps, weight_decay, step (already counted), gradient
 * multiplier; flags: TK_DECOUPLED | TK_AMSGRAD | TK_MAXIMIZE. Returns 0, or -1 for a dtype it does not know. */
int tk_adam_step(float* param, const void* grad, int grad_dtype, float* avg, float* avg_sq, float* max_sq,
                 void* out, int out_dtype, int64_t n, const double* hyper, int flags, int threads) {
    if (grad_dtype < TK_F32 || grad_dtype > TK_F16 || out_dtype < TK_NONE || out_dtype > TK_F16) return -1;
    const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], step = hyper[5];
    const double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
    const int decoupled = (flags & TK_DECOUPLED) != 0, amsgrad = (flags & TK_AMSGRAD) != 0;
    hyper_t h;
    h.lr_decay = decoupled ? (float)(1.0 - lr * hyper[4]) : 1.0f;
    h.l2 = decoupled ? 0.0f : (float)hyper[4];
    h.omb1 = (float)(1.0 - beta1);
    h.b2 = (float)beta2;
    h.omb2 = (float)(1.0 - beta2);
    h.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
    h.eps = (float)hyper[3];
    h.step_size = (float)(lr / bc1);
    h.mult = (float)((flags & TK_MAXIMIZE) ? -hyper[6] : hyper[6]);
    if (threads < 1) threads = 1;
    if (n < (int64_t)threads * 4096) threads = 1;  /* a tiny run is not worth waking the team */
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
#else
    {
        const int64_t t = 0, team = 1;
#endif
        const int64_t per = ((n + team - 1) / team + 15) / 16 * 16;  /* 64-byte aligned tiles of fp32 */
        const int64_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        if (lo < hi) run_tile(param, grad, avg, avg_sq, max_sq, out, lo, hi, &h, grad_dtype, out_dtype, amsgrad);
    }
    return 0;
}

int tk_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
