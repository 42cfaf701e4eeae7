/* Fused CPU mixed attention for decoding (SPEC §1.4): the new queries of a row attend over
 * the chunks its table references, read packed from the tier pools and dequantized one
 * chunk tile at a time, then over the FP16 tail and the new tokens. No dequantized copy of
 * the cache is built and nothing goes back to Python between tiers.
 *
 * The Python side (hqekv/kernels/mixed_attention_cpu.py) passes contiguous tensors and fills two arrays
 * indexed by the P_* and A_* names it defines (prepended to this file at build time):
 * data pointers and int64 sizes. The (row, KV head) pairs are shared among A_THREADS
 * threads. Semantics are those of the reference (mixed_attention_reference): each cached
 * element dequantized in float32 as code·m0 + m1 (uniform) or centre[code]·m0 + m1
 * (normalized), rounded to the query dtype, then float32 logits, softmax and weighted sum;
 * a query that sees nothing gets zeros.
 * Built with -ffp-contract=off so that a dequantized element is the reference's to the bit.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

/* 16 lanes as one value, kept in a register (GCC/Clang vector extension). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case DT_F16: return (float)((const _Float16 *)p)[i];
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* Round to the query dtype and back (round to nearest even), as the model sees the values. */
static inline float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

static void round_to(float *x, int64_t n, int dtype) {
    if (dtype == DT_BF16)
        for (int64_t i = 0; i < n; i++) x[i] = round_bf16(x[i]);
    else if (dtype == DT_F16)
        for (int64_t i = 0; i < n; i++) x[i] = (float)(_Float16)x[i];
}

/* n elements of a float32/float16/bfloat16 array from offset i, as float32. */
static inline void load_row(const void *p, int dtype, int64_t i, float *restrict out, int64_t n) {
    if (dtype == DT_F16) {
        const _Float16 *src = (const _Float16 *)p + i;
        for (int64_t k = 0; k < n; k++) out[k] = (float)src[k];
    } else if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)p + i;
        for (int64_t k = 0; k < n; k++) out[k] = bf16_to_f32(src[k]);
    } else {
        memcpy(out, (const float *)p + i, sizeof(float) * n);
    }
}

/* y += a·x */
static inline void axpy(float *restrict y, const float *restrict x, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* l_r[t] = Σ_j q_r[j]·kt[j·g + t] for the R query rows (q (R, D), logits rows `stride` apart),
 * t < g. Four rows share each load and give four independent sums, so that the adds overlap. */
static void key_logits(const float *restrict q, int64_t rows, const float *restrict kt, int64_t d, int64_t g,
                       float *restrict l, int64_t stride) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *q0 = q + r * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        for (int64_t t0 = 0; t0 + 16 <= g; t0 += 16) {
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t j = 0; j < d; j++) {
                const v16 k = load16(kt + j * g + t0);
                a0 += q0[j] * k;
                a1 += q1[j] * k;
                a2 += q2[j] * k;
                a3 += q3[j] * k;
            }
            memcpy(l + r * stride + t0, &a0, 64);
            memcpy(l + (r + 1) * stride + t0, &a1, 64);
            memcpy(l + (r + 2) * stride + t0, &a2, 64);
            memcpy(l + (r + 3) * stride + t0, &a3, 64);
        }
    }
    for (; r < rows; r++) {
        const float *qr = q + r * d;
        for (int64_t t0 = 0; t0 + 16 <= g; t0 += 16) {
            v16 a0 = {0}, a1 = {0}; /* even and odd channels: two sums */
            int64_t j = 0;
            for (; j + 2 <= d; j += 2) {
                a0 += qr[j] * load16(kt + j * g + t0);
                a1 += qr[j + 1] * load16(kt + (j + 1) * g + t0);
            }
            for (; j < d; j++) a0 += qr[j] * load16(kt + j * g + t0);
            a0 += a1;
            memcpy(l + r * stride + t0, &a0, 64);
        }
    }
    for (int64_t t = g / 16 * 16; t < g; t++) /* a chunk size that is not a multiple of 16 */
        for (r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < d; j++) acc += q[r * d + j] * kt[j * g + t];
            l[r * stride + t] = acc;
        }
}

/* o[j] += Σ_t p[t]·vt[t·d + j], j < d: four blocks of 16 channels at once, in registers over the tokens. */
static inline void weigh_values(const float *restrict p, const float *restrict vt, int64_t g, int64_t d,
                                float *restrict o) {
    int64_t j0 = 0;
    for (; j0 + 64 <= d; j0 += 64) {
        v16 a0 = load16(o + j0), a1 = load16(o + j0 + 16), a2 = load16(o + j0 + 32), a3 = load16(o + j0 + 48);
        for (int64_t t = 0; t < g; t++) {
            const float pt = p[t];
            const float *v = vt + t * d + j0;
            a0 += pt * load16(v);
            a1 += pt * load16(v + 16);
            a2 += pt * load16(v + 32);
            a3 += pt * load16(v + 48);
        }
        memcpy(o + j0, &a0, 64);
        memcpy(o + j0 + 16, &a1, 64);
        memcpy(o + j0 + 32, &a2, 64);
        memcpy(o + j0 + 48, &a3, 64);
    }
    for (; j0 + 16 <= d; j0 += 16) {
        v16 acc = load16(o + j0);
        for (int64_t t = 0; t < g; t++) acc += p[t] * load16(vt + t * d + j0);
        memcpy(o + j0, &acc, sizeof acc);
    }
    for (int64_t j = j0; j < d; j++) {
        float acc = o[j];
        for (int64_t t = 0; t < g; t++) acc += p[t] * vt[t * d + j];
        o[j] = acc;
    }
}

/* Σ x·y, in 16 interleaved partial sums (so that it vectorizes without reassociating). */
static inline float dot(const float *restrict x, const float *restrict y, int64_t n) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) part[k] += x[i + k] * y[i + k];
    float total = 0.0f;
    for (; i < n; i++) total += x[i] * y[i];
    for (int k = 0; k < 16; k++) total += part[k];
    return total;
}

/* Lanes of a where mask (all ones), else of b. */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    v16i ai, bi, r;
    v16 out;
    memcpy(&ai, &a, 64);
    memcpy(&bi, &b, 64);
    r = (ai & mask) | (bi & ~mask);
    memcpy(&out, &r, 64);
    return out;
}

/* exp(x) on 16 lanes for x <= 0 (a logit minus the row maximum), within 2 ulp (Cephes'
 * polynomial after n = round(x·log2 e), by the 1.5·2^23 shift); -inf -> 0, NaN -> NaN.
 * Written on vectors because libm's expf does not vectorize here. */
static inline v16 exp16(v16 x) {
    const v16 zero = {0};
    const v16i under = x < -87.5f, nan = x != x;
    const v16 xc = select16(under, zero - 87.5f, x);
    const v16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &e, 64);
    return select16(nan, x, select16(under, zero, p * scale));
}

/* Codes of one group: n codes of `bits` bits, LSB first in int32 words -> floats. */
static inline void unpack_bits(const int32_t *restrict words, const int bits, int64_t n, float *restrict out) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t whole = n / per;
    for (int64_t w = 0; w < whole; w++) {
        const uint32_t word = (uint32_t)words[w];
        for (int k = 0; k < per; k++) out[w * per + k] = (float)((word >> (bits * k)) & mask);
    }
    for (int64_t i = whole * per; i < n; i++)
        out[i] = (float)((((uint32_t)words[whole]) >> (bits * (i - whole * per))) & mask);
}

static inline void unpack(const int32_t *words, int bits, int64_t n, float *out) {
    switch (bits) { /* a constant width per case, so that each loop is unrolled and vectorized */
    case 4: unpack_bits(words, 4, n, out); break;
    case 2: unpack_bits(words, 2, n, out); break;
    case 1: unpack_bits(words, 1, n, out); break;
    default: unpack_bits(words, 8, n, out); break;
    }
}

typedef uint32_t v16u __attribute__((vector_size(64)));

/* Codes 16·k .. 16·k + 15 of a row of packed words, as 16 lanes. */
static inline v16u codes16(const int32_t *restrict w, const int bits, int64_t k) {
    const uint32_t mask = (1u << bits) - 1u;
    v16u words, shifts;
    if (bits == 4) { /* two words, 8 codes each */
        const uint32_t a = (uint32_t)w[2 * k], b = (uint32_t)w[2 * k + 1];
        words = (v16u){a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
        shifts = (v16u){0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
    } else if (bits == 2) { /* one word */
        const uint32_t a = (uint32_t)w[k];
        words = (v16u){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
        shifts = (v16u){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    } else if (bits == 1) { /* half a word */
        const uint32_t a = (uint32_t)w[k / 2] >> (16 * (k % 2));
        words = (v16u){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
        shifts = (v16u){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    } else { /* 8 bits: four words */
        const uint32_t a = (uint32_t)w[4 * k], b = (uint32_t)w[4 * k + 1];
        const uint32_t c = (uint32_t)w[4 * k + 2], d = (uint32_t)w[4 * k + 3];
        words = (v16u){a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d};
        shifts = (v16u){0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24};
    }
    return (words >> shifts) & mask;
}

/* `rows` groups of n codes each (n a multiple of 16), row i ->
 * out[i·stride + k] = code·a[i] + b[i] (uniform) or centre[code]·a[i] + b[i] (normalized 1 bit). */
static inline void dequantize_rows_bits(const int32_t *restrict words, const int bits, int normalized, float centre0,
                                        float centre1, int64_t rows, int64_t n, const float *restrict a,
                                        const float *restrict b, float *restrict out, int64_t stride) {
    const int64_t per_row = n * bits / 32;
    v16u c0, c1;
    memcpy(&c0, &(float[16]){centre0, centre0, centre0, centre0, centre0, centre0, centre0, centre0, centre0,
                             centre0, centre0, centre0, centre0, centre0, centre0, centre0}, 64);
    memcpy(&c1, &(float[16]){centre1, centre1, centre1, centre1, centre1, centre1, centre1, centre1, centre1,
                             centre1, centre1, centre1, centre1, centre1, centre1, centre1}, 64);
    for (int64_t i = 0; i < rows; i++) {
        const float ai = a[i], bi = b[i];
        const int32_t *w = words + i * per_row;
        float *o = out + i * stride;
        for (int64_t k = 0; k < n / 16; k++) {
            const v16u code = codes16(w, bits, k);
            v16 x;
            if (normalized) { /* the centre of each code, bit for bit */
                const v16u one = -code; /* all ones where the code is 1 */
                const v16u bitsx = (c1 & one) | (c0 & ~one);
                memcpy(&x, &bitsx, 64);
            } else {
                x = __builtin_convertvector(code, v16);
            }
            x = x * ai + bi;
            memcpy(o + 16 * k, &x, 64);
        }
    }
}

static void dequantize_rows(const int32_t *words, int bits, int normalized, float centre0, float centre1, int64_t rows,
                            int64_t n, const float *a, const float *b, float *out, int64_t stride) {
    switch (bits) { /* a constant width per case */
    case 4: dequantize_rows_bits(words, 4, 0, 0.0f, 0.0f, rows, n, a, b, out, stride); break;
    case 2: dequantize_rows_bits(words, 2, 0, 0.0f, 0.0f, rows, n, a, b, out, stride); break;
    case 1:
        if (normalized) dequantize_rows_bits(words, 1, 1, centre0, centre1, rows, n, a, b, out, stride);
        else dequantize_rows_bits(words, 1, 0, 0.0f, 0.0f, rows, n, a, b, out, stride);
        break;
    default: dequantize_rows_bits(words, 8, normalized, centre0, centre1, rows, n, a, b, out, stride); break;
    }
}

/* One group of n codes -> out[i] = code·a + b (uniform) or centre[code]·a + b (normalized 1 bit). */
static inline void dequantize_group(const int32_t *restrict words, int bits, int normalized, float centre0,
                                    float centre1, int64_t n, float a, float b, float *restrict tmp,
                                    float *restrict out) {
    unpack(words, bits, n, tmp);
    if (normalized)
        for (int64_t i = 0; i < n; i++) out[i] = (tmp[i] == 0.0f ? centre0 : centre1) * a + b;
    else
        for (int64_t i = 0; i < n; i++) out[i] = tmp[i] * a + b;
}

typedef struct {
    const void *fp;          /* (N0, H, G, D) fp_dtype */
    const int32_t *codes[3]; /* per quantized tier */
    const void *m0[3], *m1[3];
    int64_t n[4];            /* slots per tier, fp16 first */
} pools_t;

typedef struct {
    int64_t b, hq, hkv, s, d, g, c, group, ng;
    int fp_dtype, meta_dtype, q_dtype;
    int bits[3], normalized[3];
    float centre0, centre1; /* the 1-bit normalized centres */
} dims_t;

/* One key chunk of head h as a (D, G) tile, transposed: kt[d·G + t]. */
static void key_tile(const dims_t *m, const pools_t *p, int64_t tier, int64_t slot, int64_t h, float *kt, float *tmp) {
    const int64_t g = m->g, d = m->d, hkv = m->hkv;
    if (tier == 0) {
        const int64_t base = (slot * hkv + h) * g * d;
        for (int64_t t = 0; t < g; t++) {
            load_row(p->fp, m->fp_dtype, base + t * d, tmp, d);
            for (int64_t j = 0; j < d; j++) kt[j * g + t] = tmp[j];
        }
    } else {
        const int q = (int)tier - 1, bits = m->bits[q];
        const int64_t words = (g * bits + 31) / 32;
        if (g % 16 == 0 && g % (32 / bits) == 0) { /* whole words, 16 codes at a time: the tile in one pass */
            const int64_t row = (slot * hkv + h) * d;
            float *a = tmp + g, *b = a + d;
            load_row(p->m0[q], m->meta_dtype, row, a, d);
            load_row(p->m1[q], m->meta_dtype, row, b, d);
            dequantize_rows(p->codes[q] + row * words, bits, m->normalized[q], m->centre0, m->centre1, d, g, a, b, kt,
                            g);
        } else {
            for (int64_t j = 0; j < d; j++) {
                const int64_t row = (slot * hkv + h) * d + j;
                dequantize_group(p->codes[q] + row * words, bits, m->normalized[q], m->centre0, m->centre1, g,
                                 load(p->m0[q], m->meta_dtype, row), load(p->m1[q], m->meta_dtype, row), tmp,
                                 kt + j * g);
            }
        }
    }
    round_to(kt, g * d, m->q_dtype);
}

/* One value chunk of head h as a (G, D) tile: vt[t·D + j]. */
static void value_tile(const dims_t *m, const pools_t *p, int64_t tier, int64_t slot, int64_t h, float *vt,
                       float *tmp) {
    const int64_t g = m->g, d = m->d, hkv = m->hkv, group = m->group, ng = m->ng;
    if (tier == 0) {
        load_row(p->fp, m->fp_dtype, (slot * hkv + h) * g * d, vt, g * d);
    } else {
        const int q = (int)tier - 1, bits = m->bits[q];
        const int64_t words = (group * bits + 31) / 32;
        /* groups tile the channels, whole words */
        if (group * ng == d && group % 16 == 0 && group % (32 / bits) == 0) {
            const int64_t row = (slot * hkv + h) * g * ng;
            float *a = tmp + group, *b = a + g * ng;
            load_row(p->m0[q], m->meta_dtype, row, a, g * ng);
            load_row(p->m1[q], m->meta_dtype, row, b, g * ng);
            dequantize_rows(p->codes[q] + row * words, bits, m->normalized[q], m->centre0, m->centre1, g * ng, group, a,
                            b, vt, group);
        } else {
            for (int64_t t = 0; t < g; t++)
                for (int64_t k = 0; k < ng; k++) {
                    const int64_t grp = ((slot * hkv + h) * g + t) * ng + k;
                    const int64_t j0 = k * group, n = j0 + group <= d ? group : d - j0; /* a short last group */
                    dequantize_group(p->codes[q] + grp * words, bits, m->normalized[q], m->centre0, m->centre1, n,
                                     load(p->m0[q], m->meta_dtype, grp), load(p->m1[q], m->meta_dtype, grp), tmp,
                                     vt + t * d + j0);
                }
        }
    }
    round_to(vt, g * d, m->q_dtype);
}

/* Attention of one (row b, KV head h): its R = gq·s query rows over the row's view.
 * q (R, D) scaled float32; logits scratch (R, C·G + G + S); out rows written to `out`. */
static int attend_head(const dims_t *m, const pools_t *kp, const pools_t *vp, const int64_t *k_tier,
                       const int64_t *k_slot, const int64_t *v_tier, const int64_t *v_slot, const float *q,
                       const void *tail_k, const void *tail_v, int64_t tail_len, const float *key,
                       const float *value, const uint8_t *new_valid, int64_t b, int64_t h, float *logits,
                       float *tile, float *tmp, float *acc, float *out) {
    const int64_t g = m->g, d = m->d, s = m->s, c = m->c, gq = m->hq / m->hkv, r_n = gq * s;
    const int64_t width = c * g + g + s;
    if (tail_len < 0 || tail_len > g) return 1;
    /* 1. logits, -inf where a token is not seen */
    for (int64_t r = 0; r < r_n; r++)
        for (int64_t i = 0; i < width; i++) logits[r * width + i] = -INFINITY;
    for (int64_t ci = 0; ci < c; ci++) {
        const int64_t tier = k_tier[ci], slot = k_slot[ci];
        if (tier < 0) continue;
        if (tier > 3 || slot < 0 || slot >= kp->n[tier]) return 1;
        key_tile(m, kp, tier, slot, h, tile, tmp);
        key_logits(q, r_n, tile, d, g, logits + ci * g, width);
    }
    /* the tail, then the new tokens (causal, padding unseen) */
    const int64_t tail_base = (b * m->hkv + h) * g * d;
    for (int64_t t = 0; t < tail_len; t++) {
        load_row(tail_k, m->fp_dtype, tail_base + t * d, tile, d);
        round_to(tile, d, m->q_dtype);
        for (int64_t r = 0; r < r_n; r++) logits[r * width + c * g + t] = dot(q + r * d, tile, d);
    }
    for (int64_t k = 0; k < s; k++) {
        if (!new_valid[b * s + k]) continue;
        const float *kk = key + ((b * m->hkv + h) * s + k) * d;
        for (int64_t r = 0; r < r_n; r++) {
            if (k <= r % s) logits[r * width + c * g + g + k] = dot(q + r * d, kk, d);
        }
    }
    /* 2. softmax per query row (probabilities in place); a row that sees nothing stays -inf */
    for (int64_t r = 0; r < r_n; r++) {
        float *l = logits + r * width;
        float mx = -INFINITY;
        int nan = 0;
        for (int64_t i = 0; i < width; i++) {
            mx = l[i] > mx ? l[i] : mx;
            nan |= l[i] != l[i];
        }
        acc[r] = 0.0f; /* the row's normalizer: 0 when it sees nothing, NaN when a logit is NaN */
        if (nan) {
            acc[r] = NAN;
            for (int64_t i = 0; i < width; i++) l[i] = 0.0f;
            continue;
        }
        if (mx == -INFINITY) continue;
        v16 part = {0};
        float sum = 0.0f;
        int64_t i = 0;
        for (; i + 16 <= width; i += 16) {
            const v16 e = exp16(load16(l + i) - mx);
            memcpy(l + i, &e, 64);
            part += e;
        }
        if (i < width) { /* the last, partial block, padded with unseen (-inf) lanes */
            float last[16];
            for (int k = 0; k < 16; k++) last[k] = i + k < width ? l[i + k] - mx : -INFINITY;
            const v16 e = exp16(load16(last));
            for (int k = 0; i + k < width; k++) {
                l[i + k] = e[k];
                sum += e[k];
            }
        }
        for (int k = 0; k < 16; k++) sum += part[k];
        acc[r] = sum;
    }
    /* 3. weighted values */
    float *o = acc + r_n; /* (R, D) */
    for (int64_t i = 0; i < r_n * d; i++) o[i] = 0.0f;
    for (int64_t ci = 0; ci < c; ci++) {
        const int64_t tier = v_tier[ci], slot = v_slot[ci];
        if (k_tier[ci] < 0 || tier < 0) continue;
        if (tier > 3 || slot < 0 || slot >= vp->n[tier]) return 1;
        value_tile(m, vp, tier, slot, h, tile, tmp);
        for (int64_t r = 0; r < r_n; r++) {
            const float *pr = logits + r * width + ci * g;
            float *orow = o + r * d;
            weigh_values(pr, tile, g, d, orow);
        }
    }
    for (int64_t t = 0; t < tail_len; t++) {
        load_row(tail_v, m->fp_dtype, tail_base + t * d, tile, d);
        round_to(tile, d, m->q_dtype);
        for (int64_t r = 0; r < r_n; r++) axpy(o + r * d, tile, logits[r * width + c * g + t], d);
    }
    for (int64_t k = 0; k < s; k++) {
        const float *vv = value + ((b * m->hkv + h) * s + k) * d;
        for (int64_t r = 0; r < r_n; r++) {
            const float pt = logits[r * width + c * g + g + k];
            if (pt != 0.0f) axpy(o + r * d, vv, pt, d); /* unseen (exp(-inf)): skipped, an unseen NaN stays out */
        }
    }
    /* out (S, Hq, D) of row b: row r = (head in group, token) */
    for (int64_t r = 0; r < r_n; r++) {
        const int64_t head = h * gq + r / s, tok = r % s;
        float *dst = out + ((b * s + tok) * m->hq + head) * d;
        const float inv = acc[r] == 0.0f ? 0.0f : 1.0f / acc[r]; /* NaN stays NaN */
        for (int64_t j = 0; j < d; j++) dst[j] = acc[r] == 0.0f ? 0.0f : o[r * d + j] * inv;
    }
    return 0;
}

#define MAX_THREADS 64

typedef struct {
    const dims_t *m;
    const pools_t *kp, *vp;
    const void *const *ptr;
    float scaling;
    float *out;
    int64_t first, last; /* (row, KV head) items first .. last - 1, item = row·Hkv + head */
    int status;
} job_t;

/* One thread's share of the (row, KV head) items, with its own scratch memory. */
static void *run_job(void *arg) {
    job_t *job = (job_t *)arg;
    const dims_t m = *job->m;
    const void *const *ptr = job->ptr;
    const int64_t gq = m.hq / m.hkv, r_n = gq * m.s, width = m.c * m.g + m.g + m.s;
    const int64_t tile_n = m.g * m.d > m.d ? m.g * m.d : m.d;
    const int64_t meta_n = 2 * (m.d > m.g * m.ng ? m.d : m.g * m.ng);
    const int64_t tmp_n = m.g + m.group + meta_n;
    job->status = 0;
    if (job->first >= job->last) return NULL;
    float *scratch = malloc(sizeof(float) * (r_n * width + tile_n + tmp_n + r_n + r_n * m.d + r_n * m.d));
    if (!scratch) {
        job->status = 2;
        return NULL;
    }
    float *logits = scratch, *tile = logits + r_n * width, *tmp = tile + tile_n, *acc = tmp + tmp_n;
    float *q = acc + r_n + r_n * m.d;
    const float *query = (const float *)ptr[P_QUERY];
    for (int64_t item = job->first; item < job->last && !job->status; item++) {
        const int64_t b = item / m.hkv, h = item % m.hkv;
        for (int64_t r = 0; r < r_n; r++) {
            const int64_t head = h * gq + r / m.s, tok = r % m.s;
            const float *src = query + ((b * m.hq + head) * m.s + tok) * m.d;
            for (int64_t j = 0; j < m.d; j++) q[r * m.d + j] = src[j] * job->scaling;
        }
        const int64_t row = b * m.c;
        job->status = attend_head(&m, job->kp, job->vp, (const int64_t *)ptr[P_K_TIER] + row,
                                  (const int64_t *)ptr[P_K_SLOT] + row, (const int64_t *)ptr[P_V_TIER] + row,
                                  (const int64_t *)ptr[P_V_SLOT] + row, q, ptr[P_TAIL_K], ptr[P_TAIL_V],
                                  ((const int64_t *)ptr[P_TAIL_LEN])[b], (const float *)ptr[P_KEY],
                                  (const float *)ptr[P_VALUE], (const uint8_t *)ptr[P_NEW_VALID], b, h, logits, tile,
                                  tmp, acc, job->out);
    }
    free(scratch);
    return NULL;
}

/* -> 0; 1 when a table entry names a tier or slot that no pool has, or a tail length is
 * outside [0, G]; 2 when scratch memory cannot be had. */
int hqekv_mixed_attention(const void *const *ptr, const int64_t *arg, double scaling_, float *out) {
    dims_t m = {
        .b = arg[A_B], .hq = arg[A_HQ], .hkv = arg[A_HKV], .s = arg[A_S], .d = arg[A_D], .g = arg[A_G],
        .c = arg[A_C], .group = arg[A_GROUP], .ng = (arg[A_D] + arg[A_GROUP] - 1) / arg[A_GROUP],
        .fp_dtype = (int)arg[A_FP_DTYPE], .meta_dtype = (int)arg[A_META_DTYPE], .q_dtype = (int)arg[A_Q_DTYPE],
    };
    const float *centres = (const float *)ptr[P_CENTRES];
    m.centre0 = centres[0];
    m.centre1 = centres[1];
    pools_t kp, vp;
    for (int q = 0; q < 3; q++) {
        m.bits[q] = (int)arg[A_BITS + q];
        m.normalized[q] = (int)arg[A_NORMALIZED + q];
        kp.codes[q] = (const int32_t *)ptr[P_K_POOLS + 1 + 3 * q];
        kp.m0[q] = ptr[P_K_POOLS + 2 + 3 * q];
        kp.m1[q] = ptr[P_K_POOLS + 3 + 3 * q];
        vp.codes[q] = (const int32_t *)ptr[P_V_POOLS + 1 + 3 * q];
        vp.m0[q] = ptr[P_V_POOLS + 2 + 3 * q];
        vp.m1[q] = ptr[P_V_POOLS + 3 + 3 * q];
    }
    kp.fp = ptr[P_K_POOLS];
    vp.fp = ptr[P_V_POOLS];
    for (int t = 0; t < 4; t++) {
        kp.n[t] = arg[A_K_SLOTS + t];
        vp.n[t] = arg[A_V_SLOTS + t];
    }
    job_t jobs[MAX_THREADS];
    const int64_t items = m.b * m.hkv;
    int64_t threads = arg[A_THREADS] < 1 ? 1 : arg[A_THREADS] > MAX_THREADS ? MAX_THREADS : arg[A_THREADS];
    threads = threads > items ? (items > 0 ? items : 1) : threads;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 0; i < threads; i++) {
        jobs[i] = (job_t){.m = &m, .kp = &kp, .vp = &vp, .ptr = ptr, .scaling = (float)scaling_, .out = out,
                          .first = items * i / threads, .last = items * (i + 1) / threads};
        if (i > 0) started[i] = pthread_create(&ids[i], NULL, run_job, &jobs[i]) == 0;
        if (i > 0 && !started[i]) run_job(&jobs[i]); /* no thread to be had: this one does the work */
    }
    run_job(&jobs[0]);
    int status = jobs[0].status;
    for (int64_t i = 1; i < threads; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        status = status ? status : jobs[i].status;
    }
    return status;
}
