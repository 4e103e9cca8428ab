// Data movement: fills, strided copies (any layout to row-major), dtype casts. Half types are
// their bits (unsigned short): NVRTC alone has no cuda_fp16.h, and these are the only conversions.

template <typename T>
__device__ void fill_t(T* out, i64 n, T value) {
    GRID_STRIDE(i, n) out[i] = value;
}
extern "C" __global__ void fill_f32(float* out, i64 n, float value) { fill_t(out, n, value); }
extern "C" __global__ void fill_f64(double* out, i64 n, double value) { fill_t(out, n, value); }
// A strided view of a larger tensor, written where it lies (its elements are distinct).
template <typename T>
__device__ void fill_strided_t(T* base, Strided v, i64 n, T value) {
    GRID_STRIDE(k, n) base[strided_offset(v, k)] = value;
}
extern "C" __global__ void fill_strided_f32(float* base, Strided v, i64 n, float value) { fill_strided_t(base, v, n, value); }
extern "C" __global__ void fill_strided_f64(double* base, Strided v, i64 n, double value) { fill_strided_t(base, v, n, value); }
// t[i] += 1 (a counter: batch norm's num_batches_tracked).
extern "C" __global__ void count_up_i64(i64* t, i64 n) {
    GRID_STRIDE(i, n) t[i] += 1;
}

// dst[k] = src[offset(k)] for elements of `bytes` bytes each (1, 2, 4 or 8).
template <typename T>
__device__ void gather_t(T* dst, const T* src, Strided s, i64 n) {
    GRID_STRIDE(k, n) dst[k] = src[strided_offset(s, k)];
}
extern "C" __global__ void gather_b1(unsigned char* d, const unsigned char* s, Strided v, i64 n) { gather_t(d, s, v, n); }
extern "C" __global__ void gather_b2(unsigned short* d, const unsigned short* s, Strided v, i64 n) { gather_t(d, s, v, n); }
extern "C" __global__ void gather_b4(unsigned int* d, const unsigned int* s, Strided v, i64 n) { gather_t(d, s, v, n); }
extern "C" __global__ void gather_b8(u64* d, const u64* s, Strided v, i64 n) { gather_t(d, s, v, n); }
// dst[r, c] = src[c * stride] for each of `rows` rows (a bias broadcast before a product adds onto
// it): a block per row, its threads along the row, no division an element (the strided gather above
// took 94 us for GPT-2's 4,096 x 2,304 on an H100, eight times the time to write it).
// dst's rows are `ld` elements apart (cols where dense; a block of a larger matrix's columns, the
// column-major C of a product cut in blocks, where not).
template <typename T>
__device__ void repeat_row_t(T* dst, const T* src, i64 stride, i64 rows, i64 cols, i64 ld) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x)
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) dst[r * ld + c] = src[c * stride];
}
extern "C" __global__ void repeat_row_b2(unsigned short* d, const unsigned short* s, i64 stride, i64 rows, i64 cols, i64 ld) { repeat_row_t(d, s, stride, rows, cols, ld); }
extern "C" __global__ void repeat_row_b4(unsigned int* d, const unsigned int* s, i64 stride, i64 rows, i64 cols, i64 ld) { repeat_row_t(d, s, stride, rows, cols, ld); }
extern "C" __global__ void repeat_row_b8(u64* d, const u64* s, i64 stride, i64 rows, i64 cols, i64 ld) { repeat_row_t(d, s, stride, rows, cols, ld); }

// Four f32 values, and four 16-bit ones, loaded and stored whole.
struct __align__(16) Floats4 {
    float v[4];
};
struct __align__(8) Halves4 {
    unsigned w[2];
};
// Whether n elements at f32 x and 16-bit y go four at a time (n a multiple of 4, both aligned).
__device__ __forceinline__ bool by_fours(const void* x, const void* y, i64 n) {
    return n % 4 == 0 && (u64)x % 16 == 0 && (u64)y % 8 == 0;
}

// Casts between f32 and a 16-bit float, four elements a thread where they are aligned (an element
// a thread reached a third of an H100's memory bandwidth), two groups in flight.
template <unsigned short (*TO)(float)>
__device__ void cast_to_half(const float* x, unsigned short* y, i64 n) {
    if (!by_fours(x, y, n)) {
        GRID_STRIDE(i, n) y[i] = TO(x[i]);
        return;
    }
    grid_two_in_flight(n / 4, [&](i64 q) { return ((const Floats4*)x)[q]; }, [&](i64 q, const Floats4& f) {
        Halves4 h;
        for (int j = 0; j < 2; ++j) h.w[j] = (unsigned)TO(f.v[2 * j]) | ((unsigned)TO(f.v[2 * j + 1]) << 16);
        ((Halves4*)y)[q] = h;
    });
}
template <float (*FROM)(unsigned short)>
__device__ void cast_from_half(const unsigned short* x, float* y, i64 n) {
    if (!by_fours(y, x, n)) {
        GRID_STRIDE(i, n) y[i] = FROM(x[i]);
        return;
    }
    grid_two_in_flight(n / 4, [&](i64 q) { return ((const Halves4*)x)[q]; }, [&](i64 q, const Halves4& h) {
        Floats4 f;
        for (int j = 0; j < 4; ++j) f.v[j] = FROM((unsigned short)(h.w[j / 2] >> (16 * (j % 2))));
        ((Floats4*)y)[q] = f;
    });
}
extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* y, i64 n) { cast_to_half<f32_to_bf16>(x, y, n); }
extern "C" __global__ void cast_bf16_f32(const unsigned short* x, float* y, i64 n) { cast_from_half<bf16_to_f32>(x, y, n); }
extern "C" __global__ void cast_f32_f16(const float* x, unsigned short* y, i64 n) { cast_to_half<f32_to_f16>(x, y, n); }
extern "C" __global__ void cast_f16_f32(const unsigned short* x, float* y, i64 n) { cast_from_half<f16_to_f32>(x, y, n); }
// Rounds `batch` column-major f32 matrices of rows x cols (leading dimension ld, matrix i at
// x + i * stride) to a product's operand bits (KIND 1: bfloat16, 2: binary16, as every product
// reads them: Notes [bf16 products] and [fp16 products], common.cuh's operand_bits), packed: matrix
// i's element (r, c) at y[i * rows * cols + r + c * rows] (memfit_cuda::rounded). A block takes
// whole columns, its threads a column's rows: reads and writes run down a column, and an element
// costs no division (one per column).
// Four rows a thread where every column's start is aligned (rows, ld and stride multiples of 4),
// with the conversion of common.cuh's operand_pair_fast: these bits only a product reads. A launch
// rounds one operand or two (a product's A and B: half the launches, where a step of GPT-2 made
// a thousand), the second's columns after the first's.
struct Rounding {
    const float* x;
    i64 rows, cols, ld, stride, batch;
    unsigned short* y;
};
template <int KIND>
__device__ void round_column(const Rounding& o, i64 column) {
    const i64 i = column / o.cols, c = column - i * o.cols;
    const float* from = o.x + i * o.stride + c * o.ld;
    unsigned short* to = o.y + column * o.rows;
    if (!(by_fours(o.x, o.y, o.rows) && o.ld % 4 == 0 && o.stride % 4 == 0)) {
        for (i64 r = threadIdx.x; r < o.rows; r += blockDim.x) to[r] = (unsigned short)operand_bits<KIND>(from[r]);
        return;
    }
    for (i64 q = threadIdx.x; q < o.rows / 4; q += blockDim.x) {
        const Floats4 f = ((const Floats4*)from)[q];
        ((Halves4*)to)[q] = Halves4{{operand_pair_fast<KIND>(f.v[0], f.v[1]), operand_pair_fast<KIND>(f.v[2], f.v[3])}};
    }
}
template <int KIND>
__device__ void round_operands(const Rounding& a, const Rounding& b) {
    const i64 first = a.cols * a.batch, all = first + b.cols * b.batch;
    for (i64 column = blockIdx.x; column < all; column += gridDim.x) {
        if (column < first) round_column<KIND>(a, column);
        else round_column<KIND>(b, column - first);
    }
}
extern "C" __global__ void round_operands_bf16(Rounding a, Rounding b) { round_operands<1>(a, b); }
extern "C" __global__ void round_operands_f16(Rounding a, Rounding b) { round_operands<2>(a, b); }
extern "C" __global__ void cast_f32_f64(const float* x, double* y, i64 n) { GRID_STRIDE(i, n) y[i] = (double)x[i]; }
extern "C" __global__ void cast_f64_f32(const double* x, float* y, i64 n) { GRID_STRIDE(i, n) y[i] = (float)x[i]; }
