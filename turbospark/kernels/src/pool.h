// A fixed team of threads for the kernels: the calling thread (MLX's stream thread) and one
// worker per other core given to the process.  A job is a number of chunks that the threads of
// the team take one at a time (an atomic counter), so a worker the OS has not scheduled yet
// (Python's thread wants the core too) delays nobody: the caller takes the chunks it does not,
// and waits only for a chunk a worker has begun.  Workers spin briefly after a job, yielding
// the core to whoever else wants it (the next matrix product of a step comes within
// microseconds), and then sleep, so an idle server costs nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <sched.h>
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

  // Runs f(0) .. f(chunks - 1), each once, on this thread and up to threads - 1 workers (all of
  // the team by default).  While another thread's job runs (two models on two streams), this
  // caller runs every chunk itself.
  void run(const std::function<void(int)>& f, int chunks, int threads = 0) {
    if (threads <= 0 || threads > size_) threads = size_;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || threads == 1 || chunks <= 1) {
      for (int i = 0; i < chunks; ++i) f(i);
      return;
    }
    Job job{&f, chunks, threads};
    job_.store(&job, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lock(m_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (int c; (c = job.next.fetch_add(1, std::memory_order_relaxed)) < chunks;) f(c);
    job_.store(nullptr, std::memory_order_seq_cst);
    // a worker that took the job finishes the chunk it began; one that comes later finds none
    while (active_.load(std::memory_order_seq_cst) != 0) cpu_relax();
  }

 private:
  struct Job {
    const std::function<void(int)>* f;
    int chunks;
    int threads;
    std::atomic<int> next{0};
  };

  void work(int id) {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if (++spins % 64 != 0) continue;
        if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(spin_us_)) {
          sched_yield();  // the core to Python's thread, if it is waiting for one
          continue;
        }
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (Job* job = job_.load(std::memory_order_seq_cst); job != nullptr && id < job->threads) {
        for (int c; (c = job->next.fetch_add(1, std::memory_order_relaxed)) < job->chunks;) (*job->f)(c);
      }
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const int size_;
  const int spin_us_;
  std::vector<std::thread> workers_;
  std::mutex busy_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int> active_{0};
};

// The process's team, made on first use with one thread per core of this process's CPU set
// (TURBOSPARK_KERNEL_THREADS overrides; TURBOSPARK_KERNEL_SPIN_US sets the spin, 200 us).
Pool& pool();
// How many of the team a decode step's quantized products and attention take: the whole team
// unless TURBOSPARK_KERNEL_STEP_THREADS (or set_step_threads) says otherwise.  Python's thread
// builds the next step's graph meanwhile (the engine pipelines its steps); since chunks are taken
// as threads come and idle workers yield, it costs the step little when it takes a core (decision
// 0031: with equal shares and a spinning worker, a team of two made the step 1.3x slower than
// the stream thread alone, so decision 0028 left one core to Python).
int step_parts();
// The setting behind it: 0 (the whole team), or a number of threads.
std::atomic<int>& step_setting();

} // namespace turbospark::kernels
