#include "thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

namespace offloadd {

ThreadPool& ThreadPool::instance() {
  // Hazard (fork): worker threads do not survive fork().  The old pool is
  // deliberately leaked in the child (its threads and maybe-locked mutexes
  // are unusable), and never destroyed at exit either, so no exit-time join
  // can hang on a parked worker.
  static pid_t owner_pid = 0;
  static ThreadPool* pool = nullptr;
  static std::mutex create_mutex;
  std::lock_guard<std::mutex> lock(create_mutex);
  if (pool == nullptr || owner_pid != getpid()) {
    pool = new ThreadPool();
    owner_pid = getpid();
  }
  return *pool;
}

void ThreadPool::ensure_workers(size_t count) {
  while (workers_.size() < count) {
    const size_t index = workers_.size();
    workers_.emplace_back([this, index] { worker_loop(index); });
  }
}

void ThreadPool::drain_tasks() {
  for (size_t t = next_task_.fetch_add(1); t < num_tasks_; t = next_task_.fetch_add(1)) {
    (*task_)(t);
  }
}

void ThreadPool::worker_loop(size_t worker_index) {
  uint64_t seen_generation = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(state_mutex_);
      work_ready_.wait(lock, [&] {
        return generation_ != seen_generation && worker_index < workers_wanted_;
      });
      seen_generation = generation_;
    }
    drain_tasks();
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (--workers_busy_ == 0) work_done_.notify_one();
  }
}

void ThreadPool::parallel_for(size_t num_tasks, int num_threads, const Task& task) {
  const size_t helpers = num_threads > 1 ? std::min(size_t(num_threads), num_tasks) - 1 : 0;
  if (helpers == 0) {
    for (size_t t = 0; t < num_tasks; ++t) task(t);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    ensure_workers(helpers);
    task_ = &task;
    num_tasks_ = num_tasks;
    next_task_.store(0);
    workers_wanted_ = helpers;
    workers_busy_ = helpers;
    ++generation_;
  }
  work_ready_.notify_all();
  drain_tasks();
  std::unique_lock<std::mutex> lock(state_mutex_);
  // Every helper must check in before `task` (a caller-owned object) dies.
  work_done_.wait(lock, [&] { return workers_busy_ == 0; });
  task_ = nullptr;
}

int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? int(online) : 1;
}

}  // namespace offloadd
