/* The float32 kernel for one channel's rows, included by _moments.c once per instruction set
   (NAME, TARGET and the vector operations are defined there).

   The channel's `rows` rows of `length` values lie `stride` values apart. They are taken in
   blocks of about BLOCK values (whole rows, or pieces of a row longer than that), which stay in
   L1: pass 1 reads a block from memory for min, max, non-zeros and a rough sum; pass 2 reads it
   again from L1 for the deviations d from the rough mean (`shift`), summing d and d*d in float32
   lanes that join float64 sums every FLUSH vectors. The block's mean is shift + sum(d) / m and
   its M2 = sum(d*d) - sum(d)^2 / m (the corrected two-pass algorithm): the float32 lanes only
   ever hold a few small centred values (relative error about 1e-7), and the blocks merge in
   float64 (Chan). A row's last values fill a masked vector, so short rows (7 x 7) cost no
   scalar loop and no reduction of their own.

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
            VEC s0 = ZERO, s1 = ZERO, l0 = SET1(x[first * stride + start]), l1 = l0, h0 = l0, h1 = l0;
            for (int64_t r = first; r < last; r++) { /* pass 1, from memory */
                const float *b = x + r * stride + start;
                int64_t i = 0;
                for (; i + 2 * LANES <= full; i += 2 * LANES) {
                    VEC v = LOAD(b + i), w = LOAD(b + i + LANES);
                    s0 = ADD(s0, v);
                    s1 = ADD(s1, w);
                    l0 = MIN(l0, v);
                    l1 = MIN(l1, w);
                    h0 = MAX(h0, v);
                    h1 = MAX(h1, w);
                    zeros += NONZEROS(v, zero) + NONZEROS(w, zero);
                }
                if (i < full) {
                    VEC v = LOAD(b + i);
                    s0 = ADD(s0, v);
                    l0 = MIN(l0, v);
                    h0 = MAX(h0, v);
                    zeros += NONZEROS(v, zero);
                }
                if (len > full) {
                    VEC v = LOAD_M(b + full, tail);
                    s1 = ADD(s1, v);
                    l1 = MIN_M(l1, v, tail);
                    h1 = MAX_M(h1, v, tail);
                    zeros += NONZEROS_M(v, zero, tail);
                }
            }
            float sum = HSUM(ADD(s0, s1)), bl = HMIN(MIN(l0, l1)), bh = HMAX(MAX(h0, h1));
            lo = bl < lo ? bl : lo;
            hi = bh > hi ? bh : hi;
            float shift = sum / (float)m;
            VEC c = SET1(shift), r0 = ZERO, r1 = ZERO, q0 = ZERO, q1 = ZERO;
            double dr = 0, dq = 0;
            int pending = 0; /* vectors in the float32 lanes since they last joined dr, dq */
            for (int64_t r = first; r < last; r++) { /* pass 2, from L1 */
                const float *b = x + r * stride + start;
                int64_t i = 0;
                for (; i + 2 * LANES <= full; i += 2 * LANES) {
                    VEC d = SUB(LOAD(b + i), c), e = SUB(LOAD(b + i + LANES), c);
                    r0 = ADD(r0, d);
                    r1 = ADD(r1, e);
                    q0 = FMA(d, d, q0);
                    q1 = FMA(e, e, q1);
                    if ((pending += 2) >= FLUSH) {
                        dr += HSUM(ADD(r0, r1));
                        dq += HSUM(ADD(q0, q1));
                        r0 = r1 = q0 = q1 = ZERO;
                        pending = 0;
                    }
                }
                if (i < full) {
                    VEC d = SUB(LOAD(b + i), c);
                    r0 = ADD(r0, d);
                    q0 = FMA(d, d, q0);
                    pending++;
                }
                if (len > full) {
                    VEC d = SUB_M(LOAD_M(b + full, tail), c, tail);
                    r1 = ADD(r1, d);
                    q1 = FMA(d, d, q1);
                    pending++;
                }
                if (pending >= FLUSH) {
                    dr += HSUM(ADD(r0, r1));
                    dq += HSUM(ADD(q0, q1));
                    r0 = r1 = q0 = q1 = ZERO;
                    pending = 0;
                }
            }
            dr += HSUM(ADD(r0, r1));
            dq += HSUM(ADD(q0, q1));
            chan(out, (double)seen, (double)m, shift + dr / (double)m, dq - dr * dr / (double)m);
            seen += m;
            nonzero += zeros;
        }
    }
    out[2] = lo;
    out[3] = hi;
    out[4] = (double)nonzero;
}

/* Columns [first, last) of a float32 [rows, width] map (tokens or features: a channel is a
   column), LANES columns at a time, one lane each, in blocks of STEP rows: pass 1 reads the
   block's slice of each row from memory (min, max, non-zeros, rough sums), pass 2 again from L1
   (STEP lines of 64 bytes) for the deviations from each lane's rough mean, summed in float32 for
   FLUSH rows and then in float64 lanes. The lanes merge into their columns' results (Chan) once
   per block. Lanes past `last` load zeros and are never read. */
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
            VEC s = ZERO, lo = LOAD_M(x + start * width + j, k), hi = lo;
            IVEC nonzero = IZERO;
            for (int64_t r = start; r < end; r++) { /* pass 1, from memory */
                VEC v = LOAD_M(x + r * width + j, k);
                s = ADD(s, v);
                lo = MIN(lo, v);
                hi = MAX(hi, v);
                nonzero = COUNT(nonzero, v, zero);
            }
            VEC c = DIV(s, SET1((float)m)), dr = ZERO, dq = ZERO;
            DVEC dr0 = DZERO, dr1 = DZERO, dq0 = DZERO, dq1 = DZERO;
            for (int64_t r = start; r < end;) { /* pass 2, from L1 */
                for (int f = 0; f < FLUSH && r < end; f++, r++) {
                    VEC d = SUB(LOAD_M(x + r * width + j, k), c);
                    dr = ADD(dr, d);
                    dq = FMA(d, d, dq);
                }
                dr0 = DADD(dr0, WIDEN_LO(dr));
                dr1 = DADD(dr1, WIDEN_HI(dr));
                dq0 = DADD(dq0, WIDEN_LO(dq));
                dq1 = DADD(dq1, WIDEN_HI(dq));
                dr = dq = ZERO;
            }
            float shifts[LANES], los[LANES], his[LANES];
            int counts[LANES];
            double sums[LANES], squares[LANES];
            STORE(shifts, c);
            STORE(los, lo);
            STORE(his, hi);
            ISTORE(counts, nonzero);
            DSTORE(sums, dr0);
            DSTORE(sums + LANES / 2, dr1);
            DSTORE(squares, dq0);
            DSTORE(squares + LANES / 2, dq1);
            for (int l = 0; l < lanes; l++) {
                double *o = out + 5 * (j + l), mean = shifts[l] + sums[l] / (double)m;
                chan(o, (double)start, (double)m, mean, squares[l] - sums[l] * sums[l] / (double)m);
                o[2] = los[l] < o[2] ? los[l] : o[2];
                o[3] = his[l] > o[3] ? his[l] : o[3];
                o[4] += counts[l];
            }
        }
    }
}
#undef STEP
