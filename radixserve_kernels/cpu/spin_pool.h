// A pool of worker threads for the decode kernels that spin briefly after each task before they sleep.
//
// Why not at::parallel_for: radixserve runs OpenMP PASSIVE (spinning OpenMP threads starve the engine's other threads
// on a busy 2-core machine), so every parallel region wakes a sleeping thread, ~30-50 us on the machines measured; a
// decode step of the default model opens ~50 of them for its large matrices. These workers spin for kSpinMicros
// after a task (the gap to the next linear of the same step is usually shorter), then sleep, so between steps they
// cost nothing. The pool has torch's thread count minus one workers; the caller takes chunks too, so when the
// workers are not running (a busy machine) it does the work alone rather than wait for them. While it spins, the
// first worker prefetches what the caller said the next runs will read (prefetch_ahead).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <unistd.h>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace radixserve {

class SpinPool {
 public:
  static constexpr int64_t kSpinMicros = 200;     // a worker's spin after a task before it sleeps
  static constexpr int64_t kWaitSpinMicros = 20;  // the caller's spin for workers still in a chunk before it sleeps

  // The process's pool, made on first use (again in a forked child, where the parent's workers do not exist).
  static SpinPool& get() {
    static std::mutex made;
    static SpinPool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || owner != getpid()) {
      pool = new SpinPool(std::max(at::get_num_threads(), 1) - 1);  // never freed: detached workers use it
      owner = getpid();
    }
    return *pool;
  }

  // f(begin, end) over [0, n) in chunks (`split`) claimed one at a time by the caller and the workers, so a worker
  // that is not running (a busy machine) only means the caller does more chunks itself. Returns when every chunk is
  // done. One caller at a time (the engine's step loop; others queue on run_mutex_).
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& f) {
    if (workers_.empty() || n < 2) {
      f(0, n);
      return;
    }
    std::lock_guard<std::mutex> one_caller(run_mutex_);
    task_ = &f;
    chunks_ = split(n, static_cast<int64_t>(workers_.size()) + 1);
    const uint64_t gen = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      claim_.store(gen << 32, std::memory_order_release);  // publishes the fields above: chunk 0 of run `gen`
    }
    cv_.notify_all();
    work(gen);
    // Close the run (a worker that looks now finds nothing), then wait for chunks still running on workers.
    claim_.store((gen << 32) | kClosed, std::memory_order_release);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kWaitSpinMicros);
    while (active_.load(std::memory_order_acquire) != 0 && std::chrono::steady_clock::now() < until) pause();
    if (active_.load(std::memory_order_acquire) != 0) {  // a worker was descheduled mid-chunk: free this core for it
      std::unique_lock<std::mutex> lock(mutex_);
      caller_waits_ = true;
      left_.wait(lock, [&] { return active_.load(std::memory_order_acquire) == 0; });
      caller_waits_ = false;
    }
  }

  // Memory the coming runs will read (the next linears' weights), for the first worker to prefetch once it has
  // left the current run: the caller is then in serial work (norms, attention, Python) during which no thread reads
  // weights, so the prefetched bytes are read from the caches when the next run starts instead of from DRAM. The
  // worker walks the regions in order, a slice at a time, and stops as soon as a run starts or newer regions come.
  // Only prefetch instructions touch them, so a region unmapped meanwhile costs nothing (a prefetch never faults).
  void prefetch_ahead(std::vector<std::pair<const uint8_t*, int64_t>> regions) {
    if (workers_.empty()) return;
    std::lock_guard<std::mutex> lock(ahead_mutex_);
    ahead_ = std::move(regions);
    ahead_gen_.fetch_add(1, std::memory_order_release);
  }

 private:
  // The smallest chunk: 1 / (kShares * threads) of a run. Chunks shrink to it from a 1 / (2 * threads) share of
  // what is left (guided), so a thread that finds none left waits for at most one small chunk on another: with 16
  // equal chunks the caller waited ~10 us a run for the worker's last one (~100 runs a decode step; RESULTS.md,
  // issue 38 session 27), while the first chunks stay large (a claim is a contended atomic).
  static constexpr int64_t kShares = 64;
  static constexpr int kMaxChunks = 256;  // a bound the shares reach before (~140 chunks at 16 threads)

  // bounds_[0 .. chunks] over [0, n); returns the number of chunks.
  int64_t split(int64_t n, int64_t threads) {
    const int64_t least = std::max<int64_t>(1, n / (kShares * threads));
    int64_t c = 0;
    bounds_[0] = 0;
    while (bounds_[c] < n) {
      const int64_t left = n - bounds_[c];
      const int64_t size = c + 1 == kMaxChunks ? left : std::max(least, left / (2 * threads));
      bounds_[c + 1] = bounds_[c] + std::min(size, left);
      c++;
    }
    return c;
  }
  static constexpr uint64_t kClosed = 0xFFFF0000u;  // an index past any run's chunks, with room for late claims
  static constexpr int64_t kAheadSlice = 16384;    // bytes prefetched between looks for a new run

  explicit SpinPool(int64_t workers) {
    for (int64_t i = 0; i < workers; i++) workers_.emplace_back([this, i] { loop(i == 0); });
    for (auto& t : workers_) t.detach();  // they live as long as the process
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Claim and run chunks of run `gen` until none is left (or the run is no longer `gen`).
  void work(uint64_t gen) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t index = word & 0xFFFFFFFFu;
      if ((word >> 32) != gen || index >= static_cast<uint64_t>(chunks_)) return;
      if (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) continue;
      const int64_t c = static_cast<int64_t>(index);
      (*task_)(bounds_[c], bounds_[c + 1]);
      word = claim_.load(std::memory_order_acquire);
    }
  }

  // Prefetch the posted regions until they end, a run after `seen` starts or newer regions are posted; returns the
  // posting walked.
  uint64_t walk_ahead(uint64_t seen) {
    std::vector<std::pair<const uint8_t*, int64_t>> regions;
    uint64_t posted;
    {
      std::lock_guard<std::mutex> lock(ahead_mutex_);
      regions = ahead_;
      posted = ahead_gen_.load(std::memory_order_acquire);
    }
    for (const auto& [data, bytes] : regions)
      for (int64_t off = 0; off < bytes; off += kAheadSlice) {
        if ((claim_.load(std::memory_order_acquire) >> 32) != seen || ahead_gen_.load(std::memory_order_acquire) != posted)
          return posted;
        for (int64_t o = off; o < std::min(bytes, off + kAheadSlice); o += 64) __builtin_prefetch(data + o, 0, 2);
      }
    return posted;
  }

  void loop(bool prefetcher) {
    uint64_t seen = 0, walked = 0;
    for (;;) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      auto current = [&] { return claim_.load(std::memory_order_acquire) >> 32; };
      while (current() == seen && std::chrono::steady_clock::now() < until) {
        if (prefetcher && ahead_gen_.load(std::memory_order_acquire) != walked) {
          walked = walk_ahead(seen);
          until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
          continue;
        }
        for (int i = 0; i < 64 && current() == seen; i++) pause();
        std::this_thread::yield();  // the caller, or anyone else, gets this core if it needs it
      }
      if (current() == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return current() != seen; });
      }
      // Announce before reading the run's fields: the caller rewrites them only once no worker is active.
      active_.fetch_add(1, std::memory_order_seq_cst);
      seen = current();
      work(seen);
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (caller_waits_) left_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable cv_, left_;  // a run started; the last active worker left a run the caller waits on
  bool caller_waits_ = false;
  std::atomic<uint64_t> claim_{0};  // run number << 32 | next chunk to claim
  std::atomic<int> active_{0};       // workers between reading a run's fields and leaving it
  std::mutex ahead_mutex_;
  std::vector<std::pair<const uint8_t*, int64_t>> ahead_;  // prefetch_ahead's regions
  std::atomic<uint64_t> ahead_gen_{0};                    // postings of them so far
  const std::function<void(int64_t, int64_t)>* task_ = nullptr;
  int64_t chunks_ = 1;
  std::array<int64_t, kMaxChunks + 1> bounds_{};
};

}  // namespace radixserve
