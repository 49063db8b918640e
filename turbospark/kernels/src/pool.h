// A fixed team of threads for the kernels: the calling thread (MLX's stream thread) and one
// worker per other core given to the process.  Every job is split into exactly size() parts and
// every thread runs one.  Workers spin briefly after a job (the next matrix product of a step
// comes within microseconds) and then sleep, so an idle server costs nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace turbospark::kernels {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  Pool(int threads, int spin_us) : size_(threads < 1 ? 1 : threads), spin_us_(spin_us) {
    for (int i = 1; i < size_; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  // Never destroyed (see pool()): workers asleep at exit are simply ended with the process.
  ~Pool() = delete;

  int size() const { return size_; }

  // Runs f(0) .. f(parts - 1) (parts <= size(); all of them by default), f(0) on this thread.
  // While another thread's job runs (two models on two streams), this caller runs every part
  // itself.
  void run(const std::function<void(int)>& f, int parts = 0) {
    if (parts <= 0 || parts > size_) parts = size_;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || parts == 1) {
      for (int i = 0; i < parts; ++i) f(i);
      return;
    }
    job_ = &f;
    parts_ = parts;
    remaining_.store(size_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(m_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    f(0);
    while (remaining_.load(std::memory_order_acquire) != 0) cpu_relax();
    job_ = nullptr;
  }

 private:
  void work(int id) {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if (++spins % 64 != 0) continue;
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(spin_us_)) continue;
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (id < parts_) (*job_)(id);
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int size_;
  const int spin_us_;
  std::vector<std::thread> workers_;
  std::mutex busy_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  const std::function<void(int)>* job_ = nullptr;
  int parts_ = 0;
};

// The process's team, made on first use with one thread per core of this process's CPU set
// (TURBOSPARK_KERNEL_THREADS overrides; TURBOSPARK_KERNEL_SPIN_US sets the spin, 200 us).
Pool& pool();
// How many of the team a decode step's quantized products and attention take: all but one (at
// least one), the one left to the Python thread that builds the next step's graph meanwhile
// (the engine pipelines its steps: on 2 cores a team of two made its decode 1.3x slower than the
// stream thread alone, decision 0028).  A prompt's work (attention over many query rows) and
// float weights (bound by memory, not arithmetic) take them all.
int step_parts();
// The setting behind it: 0 (all but one), or a number of threads (TURBOSPARK_KERNEL_STEP_THREADS).
std::atomic<int>& step_setting();

} // namespace turbospark::kernels
