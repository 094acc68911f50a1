// One OpenMP region for a whole few-row decode stack call, with a thread that streams the
// next weights while the calling thread runs the serial work between the kernels.
//
// A batch-1 decode step of a small model runs ~5 parallel kernels per layer (the linears and
// the attention), each its own OpenMP region, with serial work between them (norms, rope, the
// KV store, x rounded to int8, tensor bookkeeping). Measured with perf on a 2-core Xeon
// (AVX-512, no AMX), a Q4_1 SmolLM2-135M: the second thread waited ~30% of the decoder
// stack's time, and nothing was read from memory meanwhile.
//
// `with_team(body)` runs `body` on the calling thread inside one OpenMP region whose other
// threads wait in a spin loop for the tasks the body hands out (`run`): the kernels' parallel
// loops (work_share.h's for_each_chunk, team_parallel_for) go to them instead of opening
// regions of their own. Between tasks a waiting thread reads ahead: the weight ranges
// `prefetch` names (the next projection's) from where that thread's share of it starts, into
// its cache, until the next task arrives. Which thread computes a unit of work never changes
// a result (every kernel that runs here computes each output alone, or merges its pieces in
// a fixed order), so a stack call in a team gives the same values bit for bit.
//
// Compiled once with the baseline flags (team.cpp): the ISA copies of the kernels call these
// functions and never share inline code with each other.
#pragma once

#include <cstdint>
#include <functional>

namespace plugserve::team {

struct Team;

// The team of the calling thread (the one running a `with_team` body), else nullptr. Inside
// a task, and on any other thread, nullptr: a nested parallel loop runs inline.
Team* current();

// Threads of `team` (the calling one included).
int size(const Team* team);

// fn(ctx, t) for every thread t in [0, size) of the calling thread's team, t = 0 on the
// calling thread; returns once all are done, rethrowing the first exception a thread threw.
using TaskFn = void (*)(void* ctx, int thread);
void run(Team* team, TaskFn fn, void* ctx);

// A byte range of weights. `prefetch` replaces the ranges the waiting threads read ahead
// (at most kMaxRanges, taken as one run laid end to end): thread t >= 1 reads its share,
// [total * t / size, total * (t + 1) / size), from the front, at most kPrefetchBytes.
struct Range {
  const void* data;
  int64_t bytes;
};
constexpr int kMaxRanges = 4;
constexpr int64_t kPrefetchBytes = 256 * 1024;
void prefetch(Team* team, const Range* ranges, int count);

// body() on the calling thread with a team of at::get_num_threads() threads around it (or
// body() alone where there is one thread, the caller is in a parallel region already, or
// teams are off: set_enabled).
// An exception from body stops the team and comes out of with_team.
void with_team(const std::function<void()>& body);

// Whether with_team forms teams from now on (default true; false: every parallel loop opens
// its own region, as outside a stack call). Returns the previous setting.
bool set_enabled(bool enabled);

// Bytes each waiting thread has read ahead since the process started (all teams): what the
// tests check to know the reading ran.
int64_t prefetched_bytes();

}  // namespace plugserve::team
