// The team of team.h: one OpenMP region, tasks handed out through two counters, and the
// waiting threads' read-ahead.
#include "team.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace plugserve::team {

// The master (thread 0) publishes a task by writing fn / ctx, zeroing `done` and moving
// `task` on (release); a worker that sees `task` move runs it and counts itself in `done`.
// `stopping` with a last move of `task` ends the workers' loops. The read-ahead ranges are a
// sequence lock: `hint` odd while the master rewrites them.
struct Team {
  int threads = 1;
  TaskFn fn = nullptr;
  void* ctx = nullptr;
  alignas(64) std::atomic<uint64_t> task{0};
  alignas(64) std::atomic<int> done{0};
  std::atomic<bool> stopping{false};
  alignas(64) std::atomic<uint64_t> hint{0};
  std::atomic<const void*> range_data[kMaxRanges] = {};
  std::atomic<int64_t> range_bytes[kMaxRanges] = {};
  std::atomic<int> range_count{0};
  std::mutex error_mutex;
  std::exception_ptr error;  // the first exception a task threw, until `run` rethrows it

  void keep_error() {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error) error = std::current_exception();
  }
};

namespace {

thread_local Team* tl_team = nullptr;
std::atomic<int64_t> g_prefetched_bytes{0};
std::atomic<bool> g_enabled{true};

// One wait of a spin loop: a pause, and after kSpinsBeforeYield of them in a row a yield of
// the core (more threads than cores: the thread waited for may need it).
constexpr int kSpinsBeforeYield = 4096;
inline void relax(int& spins) {
  if (++spins >= kSpinsBeforeYield) {
    spins = 0;
    std::this_thread::yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

constexpr int64_t kLine = 64;
constexpr int64_t kStepBytes = 4096;  // read between two looks at the task counter

// A waiting thread's read-ahead: its share of the posted ranges, laid end to end.
struct ReadAhead {
  uint64_t hint = 0;  // the hint these ranges came from (0: none yet)
  Range ranges[kMaxRanges] = {};
  int count = 0;
  int64_t pos = 0, stop = 0;  // bytes into the ranges laid end to end
  int64_t bytes_read = 0;

  // Takes the team's ranges if they moved since the last look (not while being rewritten:
  // the next look takes them).
  void refresh(Team& tm, int thread, int threads) {
    const uint64_t h = tm.hint.load(std::memory_order_acquire);
    if (h == hint || (h & 1) != 0) return;
    Range copy[kMaxRanges];
    const int n = std::clamp(tm.range_count.load(std::memory_order_relaxed), 0, kMaxRanges);
    for (int i = 0; i < n; ++i) {
      copy[i] = Range{tm.range_data[i].load(std::memory_order_relaxed),
                      tm.range_bytes[i].load(std::memory_order_relaxed)};
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (tm.hint.load(std::memory_order_relaxed) != h) return;  // rewritten meanwhile
    hint = h;
    count = n;
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      ranges[i] = copy[i];
      total += std::max<int64_t>(copy[i].bytes, 0);
    }
    pos = total * thread / threads;
    stop = std::min(total * (thread + 1) / threads, pos + kPrefetchBytes);
  }

  // Reads up to kStepBytes of the share, one (volatile, so kept) load per cache line; false
  // once the share is read.
  bool step() {
    if (pos >= stop) return false;
    int64_t start = 0;
    for (int i = 0; i < count && pos < stop; start += ranges[i].bytes, ++i) {
      const int64_t end = start + ranges[i].bytes;
      if (pos >= end) continue;
      const int64_t upto = std::min({end, stop, pos + kStepBytes});
      const auto* base = static_cast<const volatile unsigned char*>(ranges[i].data);
      for (int64_t b = pos; b < upto; b += kLine) (void)base[b - start];
      bytes_read += upto - pos;
      pos = upto;
      break;
    }
    return true;
  }
};

// A worker's loop: each task once, reading ahead while none is waiting, until stopped.
void work(Team& tm, int thread, int threads) {
  uint64_t seen = 0;
  int spins = 0;
  ReadAhead ahead;
  for (;;) {
    const uint64_t task = tm.task.load(std::memory_order_acquire);
    if (task != seen) {
      seen = task;
      if (tm.stopping.load(std::memory_order_acquire)) break;
      try {
        tm.fn(tm.ctx, thread);
      } catch (...) {
        tm.keep_error();
      }
      tm.done.fetch_add(1, std::memory_order_release);
      spins = 0;
      continue;
    }
    ahead.refresh(tm, thread, threads);
    if (!ahead.step()) relax(spins);
  }
  g_prefetched_bytes.fetch_add(ahead.bytes_read, std::memory_order_relaxed);
}

}  // namespace

Team* current() { return tl_team; }

int size(const Team* team) { return team == nullptr ? 1 : team->threads; }

void run(Team* team, TaskFn fn, void* ctx) {
  TORCH_CHECK(team != nullptr && team == tl_team, "team::run: called outside the team's "
              "thread");
  Team& tm = *team;
  tm.fn = fn;
  tm.ctx = ctx;
  tm.done.store(0, std::memory_order_relaxed);
  tm.task.fetch_add(1, std::memory_order_release);
  tl_team = nullptr;  // a parallel loop inside the task runs inline
  try {
    fn(ctx, 0);
  } catch (...) {
    tm.keep_error();
  }
  tl_team = team;
  int spins = 0;
  while (tm.done.load(std::memory_order_acquire) != tm.threads - 1) relax(spins);
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(tm.error_mutex);
    std::swap(error, tm.error);
  }
  if (error) std::rethrow_exception(error);
}

void prefetch(Team* team, const Range* ranges, int count) {
  if (team == nullptr || team != tl_team) return;
  count = std::clamp(count, 0, kMaxRanges);
  Team& tm = *team;
  const uint64_t h = tm.hint.load(std::memory_order_relaxed);
  tm.hint.store(h + 1, std::memory_order_relaxed);  // odd: being rewritten
  std::atomic_thread_fence(std::memory_order_release);
  for (int i = 0; i < count; ++i) {
    tm.range_data[i].store(ranges[i].data, std::memory_order_relaxed);
    tm.range_bytes[i].store(ranges[i].bytes, std::memory_order_relaxed);
  }
  tm.range_count.store(count, std::memory_order_relaxed);
  tm.hint.store(h + 2, std::memory_order_release);
}

void with_team(const std::function<void()>& body) {
  const int threads = at::get_num_threads();
  if (!g_enabled.load(std::memory_order_relaxed) || threads <= 1 || at::in_parallel_region() ||
      tl_team != nullptr) {
    body();
    return;
  }
  Team tm;
  std::exception_ptr body_error;
#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num(), count = omp_get_num_threads();
    if (thread == 0) {
      tm.threads = count;
      tl_team = count > 1 ? &tm : nullptr;
      try {
        body();
      } catch (...) {
        body_error = std::current_exception();
      }
      tl_team = nullptr;
      tm.stopping.store(true, std::memory_order_relaxed);
      tm.task.fetch_add(1, std::memory_order_release);
    } else {
      work(tm, thread, count);
    }
  }
  if (body_error) std::rethrow_exception(body_error);
}

bool set_enabled(bool enabled) { return g_enabled.exchange(enabled); }

int64_t prefetched_bytes() { return g_prefetched_bytes.load(std::memory_order_relaxed); }

}  // namespace plugserve::team
