// A persistent worker pool for data-parallel loops (CPU Adam).
//
// Threads are created once and parked on a condition variable, so a step
// over a small shard costs a wake-up rather than thread creation.  One loop
// runs at a time; concurrent callers queue on a mutex, which keeps the
// number of busy cores bounded by the largest num_threads requested.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace offloadd {

class ThreadPool {
 public:
  using Task = std::function<void(size_t task_index)>;

  // The process-wide pool.  After fork() the child gets a fresh pool: the
  // parent's worker threads do not exist there.
  static ThreadPool& instance();

  // Runs task(0 .. num_tasks-1) on up to num_threads threads, the caller
  // included, and returns when every task has finished.
  void parallel_for(size_t num_tasks, int num_threads, const Task& task);

 private:
  ThreadPool() = default;
  void ensure_workers(size_t count);
  void worker_loop(size_t worker_index);
  void drain_tasks();

  std::mutex run_mutex_;  // serialises parallel_for callers
  std::mutex state_mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::vector<std::thread> workers_;
  const Task* task_ = nullptr;
  size_t num_tasks_ = 0;
  std::atomic<size_t> next_task_{0};
  size_t workers_wanted_ = 0;  // workers with index < this join the current loop
  size_t workers_busy_ = 0;
  uint64_t generation_ = 0;    // bumped per loop so a worker never runs one twice
};

// Number of CPUs this process may run on (affinity mask, not the host count).
int available_cpus();

}  // namespace offloadd
