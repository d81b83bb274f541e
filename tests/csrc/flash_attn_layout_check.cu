// Host-side checks of the layout facts the attention kernels rely on, runnable without a GPU:
// - every score element's (row, col) from the tiled MMAs (the mask's and dropout's coordinates);
// - each lane of the forward and backward S tiles holds whole 16x16 dropout cells in the m16n8
//   layout (rows r, r + 8; columns 2c, 2c + 1, +8), so both kernels draw the same dropout mask;
// - in the dQ and dK/dV accumulators, elements (i, i + 1) for even i are adjacent columns of one
//   row starting at an even column (dQ is added to dq_accum in such pairs, and dK/dV go to
//   shared memory in them), and dq_accum's column order keeps those pairs whole;
// - the same for the Hopper (wgmma) accumulators where those paths apply, the forward's P read as
//   wgmma's register A operand element for element, and the wgmma views of the shared-memory tiles
//   (address-swizzled) landing on the very bytes the mma.sync path uses;
// - the warp-specialised backward's S^T tile: its (query, key) view for the score modifications,
//   P^T and dS^T read as the register A operands of dV and dK element for element, its pairs of
//   shared-memory views (written one way, read transposed) on the same bytes, and its dropout mask
//   (drawn on S^T) equal to the forward's;
// - a wgmma's shared-memory operands partitioned alike by every thread of a warpgroup (every sm90
//   kernel slices them by the warpgroup's first thread);
// - Philox4x32-10 against the Random123 known-answer vectors.
// Prints "OK" and exits 0, or prints the first mismatch and exits 1.
#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include <cute/tensor.hpp>

#include "flash_bwd_kernel.h"
#include "flash_bwd_ws_kernel.h"
#include "flash_fwd_ws_kernel.h"
#include "kernel_traits.h"
#include "philox.h"
#include "tile_sizes.h"
#include "utils.h"

using namespace cute;

static int failures = 0;
#define EXPECT(cond, ...)                                                    \
    do {                                                                     \
        if (!(cond)) {                                                       \
            if (failures++ < 10) { std::printf(__VA_ARGS__); std::printf("\n"); } \
        }                                                                    \
    } while (0)

// Every element of a (kM x kN) S tile is held by exactly one thread, and each lane's elements
// form whole dropout cells laid out as dropout.h assumes.
// warps_along_m: the forward's layout, where warp w owns rows 16w + 16 * kWarps * mi of the
// tile and every column (atoms 8 columns apart).
template <typename TiledMma, int kM, int kN>
void check_score_tile(const char *name, int threads, bool warps_along_m) {
    TiledMma tiled_mma;
    std::set<std::pair<int, int>> seen;
    for (int tid = 0; tid < threads; ++tid) {
        auto thr_mma = tiled_mma.get_thread_slice(tid);
        Tensor c = thr_mma.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
        Tensor rc = make_tensor(c.data(), flash::acc_as_rowcol(c.layout()));
        const int lane = tid % 32;
        constexpr int kAtomsM = decltype(size<0, 1>(rc))::value, kAtomsN = decltype(size<1, 1>(rc))::value;
        static_assert(kAtomsN % 2 == 0);
        for (int mi = 0; mi < kAtomsM; ++mi) {
            for (int cc = 0; cc < kAtomsN / 2; ++cc) {
                auto first = rc(make_coord(0, mi), make_coord(0, 2 * cc));
                const int cell_row = get<0>(first) / 16, cell_col = get<1>(first) / 16;
                for (int i = 0; i < 2; ++i) {
                    for (int half = 0; half < 2; ++half) {
                        for (int j = 0; j < 2; ++j) {
                            auto p = rc(make_coord(i, mi), make_coord(j, 2 * cc + half));
                            const int row = get<0>(p), col = get<1>(p);
                            EXPECT(seen.insert({row, col}).second, "%s: (%d, %d) held twice", name, row, col);
                            EXPECT(row / 16 == cell_row && col / 16 == cell_col,
                                   "%s: tid %d element (%d, %d) outside its cell (%d, %d)", name, tid, row, col,
                                   cell_row, cell_col);
                            EXPECT(row % 16 == lane / 4 + 8 * i && col % 16 == 8 * half + (lane % 4) * 2 + j,
                                   "%s: tid %d slot (i %d, half %d, j %d) at (%d, %d)", name, tid, i, half, j,
                                   row, col);
                            if (warps_along_m) {
                                const int warps = threads / 32, warp = tid / 32, nj = 2 * cc + half;
                                EXPECT(row == warp * 16 + lane / 4 + 8 * i + mi * 16 * warps &&
                                           col == (lane % 4) * 2 + j + nj * 8,
                                       "%s: tid %d (i %d, mi %d, j %d, nj %d) at (%d, %d)", name, tid, i, mi, j,
                                       nj, row, col);
                            }
                        }
                    }
                }
            }
        }
    }
    EXPECT(int(seen.size()) == kM * kN, "%s: %d of %d elements held", name, int(seen.size()), kM * kN);
}

template <typename TiledMma, int kM, int kN>
void check_column_pairs(const char *name, int threads) {
    using namespace cute;
    for (int tid = 0; tid < threads; ++tid) {
        Tensor coords = TiledMma{}.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
        for (int i = 0; i < int(size(coords)); i += 2) {
            const int row = get<0>(coords(i)), col = get<1>(coords(i));
            EXPECT(col % 2 == 0 && get<0>(coords(i + 1)) == row && get<1>(coords(i + 1)) == col + 1,
                   "%s: tid %d elements %d, %d at (%d, %d), (%d, %d)", name, tid, i, i + 1, row, col,
                   int(get<0>(coords(i + 1))), int(get<1>(coords(i + 1))));
        }
    }
}

// The accumulator of S, re-read through acc_as_A_operand, is the A operand of O += P V element for
// element (P never leaves the registers).
template <typename TiledMmaS, typename TiledMmaO, int kM, int kN>
void check_p_as_a_operand(const char *name, int threads) {
    for (int tid = 0; tid < threads; ++tid) {
        Tensor c = TiledMmaS{}.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
        Tensor as_a = make_tensor(c.data(), flash::acc_as_A_operand(c.layout()));
        Tensor a = TiledMmaO{}.get_thread_slice(tid).partition_A(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
        EXPECT(size(as_a) == size(a), "%s: %d vs %d elements", name, int(size(as_a)), int(size(a)));
        for (int i = 0; i < int(size(a)); ++i) {
            EXPECT(as_a(i) == a(i), "%s: tid %d element %d at (%d, %d), A operand wants (%d, %d)", name, tid, i,
                   int(get<0>(as_a(i))), int(get<1>(as_a(i))), int(get<0>(a(i))), int(get<1>(a(i))));
        }
    }
}

// A wgmma view (a swizzle applied to byte addresses of a 1024-byte aligned tile) addresses the same
// byte as our layout (a swizzle of element offsets) for every (row, col) of a (kRows, kCols) tile;
// Transposed: the view is indexed (col, row).
template <typename Element, typename Ours, typename View, bool Transposed, int kRows, int kCols>
void check_smem_view(const char *name) {
    Ours ours;
    View view;
    auto swizzle = view.layout_a();
    auto inner = view.layout_b();
    for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kCols; ++c) {
            const int ours_byte = int(ours(r, c)) * int(sizeof(Element));
            const int view_byte = int(swizzle(int(Transposed ? inner(c, r) : inner(r, c)) * int(sizeof(Element))));
            EXPECT(ours_byte == view_byte, "%s: (%d, %d) at byte %d, wgmma view at %d", name, r, c, ours_byte,
                   view_byte);
        }
    }
}

// A wgmma's shared-memory operands are partitioned by warpgroup only: every thread's slice of A (if
// from shared memory) and B equals its warpgroup's first thread's (flash::warpgroup_first_thread
// slices them so, keeping the descriptors in uniform registers).
template <typename TiledMma, int kM, int kN, int kK, bool A_in_smem>
void check_warpgroup_operands(const char *name, int threads) {
    TiledMma mma;
    for (int tid = 0; tid < threads; ++tid) {
        auto mine = mma.get_thread_slice(tid), first = mma.get_thread_slice(tid / 128 * 128);
        Tensor a = mine.partition_A(make_identity_tensor(Shape<Int<kM>, Int<kK>>{}));
        Tensor a0 = first.partition_A(make_identity_tensor(Shape<Int<kM>, Int<kK>>{}));
        Tensor b = mine.partition_B(make_identity_tensor(Shape<Int<kN>, Int<kK>>{}));
        Tensor b0 = first.partition_B(make_identity_tensor(Shape<Int<kN>, Int<kK>>{}));
        for (int i = 0; A_in_smem && i < int(size(a)); ++i) {
            EXPECT(a(i) == a0(i), "%s: tid %d's A element %d differs from its warpgroup's first thread's", name, tid, i);
        }
        for (int i = 0; i < int(size(b)); ++i) {
            EXPECT(b(i) == b0(i), "%s: tid %d's B element %d differs from its warpgroup's first thread's", name, tid, i);
        }
    }
}

// The wgmma specialisations are named explicitly (<..., true>): the kernels select them only in the
// sm_90a device pass, and this check runs on the host.
// A forward tile on wgmma: its score tile, P as the A operand of P V, and the shared-memory views.
template <typename Fwd>
void check_forward_wgmma(const char *name) {
    using Element = typename Fwd::Element;
    if constexpr (flash::kForwardWgmmaApplies<Fwd>) {
        using W = flash::ForwardWgmma<Fwd, true>;
        check_score_tile<typename W::TiledMmaS, Fwd::kBlockM, Fwd::kBlockN>(name, Fwd::kNThreads, true);
        check_p_as_a_operand<typename W::TiledMmaS, typename W::TiledMmaO, Fwd::kBlockM, Fwd::kBlockN>(
            name, Fwd::kNThreads);
        check_smem_view<Element, typename Fwd::SmemLayoutQ, typename W::SmemLayoutQ, false, Fwd::kBlockM,
                        Fwd::kHeadDim>(name);
        check_smem_view<Element, typename Fwd::SmemLayoutKV, typename W::SmemLayoutK, false, Fwd::kBlockN,
                        Fwd::kHeadDim>(name);
        check_smem_view<Element, typename Fwd::SmemLayoutKV, typename W::SmemLayoutVt, true, Fwd::kBlockN,
                        Fwd::kHeadDim>(name);
        check_warpgroup_operands<typename W::TiledMmaS, Fwd::kBlockM, Fwd::kBlockN, Fwd::kHeadDim, true>(
            name, Fwd::kNThreads);
        check_warpgroup_operands<typename W::TiledMmaO, Fwd::kBlockM, Fwd::kHeadDim, Fwd::kBlockN, false>(
            name, Fwd::kNThreads);
    }
}

// dq_accum's column order (dq_accum_col): a permutation of each row's columns that keeps adjacent
// pairs adjacent, and the sm90 path's staged dQ stores (two adjacent columns per lane) spread over
// the banks: 2 wavefronts per warp store, the least 256 bytes take (a row-major tile took 8).
template <typename TiledMma, int kM, int kHeadDim>
void check_dq_accum_order(const char *name, int threads, int max_wavefronts) {
    for (int row = 0; row < 8; ++row) {
        std::set<int> cols;
        for (int col = 0; col < kHeadDim; ++col) {
            const int c = flash::dq_accum_col(row, col);
            EXPECT(c >= 0 && c < kHeadDim, "%s: row %d col %d goes to %d", name, row, col, c);
            cols.insert(c);
            if (col % 2 == 0) {
                EXPECT(flash::dq_accum_col(row, col + 1) == c + 1, "%s: pair (%d, %d) split", name, col, col + 1);
            }
        }
        EXPECT(int(cols.size()) == kHeadDim, "%s: row %d's columns collide", name, row);
    }
    TiledMma mma;
    Tensor probe = partition_fragment_C(mma, Shape<Int<kM>, Int<kHeadDim>>{});
    for (int warp = 0; warp < threads / 32; ++warp) {
        for (int i = 0; i < int(size(probe)); i += 2) {
            int words_per_bank[32] = {};
            std::set<int> words;
            for (int lane = 0; lane < 32; ++lane) {
                Tensor tc = mma.get_thread_slice(warp * 32 + lane).partition_C(
                    make_identity_tensor(Shape<Int<kM>, Int<kHeadDim>>{}));
                const int row = get<0>(tc(i)), col = get<1>(tc(i));
                const int word = row * kHeadDim + flash::dq_accum_col(row, col);
                for (int w : {word, word + 1}) {
                    if (words.insert(w).second) { ++words_per_bank[w % 32]; }
                }
            }
            int wavefronts = 0;
            for (int b = 0; b < 32; ++b) { wavefronts = std::max(wavefronts, words_per_bank[b]); }
            EXPECT(wavefronts <= max_wavefronts, "%s: warp %d store %d takes %d wavefronts", name, warp, i, wavefronts);
        }
    }
}

template <typename Fwd, typename FwdDropout, typename Bwd>
void check_wgmma(int head_dim) {
    using Element = typename Fwd::Element;
    char name[64];
    std::snprintf(name, sizeof(name), "forward wgmma hdim%d", head_dim);
    check_forward_wgmma<Fwd>(name);
    if constexpr (flash::kForwardWgmmaApplies<FwdDropout>) {
        using W = flash::ForwardWgmma<FwdDropout, true>;
        std::snprintf(name, sizeof(name), "forward+dropout wgmma hdim%d", head_dim);
        check_score_tile<typename W::TiledMmaS, FwdDropout::kBlockM, FwdDropout::kBlockN>(
            name, FwdDropout::kNThreads, true);
        check_p_as_a_operand<typename W::TiledMmaS, typename W::TiledMmaO, FwdDropout::kBlockM,
                             FwdDropout::kBlockN>(name, FwdDropout::kNThreads);
    }
    if constexpr (flash::kBackwardWgmmaApplies<Bwd>) {
        using W = flash::BackwardWgmma<Bwd, true>;
        std::snprintf(name, sizeof(name), "backward wgmma hdim%d", head_dim);
        check_column_pairs<typename W::TiledMmadQ, Bwd::kBlockM, Bwd::kHeadDim>(name, Bwd::kNThreads);
        check_column_pairs<typename W::TiledMmadKV, Bwd::kBlockN, Bwd::kHeadDim>(name, Bwd::kNThreads);
        check_smem_view<Element, typename Bwd::SmemLayoutPdS, typename W::SmemLayoutPdSt, true, Bwd::kBlockM,
                        Bwd::kBlockN>(name);
        check_smem_view<Element, typename Bwd::SmemLayoutPdS, typename W::SmemLayoutdS, false, Bwd::kBlockM,
                        Bwd::kBlockN>(name);
        check_smem_view<Element, typename Bwd::SmemLayoutQdO, typename W::SmemLayoutQdOt, true, Bwd::kBlockM,
                        Bwd::kHeadDim>(name);
        check_smem_view<Element, typename Bwd::SmemLayoutKV, typename W::SmemLayoutKt, true, Bwd::kBlockN,
                        Bwd::kHeadDim>(name);
        check_dq_accum_order<typename W::TiledMmadQ, Bwd::kBlockM, Bwd::kHeadDim>(name, Bwd::kNThreads, 2);
        check_warpgroup_operands<typename W::TiledMmaSdP, Bwd::kBlockM, Bwd::kBlockN, Bwd::kHeadDim, true>(
            name, Bwd::kNThreads);
        check_warpgroup_operands<typename W::TiledMmadKV, Bwd::kBlockN, Bwd::kHeadDim, Bwd::kBlockM, true>(
            name, Bwd::kNThreads);
        check_warpgroup_operands<typename W::TiledMmadQ, Bwd::kBlockM, Bwd::kHeadDim, Bwd::kBlockN, true>(
            name, Bwd::kNThreads);
    }
}

// Two wgmma views (swizzles of byte addresses) of one tile, A indexed (row, col) and B (col, row),
// address the same byte for every element.
template <typename Element, typename ViewA, typename ViewB, int kRows, int kCols>
void check_transposed_views(const char *name) {
    ViewA a;
    ViewB b;
    for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kCols; ++c) {
            const int a_byte = int(a.layout_a()(int(a.layout_b()(r, c)) * int(sizeof(Element))));
            const int b_byte = int(b.layout_a()(int(b.layout_b()(c, r)) * int(sizeof(Element))));
            EXPECT(a_byte == b_byte, "%s: (%d, %d) at byte %d, transposed view at %d", name, r, c, a_byte, b_byte);
        }
    }
}

// Pair stores of an accumulator tile (two adjacent columns a lane) into a staging buffer: every
// element staged once, 4-byte aligned, a warp's 32 lanes on 32 banks. owner(tid, row, col, byte)
// checks where the caller's staging puts it.
template <typename TiledMma, typename Element, int kRows, int kCols, typename StageByte, typename Owner>
void check_pair_staging(const char *name, int threads, StageByte stage_byte, Owner owner) {
    static bool written[kRows][kCols];
    for (auto &row : written) { std::fill(std::begin(row), std::end(row), false); }
    Tensor probe = TiledMma{}.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
    for (int tid = 0; tid < threads; tid += 32) {
        for (int i = 0; i < int(size(probe)); i += 2) {
            bool bank_used[32] = {};
            for (int lane = 0; lane < 32; ++lane) {
                Tensor c = TiledMma{}.get_thread_slice(tid + lane).partition_C(
                    make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
                const int row = get<0>(c(i)), col = get<1>(c(i));
                const int byte = stage_byte(row, col);
                EXPECT(get<0>(c(i + 1)) == row && get<1>(c(i + 1)) == col + 1, "%s: pair %d split", name, i);
                EXPECT(byte % 4 == 0 && byte >= 0, "%s: (%d, %d) staged at byte %d", name, row, col, byte);
                owner(tid + lane, row, col, byte);
                EXPECT(!written[row][col] && !written[row][col + 1], "%s: (%d, %d) staged twice", name, row, col);
                written[row][col] = written[row][col + 1] = true;
                const int bank = byte / 4 % 32;
                EXPECT(!bank_used[bank], "%s: tid %d pair %d hits bank %d twice in its warp", name, tid + lane, i, bank);
                bank_used[bank] = true;
            }
        }
    }
    for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kCols; ++c) { EXPECT(written[r][c], "%s: (%d, %d) never staged", name, r, c); }
    }
}

// The staged epilogue (fwd_ws_epilogue.h): each consumer thread writes its O pairs into its own
// consumer's 64-row tile, every element to a byte of its own, where a 128-byte-swizzled TMA box
// of 64 columns has it: 8-row atoms of 128-byte rows whose 16-byte chunks are permuted by the row
// (chunk ^ row % 8), column blocks of 64 after one another.
template <typename Ws>
void check_o_staging(const char *name) {
    constexpr int kTileBytes = 64 * Ws::kHeadDim * int(sizeof(typename Ws::Element));
    static_assert(sizeof(typename Ws::Element) == 2);
    static bool byte_used[Ws::kConsumers][kTileBytes];
    for (auto &tile : byte_used) { std::fill(std::begin(tile), std::end(tile), false); }
    auto swizzled_byte = [](int row, int col) {
        return col / 64 * 64 * 128 + row * 128 + ((col % 64 / 8) ^ (row % 8)) * 16 + col % 8 * 2;
    };
    check_pair_staging<typename Ws::TiledMmaO, typename Ws::Element, Ws::kBlockM, Ws::kHeadDim>(
        name, Ws::kConsumerThreads, [](int row, int col) { return flash::ws_o_stage_byte<Ws>(row, col); },
        [&](int tid, int row, int col, int byte) {
            const int consumer = tid / 128;
            EXPECT(row / 64 == consumer, "%s: tid %d writes row %d, consumer %d's rows are %d-%d", name, tid, row,
                   consumer, 64 * consumer, 64 * consumer + 63);
            EXPECT(byte + 4 <= kTileBytes, "%s: row %d staged past its consumer's tile", name, row);
            for (int e = 0; e < 2; ++e) {
                const int stored = swizzled_byte(row % 64, col + e);
                EXPECT(stored == byte + 2 * e, "%s: (%d, %d) staged at byte %d, the TMA box has it at %d", name,
                       row, col + e, byte + 2 * e, stored);
            }
            EXPECT(!byte_used[consumer][byte] && !byte_used[consumer][byte + 2],
                   "%s: byte %d of consumer %d staged twice", name, byte, consumer);
            byte_used[consumer][byte] = byte_used[consumer][byte + 2] = true;
        });
}

// The warp-specialised backward's staged dK / dV (bwd_ws_store_dkv_staged): the key block's tile in
// rows of its own, 16-byte aligned (bulk copies), both tiles within the Q/dO ring and dS buffers.
template <typename Ws>
void check_dkv_staging(const char *name) {
    constexpr int kN = Ws::kBlockN, kRowBytes = Ws::kDkvRowBytes;
    static_assert(Ws::kStagedDkv);
    using Storage = typename Ws::SharedStorage;
    EXPECT(kRowBytes % 16 == 0 && 2 * kN * kRowBytes <= int(sizeof(Storage::q) + sizeof(Storage::dout) + sizeof(Storage::ds)),
           "%s: staging rows of %d bytes", name, kRowBytes);
    check_pair_staging<typename Ws::TiledMmadKV, typename Ws::Element, kN, Ws::kHeadDim>(
        name, Ws::kConsumerThreads, [](int row, int col) { return flash::bwd_dkv_stage_byte<Ws>(row, col); },
        [&](int, int row, int col, int byte) {
            EXPECT(byte / kRowBytes == row && byte % kRowBytes + 4 <= Ws::kHeadDim * int(sizeof(typename Ws::Element)),
                   "%s: (%d, %d) staged in row %d at byte %d of it", name, row, col, byte / kRowBytes,
                   byte % kRowBytes);
        });
}

// The warp-specialised forward's tiles (WsForwardTile, default and wide): every S element held
// once, P read back as the A operand of P V element for element, the O pairs, and V's view as P V's
// B operand on the bytes TMA writes, in every stage.
template <int kHeadDim, bool Wide, bool Is_masked>
void check_forward_ws() {
    using Tile = flash::WsForwardTile<kHeadDim, Wide, Is_masked>;
    using Ws = flash::ForwardWs<kHeadDim, cutlass::bfloat16_t, Tile::kConsumers, Tile::kBlockN>;
    char name[64];
    std::snprintf(name, sizeof(name), "forward ws hdim%d%s%s", kHeadDim, Wide ? " wide" : "",
                  Is_masked ? " masked" : "");
    check_score_tile<typename Ws::TiledMmaS, Ws::kBlockM, Ws::kBlockN>(name, Ws::kConsumerThreads, false);
    check_p_as_a_operand<typename Ws::TiledMmaS, typename Ws::TiledMmaO, Ws::kBlockM, Ws::kBlockN>(
        name, Ws::kConsumerThreads);
    check_column_pairs<typename Ws::TiledMmaO, Ws::kBlockM, kHeadDim>(name, Ws::kConsumerThreads);
    check_warpgroup_operands<typename Ws::TiledMmaS, Ws::kBlockM, Ws::kBlockN, kHeadDim, true>(name, Ws::kConsumerThreads);
    check_warpgroup_operands<typename Ws::TiledMmaO, Ws::kBlockM, kHeadDim, Ws::kBlockN, false>(name, Ws::kConsumerThreads);
    using Element = cutlass::bfloat16_t;
    // The default tiles at d64 / d128 stage O: two tiles a consumer fit beside Q and the K/V ring.
    EXPECT(Ws::kStagedO || Wide || kHeadDim > 128, "%s: O not staged (%d bytes of shared memory staged)", name,
           int(sizeof(typename Ws::template SharedStorageOf<true>)));
    if constexpr (Ws::kStagedO) { check_o_staging<Ws>(name); }
    check_transposed_views<Element, typename Ws::SmemLayoutKV, typename Ws::SmemLayoutVt, Ws::kBlockN, kHeadDim>(name);
    typename Ws::SmemLayoutKVStages stages;  // what TMA writes: stage s at s * kTileElems
    typename Ws::SmemLayoutKV stage;         // what the consumers read at that offset
    for (int st = 0; st < Ws::kStages; ++st) {
        for (int r = 0; r < Ws::kBlockN; ++r) {
            for (int c = 0; c < kHeadDim; ++c) {
                const int written = int(stages.layout_a()(int(stages.layout_b()(r, c, st)) * int(sizeof(Element))));
                const int read = int(stage.layout_a()(int(stage.layout_b()(r, c)) * int(sizeof(Element)))) +
                                 st * Ws::kTileElems * int(sizeof(Element));
                EXPECT(written == read, "%s: stage %d (%d, %d) written at byte %d, read at %d", name, st, r, c,
                       written, read);
            }
        }
    }
}

// The dropout mask drawn on an S^T tile (apply_transposed: the warp-specialised backward) equals
// the one the forward draws on the S tile of the same queries and keys, element for element.
template <typename TiledMmaS, int kThreadsS, typename TiledMmaSt, int kThreadsSt, int kQueries, int kKeys>
void check_transposed_dropout(const char *name) {
    flash::AttentionParams params;
    params.heads = 3;
    params.seqlen_q_rounded = 4 * kQueries;
    params.dropout_keep_threshold = 1u << 15;  // keep half
    for (int trial = 0; trial < 3; ++trial) {
        const int m_block = trial, n_block = 2 - trial, bidb = trial % 2, bidh = trial;
        const flash::Dropout dropout(params, 0x1234567ull + trial, 4096ull * trial, bidb, bidh);
        static bool kept_s[kQueries][kKeys], kept_st[kQueries][kKeys];
        for (int tid = 0; tid < kThreadsS; ++tid) {  // the forward: S (queries, keys)
            auto thr = TiledMmaS{}.get_thread_slice(tid);
            Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kQueries>, Int<kKeys>>{}));
            Tensor p = partition_fragment_C(TiledMmaS{}, Shape<Int<kQueries>, Int<kKeys>>{});
            fill(p, 1.f);
            Tensor rc = make_tensor(c.data(), flash::acc_as_rowcol(c.layout()));
            Tensor prc = make_tensor(p.data(), flash::acc_as_rowcol(p.layout()));
            dropout.apply<false, false>(prc, rc, m_block * kQueries, n_block * kKeys, tid % 32,
                                        static_cast<cutlass::bfloat16_t *>(nullptr), 0);
            for (int i = 0; i < int(size(p)); ++i) { kept_s[get<0>(c(i))][get<1>(c(i))] = p(i) != 0.f; }
        }
        for (int tid = 0; tid < kThreadsSt; ++tid) {  // the backward: S^T (keys, queries)
            auto thr = TiledMmaSt{}.get_thread_slice(tid);
            Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kKeys>, Int<kQueries>>{}));
            Tensor p = partition_fragment_C(TiledMmaSt{}, Shape<Int<kKeys>, Int<kQueries>>{});
            fill(p, 1.f);
            Tensor rc = make_tensor(c.data(), flash::acc_as_rowcol(c.layout()));
            Tensor prc = make_tensor(p.data(), flash::acc_as_rowcol(p.layout()));
            dropout.apply_transposed<false>(prc, rc, n_block * kKeys, m_block * kQueries, tid % 32);
            for (int i = 0; i < int(size(p)); ++i) { kept_st[get<1>(c(i))][get<0>(c(i))] = p(i) != 0.f; }
        }
        int differ = 0, kept = 0;
        for (int q = 0; q < kQueries; ++q) {
            for (int k = 0; k < kKeys; ++k) {
                differ += kept_s[q][k] != kept_st[q][k];
                kept += kept_s[q][k];
            }
        }
        EXPECT(differ == 0, "%s: trial %d, %d of %d elements dropped differently from the forward", name, trial,
               differ, kQueries * kKeys);
        EXPECT(kept > kQueries * kKeys / 3 && kept < 2 * kQueries * kKeys / 3, "%s: trial %d kept %d of %d", name,
               trial, kept, kQueries * kKeys);
    }
}

// The warp-specialised backward (keys as the M dimension of S^T and dP^T). d256 (kSplitHeadDim):
// P^T goes through shared memory, written and read in SmemLayoutdSt like dS^T, so there is no
// register hand-over to check; its dK / dV operands both come from shared memory.
template <int kHeadDim>
void check_backward_ws() {
    using Element = cutlass::bfloat16_t;
    using Ws = flash::BackwardWs<kHeadDim, Element>;
    constexpr int kM = Ws::kBlockM, kN = Ws::kBlockN, kThreads = Ws::kConsumerThreads;
    char name[64];
    std::snprintf(name, sizeof(name), "backward ws hdim%d", kHeadDim);
    check_score_tile<typename Ws::TiledMmaSdP, kN, kM>(name, kThreads, false);
    for (int tid = 0; tid < kThreads; ++tid) {  // the kernel's (query, key) view of S^T's registers
        auto thr = typename Ws::TiledMmaSdP{}.get_thread_slice(tid);
        Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kN>, Int<kM>>{}));
        Tensor qk = thr.partition_C(
            make_coord_tensor(make_layout(Shape<Int<kN>, Int<kM>>{}, make_stride(E<1>{}, E<0>{}))));
        Tensor rc = make_tensor(c.data(), flash::acc_as_rowcol(c.layout()));
        Tensor view = flash::transposed_rowcol(qk);
        for (int r = 0; r < int(size<0>(view)); ++r) {
            for (int col = 0; col < int(size<1>(view)); ++col) {
                EXPECT(get<0>(view(r, col)) == get<1>(rc(col, r)) && get<1>(view(r, col)) == get<0>(rc(col, r)),
                       "%s: tid %d (query, key) view (%d, %d) holds (%d, %d), S^T has (%d, %d)", name, tid, r, col,
                       int(get<0>(view(r, col))), int(get<1>(view(r, col))), int(get<0>(rc(col, r))),
                       int(get<1>(rc(col, r))));
            }
        }
    }
    if constexpr (!Ws::kSplitHeadDim) {
        check_p_as_a_operand<typename Ws::TiledMmaSdP, typename Ws::TiledMmadKV, kN, kM>(name, kThreads);
    }
    using Fwd = flash::ForwardTraits<kHeadDim, 128, 128, 4, Element>;  // any m16n8 S tile draws the same mask
    check_transposed_dropout<typename Fwd::TiledMma, Fwd::kNThreads, typename Ws::TiledMmaSdP, kThreads, kM, kN>(name);
    check_column_pairs<typename Ws::TiledMmadKV, kN, kHeadDim>(name, kThreads);
    check_column_pairs<typename Ws::TiledMmadQ, kM, kHeadDim>(name, kThreads);
    check_dq_accum_order<typename Ws::TiledMmadQ, kM, kHeadDim>(name, kThreads, 2);
    check_transposed_views<Element, typename Ws::SmemLayoutdSt, typename Ws::SmemLayoutdS, kN, kM>(name);
    check_transposed_views<Element, typename Ws::SmemLayoutQdO, typename Ws::SmemLayoutQdOt, kM, kHeadDim>(name);
    check_transposed_views<Element, typename Ws::SmemLayoutKV, typename Ws::SmemLayoutKt, kN, kHeadDim>(name);
    // d64: K and V (A) in registers, so only B must be the warpgroup's.
    check_warpgroup_operands<typename Ws::TiledMmaSdP, kN, kM, kHeadDim, !Ws::kKVInRegs>(name, kThreads);
    check_warpgroup_operands<typename Ws::TiledMmadKV, kN, kHeadDim, kM, Ws::kSplitHeadDim>(name, kThreads);
    check_warpgroup_operands<typename Ws::TiledMmadQ, kM, kHeadDim, kN, true>(name, kThreads);
    if constexpr (Ws::kStagedDkv) { check_dkv_staging<Ws>(name); }
    EXPECT(Ws::kStagedDkv, "%s: dK / dV not staged", name);
}

// The decode tile (64 query rows, one warpgroup) on both MMA paths.
template <int kHeadDim>
void check_decode_tile() {
    using Element = cutlass::bfloat16_t;
    using Tile = flash::DecodeTile<kHeadDim>;
    using Fwd = flash::ForwardTraits<kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kNWarps, Element>;
    char name[64];
    std::snprintf(name, sizeof(name), "decode hdim%d", kHeadDim);
    check_score_tile<typename Fwd::TiledMma, Fwd::kBlockM, Fwd::kBlockN>(name, Fwd::kNThreads, true);
    check_p_as_a_operand<typename Fwd::TiledMma, typename Fwd::TiledMma, Fwd::kBlockM, Fwd::kBlockN>(name,
                                                                                                    Fwd::kNThreads);
    EXPECT(Fwd::kSmemSize <= 227 * 1024 / 2, "decode hdim%d needs %d bytes of shared memory (two CTAs per SM)",
           kHeadDim, Fwd::kSmemSize);
    std::snprintf(name, sizeof(name), "decode wgmma hdim%d", kHeadDim);
    check_forward_wgmma<Fwd>(name);
}

template <int kHeadDim>
void check_head_dim() {
    using Element = cutlass::bfloat16_t;
    using FTile = flash::ForwardTile<kHeadDim, false>;
    using FTileDropout = flash::ForwardTile<kHeadDim, true>;
    using Fwd = flash::ForwardTraits<kHeadDim, FTile::kBlockM, FTile::kBlockN, FTile::kNWarps, Element>;
    using FwdDropout = flash::ForwardTraits<kHeadDim, FTileDropout::kBlockM, FTileDropout::kBlockN,
                                            FTileDropout::kNWarps, Element>;
    using BTile = flash::BackwardTile<kHeadDim>;
    using Bwd = flash::BackwardTraits<kHeadDim, BTile::kBlockM, BTile::kBlockN, BTile::kNWarps, BTile::kWarpsMSdP,
                                      BTile::kWarpsNdKV, BTile::kWarpsMdQ, Element>;
    char name[64];
    std::snprintf(name, sizeof(name), "forward hdim%d", kHeadDim);
    check_score_tile<typename Fwd::TiledMma, Fwd::kBlockM, Fwd::kBlockN>(name, Fwd::kNThreads, true);
    std::snprintf(name, sizeof(name), "forward+dropout hdim%d", kHeadDim);
    check_score_tile<typename FwdDropout::TiledMma, FwdDropout::kBlockM, FwdDropout::kBlockN>(
        name, FwdDropout::kNThreads, true);
    std::snprintf(name, sizeof(name), "backward hdim%d", kHeadDim);
    check_score_tile<typename Bwd::TiledMmaSdP, Bwd::kBlockM, Bwd::kBlockN>(name, Bwd::kNThreads, false);
    constexpr int kBwdSmem = Bwd::kSmemSize + flash::kSmemRowStatsSize<Bwd> + flash::kSmemDqSize<Bwd>;
    EXPECT(kBwdSmem <= 227 * 1024, "backward hdim%d needs %d bytes of shared memory", kHeadDim, kBwdSmem);
    std::snprintf(name, sizeof(name), "backward dQ hdim%d", kHeadDim);
    check_column_pairs<typename Bwd::TiledMmadQ, Bwd::kBlockM, kHeadDim>(name, Bwd::kNThreads);
    std::snprintf(name, sizeof(name), "backward dK/dV hdim%d", kHeadDim);
    check_column_pairs<typename Bwd::TiledMmadKV, Bwd::kBlockN, kHeadDim>(name, Bwd::kNThreads);
    EXPECT(Fwd::kSmemSize <= 227 * 1024, "forward hdim%d needs %d bytes of shared memory", kHeadDim, Fwd::kSmemSize);
    std::snprintf(name, sizeof(name), "forward P hdim%d", kHeadDim);
    check_p_as_a_operand<typename Fwd::TiledMma, typename Fwd::TiledMma, Fwd::kBlockM, Fwd::kBlockN>(name,
                                                                                                    Fwd::kNThreads);
    check_wgmma<Fwd, FwdDropout, Bwd>(kHeadDim);
    check_decode_tile<kHeadDim>();
}

void check_philox() {
    struct Case { uint32_t ctr[4], key[2], out[4]; };
    const Case cases[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (const Case &c : cases) {
        const uint64_t seed = (uint64_t(c.key[1]) << 32) | c.key[0];
        const uint64_t counter_lo = (uint64_t(c.ctr[1]) << 32) | c.ctr[0];
        const uint64_t counter_hi = (uint64_t(c.ctr[3]) << 32) | c.ctr[2];
        const uint4 r = flash::philox4x32_10(seed, counter_hi, counter_lo);
        EXPECT(r.x == c.out[0] && r.y == c.out[1] && r.z == c.out[2] && r.w == c.out[3],
               "philox(ctr %08x...) = %08x %08x %08x %08x", c.ctr[0], r.x, r.y, r.z, r.w);
    }
}

int main() {
    check_philox();
    check_head_dim<32>();
    check_head_dim<64>();
    check_head_dim<96>();
    check_head_dim<128>();
    check_head_dim<160>();
    check_head_dim<192>();
    check_head_dim<224>();
    check_head_dim<256>();
    check_backward_ws<64>();
    check_backward_ws<128>();
    check_backward_ws<256>();
    check_forward_ws<64, false, false>();
    check_forward_ws<64, true, false>();
    check_forward_ws<128, false, false>();
    check_forward_ws<128, true, false>();
    check_forward_ws<192, true, false>();
    check_forward_ws<256, false, true>();
    check_forward_ws<256, true, true>();
    if (failures) {
        std::printf("FAILED: %d mismatches\n", failures);
        return 1;
    }
    std::printf("OK\n");
    return 0;
}
