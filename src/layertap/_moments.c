/* layertap._moments: the statistics of a float map in one read from memory (layertap.stats).

   For each channel c of an [outer, C, inner] map ([N, C, H, W] with inner = H * W; tokens or
   features [..., C] with inner = 1): the mean and the centred sum of squared deviations M2, the
   min, the max and the count of non-zero values, in float64. The values are taken in blocks that
   fit the L1 cache; a block is read from memory once (sum, min, max, zeros), then again from the
   cache for its centred M2, and the blocks are merged with Chan's update: as exact as numpy's
   two-pass float64 sums, at the cost of a single read. (float32 maps on x86 vector units sum the
   squares of centred values in float32 lanes, a few at a time: see _moments_f32.h.)

   Python checks every argument (a contiguous CPU tensor of that dtype and shape, which it keeps
   alive during the call); the pointers are trusted here. The channels are split in contiguous
   ranges among `threads` OpenMP threads, with the GIL released. Built with -fopenmp against
   libgomp.so.1, it shares the OpenMP runtime PyTorch has already loaded (the same soname), so its
   threads are PyTorch's own, still spinning after the layer's op: no new thread, and none to
   fight over the cores with (a thread of our own measured slower than one on 2 cores).
   A mean or M2 that is not finite (NaN or Inf among the values, or squares beyond the sums'
   dtype) is reported: the caller then takes its masked path, as min and max are meaningless. */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

/* one body per instruction set, chosen at load time (GCC on x86-64 Linux) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DISPATCH
#endif

#define BLOCK 4096 /* values per block: 16 KiB of float32 */
#define MAX_THREADS 256

/* out[0..4]: mean, M2, min, max, non-zeros */
static void chan(double *out, double n, double count, double bmean, double bm2) {
    double total = n + count, delta = bmean - out[0];
    out[0] += delta * count / total;
    out[1] += bm2 + delta * delta * n * count / total;
}

/* merges a row of `length` values into `out`, which holds `seen` values so far */
#define DEFINE_ROW(NAME, T)                                                                        \
    DISPATCH static void NAME(const T *x, int64_t length, int64_t seen, double *out) {            \
        T lo = x[0], hi = x[0];                                                                   \
        int64_t nonzero = 0;                                                                      \
        for (int64_t start = 0; start < length; start += BLOCK) {                                 \
            const T *b = x + start;                                                               \
            int64_t m = length - start < BLOCK ? length - start : BLOCK, z = 0;                   \
            double s = 0, q = 0;                                                                  \
            T l = b[0], h = b[0];                                                                 \
            _Pragma("omp simd reduction(+ : s, z) reduction(min : l) reduction(max : h)")        \
            for (int64_t i = 0; i < m; i++) {                                                     \
                T v = b[i];                                                                       \
                s += (double)v;                                                                   \
                z += v != 0;                                                                      \
                l = v < l ? v : l;                                                                \
                h = v > h ? v : h;                                                                \
            }                                                                                     \
            double mean = s / (double)m;                                                          \
            _Pragma("omp simd reduction(+ : q)")                                                  \
            for (int64_t i = 0; i < m; i++) {                                                     \
                double d = (double)b[i] - mean;                                                   \
                q += d * d;                                                                       \
            }                                                                                     \
            chan(out, (double)(seen + start), (double)m, mean, q);                                \
            nonzero += z;                                                                         \
            lo = l < lo ? l : lo;                                                                 \
            hi = h > hi ? h : hi;                                                                 \
        }                                                                                         \
        out[2] = seen && out[2] < lo ? out[2] : (double)lo;                                       \
        out[3] = seen && out[3] > hi ? out[3] : (double)hi;                                       \
        out[4] += (double)nonzero;                                                                \
    }

/* columns [first, last) of a [rows, width] map, in blocks of at least 16 rows (per-column
   merges cost a few operations each); `acc` holds 5 scratch doubles per column */
#define DEFINE_COLUMNS(NAME, T)                                                                    \
    DISPATCH static void NAME(const T *x, int64_t rows, int64_t width, int64_t first, int64_t last, \
                              double *out, double *acc) {                                         \
        int64_t cols = last - first, step = 4 * BLOCK / width > 16 ? 4 * BLOCK / width : 16;                  \
        double *s = acc, *q = acc + cols, *l = acc + 2 * cols, *h = acc + 3 * cols, *z = acc + 4 * cols; \
        for (int64_t c = 0; c < cols; c++) {                                                      \
            double *o = out + 5 * (first + c);                                                    \
            o[0] = o[1] = o[4] = 0;                                                               \
            o[2] = o[3] = (double)x[first + c];                                                   \
        }                                                                                         \
        for (int64_t start = 0; start < rows; start += step) {                                    \
            int64_t m = rows - start < step ? rows - start : step;                                \
            const T *b = x + start * width + first;                                               \
            for (int64_t c = 0; c < cols; c++) {                                                  \
                s[c] = q[c] = z[c] = 0;                                                           \
                l[c] = h[c] = (double)b[c];                                                       \
            }                                                                                     \
            for (int64_t r = 0; r < m; r++) {                                                     \
                const T *v = b + r * width;                                                       \
                _Pragma("omp simd")                                                               \
                for (int64_t c = 0; c < cols; c++) {                                              \
                    double d = (double)v[c];                                                      \
                    s[c] += d;                                                                    \
                    z[c] += v[c] != 0;                                                            \
                    l[c] = d < l[c] ? d : l[c];                                                   \
                    h[c] = d > h[c] ? d : h[c];                                                   \
                }                                                                                 \
            }                                                                                     \
            _Pragma("omp simd")                                                                   \
            for (int64_t c = 0; c < cols; c++) s[c] /= (double)m; /* the block's means */        \
            for (int64_t r = 0; r < m; r++) {                                                     \
                const T *v = b + r * width;                                                       \
                _Pragma("omp simd")                                                               \
                for (int64_t c = 0; c < cols; c++) {                                              \
                    double d = (double)v[c] - s[c];                                               \
                    q[c] += d * d;                                                                \
                }                                                                                 \
            }                                                                                     \
            for (int64_t c = 0; c < cols; c++) {                                                  \
                double *o = out + 5 * (first + c);                                                \
                chan(o, (double)start, (double)m, s[c], q[c]);                                    \
                o[2] = l[c] < o[2] ? l[c] : o[2];                                                 \
                o[3] = h[c] > o[3] ? h[c] : o[3];                                                 \
                o[4] += z[c];                                                                     \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_ROW(row_f32_portable, float)
DEFINE_ROW(row_f64, double)
DEFINE_COLUMNS(columns_f32_portable, float)
DEFINE_COLUMNS(columns_f64, double)
/* the kernels for one channel: `rows` rows of `length` values, `stride` values apart; and for
   columns [first, last) of a [rows, width] map, with 5 scratch doubles per column */
typedef void (*ChannelF32)(const float *, int64_t, int64_t, int64_t, double *);
typedef void (*ColumnsF32)(const float *, int64_t, int64_t, int64_t, int64_t, double *, double *);

/* one channel's rows one after another, merged by row_<T> (float64 sums) */
#define DEFINE_CHANNEL(NAME, ROW, T)                                                                \
    static void NAME(const T *x, int64_t rows, int64_t stride, int64_t length, double *out) {     \
        out[0] = out[1] = out[4] = 0;                                                             \
        for (int64_t n = 0; n < rows; n++) ROW(x + n * stride, length, n * length, out);          \
    }
DEFINE_CHANNEL(channel_f32_portable, row_f32_portable, float)
DEFINE_CHANNEL(channel_f64, row_f64, double)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define X86_KERNELS 1
#define FLUSH 16 /* vectors summed in float32 lanes (two accumulators) before they join float64 */

/* AVX-512: 16 lanes, a mask register for a row's last values */
#define NAME channel_f32_avx512
#define TARGET "avx512f"
#define VEC __m512
#define LANES 16
#define ZERO _mm512_setzero_ps()
#define SET1 _mm512_set1_ps
#define LOAD _mm512_loadu_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define FMA _mm512_fmadd_ps
#define MIN _mm512_min_ps
#define MAX _mm512_max_ps
#define NONZEROS(v, zero) __builtin_popcount(_mm512_cmp_ps_mask(v, zero, _CMP_NEQ_UQ))
#define HSUM _mm512_reduce_add_ps
#define HMIN _mm512_reduce_min_ps
#define HMAX _mm512_reduce_max_ps
#define MASK_T __mmask16
#define TAIL_MASK(n) ((__mmask16)((1u << (n)) - 1))
#define LOAD_M(p, k) _mm512_maskz_loadu_ps(k, p)
#define MIN_M(l, v, k) _mm512_mask_min_ps(l, k, l, v)
#define MAX_M(h, v, k) _mm512_mask_max_ps(h, k, h, v)
#define NONZEROS_M(v, zero, k) __builtin_popcount(_mm512_mask_cmp_ps_mask(k, v, zero, _CMP_NEQ_UQ))
#define SUB_M(v, c, k) _mm512_maskz_sub_ps(k, v, c)
#define COLUMNS_NAME columns_f32_avx512
#define STORE _mm512_storeu_ps
#define IVEC __m512i
#define IZERO _mm512_setzero_si512()
#define COUNT(n, v, zero) _mm512_mask_add_epi32(n, _mm512_cmp_ps_mask(v, zero, _CMP_NEQ_UQ), n, _mm512_set1_epi32(1))
#define ISTORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define DVEC __m512d
#define DZERO _mm512_setzero_pd()
#define DADD _mm512_add_pd
#define DSTORE _mm512_storeu_pd
#define WIDEN_LO(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define WIDEN_HI(v) _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#define DHSUM _mm512_reduce_add_pd
#include "_moments_f32.h"
#undef NAME
#undef TARGET
#undef VEC
#undef LANES
#undef ZERO
#undef SET1
#undef LOAD
#undef ADD
#undef SUB
#undef FMA
#undef MIN
#undef MAX
#undef NONZEROS
#undef HSUM
#undef HMIN
#undef HMAX
#undef MASK_T
#undef TAIL_MASK
#undef LOAD_M
#undef MIN_M
#undef MAX_M
#undef NONZEROS_M
#undef SUB_M
#undef COLUMNS_NAME
#undef STORE
#undef IVEC
#undef IZERO
#undef COUNT
#undef ISTORE
#undef DVEC
#undef DZERO
#undef DADD
#undef DSTORE
#undef WIDEN_LO
#undef WIDEN_HI
#undef DHSUM

/* AVX2: 8 lanes; a lane mask vector for a row's last values; lanes folded in halves */
#define FOLD256(NAME, OP)                                                                          \
    __attribute__((target("avx2,fma"))) static inline float NAME(__m256 v) {                     \
        __m128 a = OP(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));                  \
        a = OP(a, _mm_movehl_ps(a, a));                                                           \
        return _mm_cvtss_f32(OP(a, _mm_movehdup_ps(a)));                                         \
    }
FOLD256(hsum256, _mm_add_ps)
FOLD256(hmin256, _mm_min_ps)
FOLD256(hmax256, _mm_max_ps)
__attribute__((target("avx2,fma"))) static inline double dhsum256(__m256d v) {
    __m128d a = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(a, _mm_unpackhi_pd(a, a)));
}
#define NAME channel_f32_avx2
#define TARGET "avx2,fma"
#define VEC __m256
#define LANES 8
#define ZERO _mm256_setzero_ps()
#define SET1 _mm256_set1_ps
#define LOAD _mm256_loadu_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define FMA _mm256_fmadd_ps
#define MIN _mm256_min_ps
#define MAX _mm256_max_ps
#define NONZEROS(v, zero) __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NEQ_UQ)))
#define HSUM hsum256
#define HMIN hmin256
#define HMAX hmax256
#define MASK_T __m256
#define TAIL_MASK(n) _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
#define LOAD_M(p, k) _mm256_maskload_ps(p, _mm256_castps_si256(k))
#define MIN_M(l, v, k) _mm256_blendv_ps(l, _mm256_min_ps(l, v), k)
#define MAX_M(h, v, k) _mm256_blendv_ps(h, _mm256_max_ps(h, v), k)
#define NONZEROS_M(v, zero, k) __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_NEQ_UQ), k)))
#define SUB_M(v, c, k) _mm256_and_ps(_mm256_sub_ps(v, c), k)
#define COLUMNS_NAME columns_f32_avx2
#define STORE _mm256_storeu_ps
#define IVEC __m256i
#define IZERO _mm256_setzero_si256()
#define COUNT(n, v, zero) _mm256_sub_epi32(n, _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_NEQ_UQ)))
#define ISTORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define DVEC __m256d
#define DZERO _mm256_setzero_pd()
#define DADD _mm256_add_pd
#define DSTORE _mm256_storeu_pd
#define WIDEN_LO(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define WIDEN_HI(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
#define DHSUM dhsum256
#include "_moments_f32.h"
#endif

/* float32 channels: the vector kernels this CPU has (best first), then the portable one (float64
   sums); the module's KERNELS names them, and moments() takes any of them (the tests run each) */
typedef struct {
    ChannelF32 channel;
    ColumnsF32 columns;
    const char *name;
} Kernel;
static Kernel kernels[3];
static int kernel_count = 0;

typedef struct {
    const void *x;
    double *out, *acc;
    int64_t outer, channels, inner, first, last; /* channels [first, last) */
    int f64;
    const Kernel *f32;
} Job;

static void run(const Job *j) {
    if (j->first >= j->last) return;
    if (j->inner == 1) { /* the channels are the columns of an [outer, C] map */
        if (j->f64) columns_f64(j->x, j->outer, j->channels, j->first, j->last, j->out, j->acc);
        else j->f32->columns(j->x, j->outer, j->channels, j->first, j->last, j->out, j->acc);
        return;
    }
    int64_t stride = j->channels * j->inner; /* between a channel's rows of consecutive samples */
    for (int64_t c = j->first; c < j->last; c++) {
        if (j->f64) channel_f64((const double *)j->x + c * j->inner, j->outer, stride, j->inner, j->out + 5 * c);
        else j->f32->channel((const float *)j->x + c * j->inner, j->outer, stride, j->inner, j->out + 5 * c);
    }
}

/* moments(data, outer, channels, inner, out, f64, threads, kernel=0) -> status: see the top of
   this file. `out` holds 5 float64 per channel; `kernel` indexes KERNELS. The status is 1, or 0
   when a mean or M2 is not finite, or 2 when a float32 channel spreads over less than 2**-50
   (float32 squares of such deviations lose their digits: sum it as float64). */
static PyObject *moments(PyObject *self, PyObject *args) {
    unsigned long long data, out;
    long long outer, channels, inner;
    int f64, threads, kernel = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLLKpi|i", &data, &outer, &channels, &inner, &out, &f64, &threads, &kernel)) return NULL;
    if (outer < 1 || channels < 1 || inner < 1 || kernel < 0 || kernel >= kernel_count) {
        PyErr_SetString(PyExc_ValueError, "moments: an empty map, or no such kernel");
        return NULL;
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > channels) threads = (int)channels;
    if (threads < 1) threads = 1;
    Job jobs[MAX_THREADS];
    double *acc = inner == 1 ? malloc(sizeof(double) * 5 * (size_t)channels) : NULL;
    if (inner == 1 && !acc) return PyErr_NoMemory();
    double *o = (double *)(uintptr_t)out;
    int status = 1;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        int64_t first = channels * t / threads, last = channels * (t + 1) / threads;
        jobs[t] = (Job){(const void *)(uintptr_t)data, o, acc ? acc + 5 * first : NULL, outer, channels, inner, first, last, f64, &kernels[kernel]};
    }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) run(&jobs[t]);
    for (int64_t c = 0; c < channels; c++) {
        double *r = o + 5 * c, spread = r[3] - r[2];
        if (!isfinite(r[0]) || !isfinite(r[1])) status = 0;
        else if (status && !f64 && spread > 0 && spread < 0x1p-50) status = 2;
    }
    Py_END_ALLOW_THREADS
    free(acc);
    return PyLong_FromLong(status);
}

static PyMethodDef methods[] = {
    {"moments", moments, METH_VARARGS, "Per channel: mean, M2, min, max and non-zeros of a map."},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_moments", NULL, -1, methods, NULL, NULL, NULL, NULL};
static void add_kernel(ChannelF32 channel, ColumnsF32 columns, const char *name) {
    kernels[kernel_count++] = (Kernel){channel, columns, name};
}

PyMODINIT_FUNC PyInit__moments(void) {
#ifdef X86_KERNELS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) add_kernel(channel_f32_avx512, columns_f32_avx512, "avx512");
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) add_kernel(channel_f32_avx2, columns_f32_avx2, "avx2");
#endif
    add_kernel(channel_f32_portable, columns_f32_portable, "portable");
    PyObject *m = PyModule_Create(&module), *names = m ? PyTuple_New(kernel_count) : NULL;
    for (int k = 0; names && k < kernel_count; k++) PyTuple_SetItem(names, k, PyUnicode_FromString(kernels[k].name));
    if (!names || PyModule_AddObject(m, "KERNELS", names) < 0) {
        Py_XDECREF(names);
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
