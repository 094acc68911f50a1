// Splitting a range of weight-row units between the threads of a parallel region so that
// neither waits long at its end, while each still streams long contiguous runs of rows.
//
// The few-row linears (quant_linear.cpp, skinny_linear.cpp) are a stream over their weight.
// With at::parallel_for's static equal shares, one thread waits for the other at every
// join: the worker starts each region later than the thread that opened it (its wake-up),
// and two threads' memory streams do not run at the same speed. Measured with perf on a
// 2-core Xeon (AVX-512, AMX), batch-1 decode of a Q4_1 model, ~5 such regions per layer:
// the opening thread spent ~12% of its time spinning at the end of the regions, the worker
// ~28% spinning (~8% of it at the join).
//
// Here each thread still owns an equal contiguous share and walks it front to back in
// chunks of a few KiB of weight (so its prefetches ahead run over one long stream); a thread
// done with its own share takes chunks from the back of another's, until the two ends meet.
// Short scattered pieces for every thread would cost more than the wait: the kernels (and
// the hardware prefetcher) need a long run to stream at full speed.
//
// Measured on the same machine (alternated runs of the same decode): the opening thread
// took ~1.7% of the rows from the back of the worker's share, the worker ~0.9% from the
// opening thread's, so the equal shares were already close to even there, and the decode
// step moved by +0.5..1.5% (median; Q4_1, 30 alternations), the dense fp32 / bf16 one by
// less than 1%. Chunks of 8 or 32 KiB measured as 16 KiB within the noise; 64 KiB ~4%
// slower in one run.
//
// Claims are exact: each share's [front, back) is one 64-bit atomic (front in the high half,
// back in the low half), and every claim is a compare-exchange that moves one end by at most
// a chunk, never past the other. The claimed ranges are therefore disjoint and, once every
// share is empty, cover the range. Every share has an owner that empties it before it
// leaves the region, so the range is done even where the region runs on fewer threads than
// asked (nested in another region, or one thread: then a single call does it all).
// Relaxed ordering suffices: the claims only pick who computes an output row, and the
// region's join orders the rows' writes before the caller reads them.
//
// Inside a decode stack's team (team.h) the threads are the team's: `parallel_for` hands the
// loop to them as one task instead of opening an OpenMP region.
//
// Included inside a kernel source's ISA namespace (like the other headers here): each ISA's
// copy has its own, which keeps the copies' code apart.
#pragma once

#include <ATen/Parallel.h>

#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

PLUGSERVE_ISA_BEGIN
namespace work_share {

// Threads a parallel loop started here runs on: the team's inside one, else ATen's.
inline int64_t threads() {
  const team::Team* tm = team::current();
  return tm != nullptr ? team::size(tm) : std::max(at::get_num_threads(), 1);
}

// at::parallel_for(begin, end, grain, f), on the calling thread's team where it has one (the
// same split into one contiguous range per thread as ATen's OpenMP backend).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  team::Team* tm = team::current();
  if (tm == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (begin >= end) return;
  const int64_t n = end - begin;
  const int64_t count =
      std::min<int64_t>(team::size(tm), grain > 0 ? (n + grain - 1) / grain : n);
  if (count <= 1) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + count - 1) / count;
  const auto task = [&](int thread) {
    const int64_t first = begin + thread * chunk;
    if (thread < count && first < end) f(first, std::min(end, first + chunk));
  };
  using Task = decltype(task);
  team::run(tm, [](void* ctx, int thread) { (*static_cast<const Task*>(ctx))(thread); },
            const_cast<void*>(static_cast<const void*>(&task)));
}

// Weight bytes per claim: a few rows of a decode-size matrix (one claim per ~µs of stream).
constexpr int64_t kChunkBytes = 16384;

// Units per chunk for units of `unit_bytes` of weight each (at least one).
inline int64_t chunk_units(int64_t unit_bytes, int64_t chunk_bytes = kChunkBytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(unit_bytes, 1));
}

// One thread's share [front, back), packed into one word so a claim moves an end atomically.
struct alignas(64) Share {  // a cache line each: the owner's claims do not bounce the other's
  std::atomic<uint64_t> ends{0};
};

inline uint64_t pack(uint64_t front, uint64_t back) { return front << 32 | back; }

// The next chunk of `s` from its front (the owner's walk) or its back (another thread's):
// true with [begin, end) claimed, false once the share is empty. `limit` is then the share's
// back as the claim found it (the front walk may prefetch up to it).
inline bool claim(Share& s, bool from_front, int64_t chunk, int64_t& begin, int64_t& end,
                  int64_t& limit) {
  uint64_t v = s.ends.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = v >> 32, back = v & 0xFFFFFFFFu;
    if (front >= back) return false;
    const uint64_t step = std::min<uint64_t>(static_cast<uint64_t>(chunk), back - front);
    const uint64_t next = from_front ? pack(front + step, back) : pack(front, back - step);
    if (s.ends.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
      begin = static_cast<int64_t>(from_front ? front : back - step);
      end = begin + static_cast<int64_t>(step);
      limit = static_cast<int64_t>(back);
      return true;
    }
  }
}

// One call's units [begin, end). `stop` (>= end) bounds how far past `end` the call may
// prefetch: the end of the run its thread walks front to back (its own share, as far as
// nobody has taken its back), or `end` for a chunk taken from another's back. `resumed`:
// the thread's previous call ended at `begin` and prefetched on from there, so the start of
// this one is on its way already.
struct Run {
  int64_t begin, end, stop;
  bool resumed;
};

// Calls fn(Run) over disjoint runs that together cover [0, n), from the threads of one
// parallel region, in chunks of `chunk` units. A call computes its units exactly as if it
// had the whole range: only which thread computes a unit changes.
template <typename Fn>
void for_each_chunk(int64_t n, int64_t chunk, const Fn& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t threads = std::min<int64_t>(work_share::threads(), (n + chunk - 1) / chunk);
  // One thread, too few units to split, or inside a parallel region that is not a team's.
  if (threads <= 1 || (team::current() == nullptr && at::in_parallel_region())) {
    fn(Run{0, n, n, false});
    return;
  }
  if (n > std::numeric_limits<uint32_t>::max()) {  // more units than a packed end holds
    parallel_for(0, n, chunk,
                 [&](int64_t begin, int64_t end) { fn(Run{begin, end, end, false}); });
    return;
  }
  constexpr int64_t kOnStack = 16;  // no allocation per call on small machines
  Share on_stack[kOnStack];
  std::vector<Share> on_heap(threads > kOnStack ? threads : 0);
  Share* shares = threads > kOnStack ? on_heap.data() : on_stack;
  for (int64_t t = 0; t < threads; ++t)
    shares[t].ends.store(pack(n * t / threads, n * (t + 1) / threads), std::memory_order_relaxed);
  parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    int64_t begin, end, limit, previous_end = -1;
    for (int64_t t = first; t < last; ++t) {  // its own share(s), front to back
      while (claim(shares[t], true, chunk, begin, end, limit)) {
        fn(Run{begin, end, limit, begin == previous_end});
        previous_end = end;
      }
    }
    for (int64_t i = 1; i < threads; ++i) {  // then the others', from their backs
      Share& other = shares[(last - 1 + i) % threads];
      while (claim(other, false, chunk, begin, end, limit)) fn(Run{begin, end, end, false});
    }
  });
}

}  // namespace work_share
PLUGSERVE_ISA_END
