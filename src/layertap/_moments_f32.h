/* The float32 kernels, included by _moments.c once per instruction set (NAME, COLUMNS_NAME,
   TARGET and the vector operations are defined there).

   NAME: one channel's `rows` rows of `length` values, `stride` values apart, taken in blocks of
   about BLOCK values (whole rows, or pieces of a row longer than that) that stay in L1. Pass 1
   reads a block from memory: min, max, non-zeros, and the sum of its values in float64 lanes,
   so the block's mean is as exact as numpy's. Pass 2 reads it again from L1 for the squares of
   the deviations d = x - shift from the mean rounded to float32, summed in float32 lanes that
   join a float64 sum every FLUSH vectors; M2 = sum(d*d) - m (mean - shift)^2. The float32 lanes
   only ever hold a few squares of centred values (relative error about 1e-7, on the std half
   that), and the blocks merge in float64 (Chan). A row's last values fill a masked vector, so
   short rows (7 x 7) cost no scalar loop and no reduction of their own.

   Two accumulators of each kind: an add waits for the one before it (4 cycles), two in flight
   keep the vector units busy. */
__attribute__((target(TARGET))) static void NAME(const float *x, int64_t rows, int64_t stride, int64_t length, double *out) {
    int64_t per = length < BLOCK ? BLOCK / length : 1, piece = length < BLOCK ? length : BLOCK;
    int64_t seen = 0, nonzero = 0;
    float lo = x[0], hi = x[0];
    VEC zero = ZERO;
    out[0] = out[1] = 0;
    for (int64_t first = 0; first < rows; first += per) {
        int64_t last = first + per < rows ? first + per : rows;
        for (int64_t start = 0; start < length; start += piece) {
            int64_t len = length - start < piece ? length - start : piece, full = len - len % LANES;
            int64_t m = (last - first) * len, zeros = 0;
            MASK_T tail = TAIL_MASK(len - full);
            VEC l0 = SET1(x[first * stride + start]), l1 = l0, h0 = l0, h1 = l0;
            DVEC s0 = DZERO, s1 = DZERO, s2 = DZERO, s3 = DZERO;
            for (int64_t r = first; r < last; r++) { /* pass 1, from memory */
                const float *b = x + r * stride + start;
                int64_t i = 0;
                for (; i + 2 * LANES <= full; i += 2 * LANES) {
                    VEC v = LOAD(b + i), w = LOAD(b + i + LANES);
                    s0 = DADD(s0, WIDEN_LO(v));
                    s1 = DADD(s1, WIDEN_HI(v));
                    s2 = DADD(s2, WIDEN_LO(w));
                    s3 = DADD(s3, WIDEN_HI(w));
                    l0 = MIN(l0, v);
                    l1 = MIN(l1, w);
                    h0 = MAX(h0, v);
                    h1 = MAX(h1, w);
                    zeros += NONZEROS(v, zero) + NONZEROS(w, zero);
                }
                if (i < full) {
                    VEC v = LOAD(b + i);
                    s0 = DADD(s0, WIDEN_LO(v));
                    s1 = DADD(s1, WIDEN_HI(v));
                    l0 = MIN(l0, v);
                    h0 = MAX(h0, v);
                    zeros += NONZEROS(v, zero);
                }
                if (len > full) {
                    VEC v = LOAD_M(b + full, tail);
                    s2 = DADD(s2, WIDEN_LO(v));
                    s3 = DADD(s3, WIDEN_HI(v));
                    l1 = MIN_M(l1, v, tail);
                    h1 = MAX_M(h1, v, tail);
                    zeros += NONZEROS_M(v, zero, tail);
                }
            }
            double mean = DHSUM(DADD(DADD(s0, s1), DADD(s2, s3))) / (double)m;
            float bl = HMIN(MIN(l0, l1)), bh = HMAX(MAX(h0, h1)), shift = (float)mean;
            lo = bl < lo ? bl : lo;
            hi = bh > hi ? bh : hi;
            VEC c = SET1(shift), q0 = ZERO, q1 = ZERO;
            double dq = 0;
            int pending = 0; /* vectors in the float32 lanes since they last joined dq */
            for (int64_t r = first; r < last; r++) { /* pass 2, from L1 */
                const float *b = x + r * stride + start;
                int64_t i = 0;
                for (; i + 2 * LANES <= full; i += 2 * LANES) {
                    VEC d = SUB(LOAD(b + i), c), e = SUB(LOAD(b + i + LANES), c);
                    q0 = FMA(d, d, q0);
                    q1 = FMA(e, e, q1);
                    if ((pending += 2) >= FLUSH) {
                        dq += HSUM(ADD(q0, q1));
                        q0 = q1 = ZERO;
                        pending = 0;
                    }
                }
                if (i < full) {
                    VEC d = SUB(LOAD(b + i), c);
                    q0 = FMA(d, d, q0);
                    pending++;
                }
                if (len > full) {
                    VEC d = SUB_M(LOAD_M(b + full, tail), c, tail);
                    q1 = FMA(d, d, q1);
                    pending++;
                }
                if (pending >= FLUSH) {
                    dq += HSUM(ADD(q0, q1));
                    q0 = q1 = ZERO;
                    pending = 0;
                }
            }
            dq += HSUM(ADD(q0, q1));
            chan(out, (double)seen, (double)m, mean, dq - (double)m * (mean - shift) * (mean - shift));
            seen += m;
            nonzero += zeros;
        }
    }
    out[2] = lo;
    out[3] = hi;
    out[4] = (double)nonzero;
}

/* COLUMNS_NAME: columns [first, last) of a float32 [rows, width] map (tokens or features: a
   channel is a column), LANES columns at a time, one lane each, in blocks of STEP rows. Pass 1
   reads the block's slice of each row from memory (min, max, non-zeros, sums in float64 lanes),
   pass 2 again from L1 (STEP lines of 64 bytes) for the squared deviations from each lane's mean
   rounded to float32, summed in float32 for FLUSH rows, then in float64 lanes; the lanes merge
   into their columns (Chan) once per block. Lanes past `last` load zeros and are never read. */
#define STEP 256
__attribute__((target(TARGET))) static void COLUMNS_NAME(const float *x, int64_t rows, int64_t width, int64_t first, int64_t last,
                                                          double *out, double *scratch) {
    VEC zero = ZERO;
    (void)scratch; /* the portable kernel's; the lanes are this one's */
    for (int64_t j = first; j < last; j += LANES) {
        int lanes = last - j < LANES ? (int)(last - j) : LANES;
        MASK_T k = TAIL_MASK(lanes);
        for (int l = 0; l < lanes; l++) {
            double *o = out + 5 * (j + l);
            o[0] = o[1] = o[4] = 0;
            o[2] = o[3] = x[j + l];
        }
        for (int64_t start = 0; start < rows; start += STEP) {
            int64_t end = start + STEP < rows ? start + STEP : rows, m = end - start;
            VEC lo = LOAD_M(x + start * width + j, k), hi = lo;
            DVEC s0 = DZERO, s1 = DZERO;
            IVEC nonzero = IZERO;
            for (int64_t r = start; r < end; r++) { /* pass 1, from memory */
                VEC v = LOAD_M(x + r * width + j, k);
                s0 = DADD(s0, WIDEN_LO(v));
                s1 = DADD(s1, WIDEN_HI(v));
                lo = MIN(lo, v);
                hi = MAX(hi, v);
                nonzero = COUNT(nonzero, v, zero);
            }
            double means[LANES], squares[LANES];
            float shifts[LANES], los[LANES], his[LANES];
            int counts[LANES];
            DSTORE(means, s0);
            DSTORE(means + LANES / 2, s1);
            for (int l = 0; l < LANES; l++) {
                means[l] /= (double)m;
                shifts[l] = (float)means[l];
            }
            VEC c = LOAD(shifts), dq = ZERO;
            DVEC dq0 = DZERO, dq1 = DZERO;
            for (int64_t r = start; r < end;) { /* pass 2, from L1 */
                for (int f = 0; f < FLUSH && r < end; f++, r++) {
                    VEC d = SUB(LOAD_M(x + r * width + j, k), c);
                    dq = FMA(d, d, dq);
                }
                dq0 = DADD(dq0, WIDEN_LO(dq));
                dq1 = DADD(dq1, WIDEN_HI(dq));
                dq = ZERO;
            }
            STORE(los, lo);
            STORE(his, hi);
            ISTORE(counts, nonzero);
            DSTORE(squares, dq0);
            DSTORE(squares + LANES / 2, dq1);
            for (int l = 0; l < lanes; l++) {
                double *o = out + 5 * (j + l), off = means[l] - shifts[l];
                chan(o, (double)start, (double)m, means[l], squares[l] - (double)m * off * off);
                o[2] = los[l] < o[2] ? los[l] : o[2];
                o[3] = his[l] > o[3] ? his[l] : o[3];
                o[4] += counts[l];
            }
        }
    }
}
#undef STEP
